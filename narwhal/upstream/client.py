"""One pooled, keep-alive HTTP client for every engine call (narwhal/upstream/http1.py).

The router talks HTTP/1.1 to engines: closing an HTTP/1.1 connection aborts the engine
request, which is how a client's disconnect reaches the engine (httpx over HTTP/2 never
sends RST_STREAM, docs/stack.md). Transport failures become values of one small table, most
specific first, mapped to failure rows:

    no byte for the idle timeout         -> E07 engine_timeout (upstream.idle_timeout_ms)
    a body over its limit                -> E02 malformed_engine_output
    no connection within the connect     -> E06 engine_unreachable, naming
      timeout                               upstream.connect_timeout_ms
    any other transport error            -> E06 engine_unreachable

A connect timeout is a connect failure (E06), not E07: E07's message speaks of an engine
that went quiet for upstream.idle_timeout_ms, which would send an operator to the wrong
knob.

An UpstreamError's `detail` is words a client may read (no engine address, no engine
bytes); `log_detail` keeps both for the log. Engine URLs with userinfo: the credentials
are registered with `authorize` under the engine's own URL (Basic, on every request under
that URL: two engines behind one host and port keep their own, issue 40 item 10; the pool
keyed them by host and port, and a later engine's replaced an earlier one's) and the URL
the router keeps and publishes is the one without them (`split_userinfo`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import orjson

from narwhal_generated import errors as E

from .http1 import (
    BodyTooLarge,
    ConnectionFailed,
    ConnectTimeout,
    H1Error,
    H1Pool,
    H1Response,
    ReadTimeout,
    split_userinfo,
)

__all__ = ["EngineClient", "UpstreamError", "Upstream", "H1Error", "split_userinfo"]


@dataclass(frozen=True, slots=True)
class UpstreamError(Exception):
    """A transport failure talking to an engine; `row` is E02, E06 or E07 (the generated
    row itself, never its ID as a string)."""

    row: E.ErrorRow
    detail: str  # for clients: words, no address, no engine bytes
    log_detail: str = ""  # for the log: with the address and the bytes

    def __str__(self) -> str:
        return f"{self.row.id}: {self.detail}"


def _map(exc: H1Error) -> UpstreamError:
    if isinstance(exc, ReadTimeout):
        return UpstreamError(E.E07, str(exc), exc.detail)
    if isinstance(exc, ConnectTimeout):
        return UpstreamError(E.E06, f"{exc} (upstream.connect_timeout_ms)", exc.detail)
    if isinstance(exc, BodyTooLarge):
        return UpstreamError(E.E02, str(exc), exc.detail)
    return UpstreamError(E.E06, str(exc), exc.detail)


class Upstream:
    """An open engine response: status and headers read, body not yet."""

    __slots__ = ("_resp", "status")

    def __init__(self, resp: H1Response) -> None:
        self._resp = resp
        self.status = resp.status

    def next_raw(self) -> Coroutine[Any, Any, bytes]:
        """The relay loop's reader: the connection's own, raising H1Error (map it with
        `mapped`); b"" at the end of the body. (Methods, not bound methods kept: those
        would live as long as the stream.)"""
        return self._resp.next_chunk()

    def direct(self, handler: Callable[[bytes], bool]) -> Awaitable[None]:
        """The other: the body to a handler from the connection's callback (H1Response.direct)."""
        return self._resp.direct(handler)

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("content-type", "")

    async def next_chunk(self) -> bytes:
        """Body bytes received since the last call (all of them, coalesced); b"" at the end."""
        try:
            return await self._resp.next_chunk()
        except H1Error as e:
            raise _map(e) from None

    @staticmethod
    def mapped(e: H1Error) -> UpstreamError:
        return _map(e)

    async def read(self, limit: int = 16 << 20) -> bytes:
        try:
            return await self._resp.read(limit)
        except H1Error as e:
            raise _map(e) from None

    def cut(self, detail: str) -> None:
        """The router ends this exchange now (the engine left the fleet): the reader gets
        E06 with `detail` (words for a client)."""
        self._resp._conn.fail(ConnectionFailed(detail, detail))

    async def aclose(self, *, complete: bool = False) -> None:
        """complete: the response ended logically (data: [DONE] seen): keep the connection."""
        self._resp.close(complete=complete)


class EngineClient:
    def __init__(self, *, connect_timeout_s: float = 2.0, idle_timeout_s: float = 30.0, max_connections: int = 4096, max_body_bytes: int = 4 << 20) -> None:
        self.idle_timeout_s = idle_timeout_s
        self.max_body_bytes = max_body_bytes  # a whole (non-streaming) engine body: upstream.max_event_bytes
        self._pool = H1Pool(connect_timeout_s=connect_timeout_s, idle_timeout_s=idle_timeout_s, max_idle_per_host=max_connections)
        self._json_headers = {"content-type": "application/json", "accept": "text/event-stream, application/json"}
        self._auth: dict[str, str] = {}  # an engine's URL (no userinfo, no trailing /) -> Authorization
        self._auth_of: dict[str, str | None] = {}  # a request URL -> its engine's Authorization (memo; cleared on change)

    async def open(self, method: str, url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None, timeout_s: float | None = None,
                   sent: Callable[[], None] | None = None) -> Upstream:
        """Send a request and return once the engine's response head arrived; `sent()`
        is called once the request is written, before the wait (H1Pool.request)."""
        h = self._json_headers if not headers else {**self._json_headers, **headers}
        if self._auth:
            auth = self._auth_of[url] if url in self._auth_of else self._find(url)
            if auth is not None and not (headers and "authorization" in headers):
                h = {**h, "authorization": auth}
        try:
            resp = await self._pool.request(method, url, body=body or b"", headers=h, timeout_s=timeout_s, sent=sent)
        except H1Error as e:
            raise _map(e) from None
        return Upstream(resp)

    def authorize(self, url: str, authorization: str) -> None:
        """Send `Authorization: authorization` on every request under the engine URL `url`
        (its own: not another engine's at the same host and port)."""
        self._auth[url.rstrip("/")] = authorization
        self._auth_of.clear()

    def _find(self, url: str) -> str | None:
        """The Authorization of the engine whose URL is the longest prefix of `url` (at a
        path boundary); remembered per request URL (a few per engine)."""
        best, got = -1, None
        for base, auth in self._auth.items():
            if len(base) > best and url.startswith(base) and (len(url) == len(base) or url[len(base)] in "/?"):
                best, got = len(base), auth
        if len(self._auth_of) > 64 * (len(self._auth) + 16):  # bounded: never more than the routes of the fleet
            self._auth_of.clear()
        self._auth_of[url] = got
        return got

    async def post_json(self, url: str, obj: Any, *, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """A non-streaming request; the body is bounded by max_body_bytes (E02 past it)."""
        up = await self.open("POST", url, body=orjson.dumps(obj), headers=headers)
        try:
            return up.status, await up.read(self.max_body_bytes)
        finally:
            await up.aclose()

    async def get(self, url: str, *, timeout_s: float) -> int:
        return (await self.get_body(url, timeout_s=timeout_s))[0]

    async def get_body(self, url: str, *, timeout_s: float, limit: int = 1 << 20) -> tuple[int, bytes]:
        """(status, body) of a GET, the body bounded by `limit` (E02 past it)."""
        up = await self.open("GET", url, timeout_s=timeout_s)
        try:
            body = await up.read(limit)
            return up.status, body
        finally:
            await up.aclose()

    def reconfigure(self, *, connect_timeout_s: float, idle_timeout_s: float, max_body_bytes: int) -> None:
        """A configuration reload's upstream bounds, for every request from now on."""
        self.idle_timeout_s = idle_timeout_s
        self.max_body_bytes = max_body_bytes
        self._pool.connect_timeout = connect_timeout_s
        self._pool.idle_timeout = idle_timeout_s

    def forget(self, url: str) -> None:
        """The engine at url left the fleet: its idle connections and credentials go."""
        if self._auth.pop(url.rstrip("/"), None) is not None:
            self._auth_of.clear()
        self._pool.forget(url)

    def stats(self) -> dict[str, Any]:
        return self._pool.stats()

    async def aclose(self) -> None:
        self._pool.close()
