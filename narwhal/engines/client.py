"""One pooled, keep-alive HTTP client for every engine call.

The router talks HTTP/1.1 to engines: closing an HTTP/1.1 connection aborts the engine
request, which is how a client's disconnect reaches the engine (httpx over HTTP/2 never
sends RST_STREAM, STACK.md). Transport failures become values of one small table, most
specific first, mapped to failure rows:

    timeout while connecting or reading  -> E07 engine_timeout
    any other transport error            -> E06 engine_unreachable
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

__all__ = ["EngineClient", "UpstreamError", "Upstream"]


@dataclass(frozen=True, slots=True)
class UpstreamError(Exception):
    """A transport failure talking to an engine; `row` is E06 or E07."""

    row: str
    detail: str

    def __str__(self) -> str:
        return f"{self.row}: {self.detail}"


def _map(exc: Exception) -> UpstreamError:
    if isinstance(exc, httpx.TimeoutException):
        return UpstreamError("E07", type(exc).__name__)
    return UpstreamError("E06", f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class Upstream:
    """An open engine response: status and headers read, body not yet."""

    __slots__ = ("_resp", "status", "_cm")

    def __init__(self, resp: httpx.Response, cm: Any) -> None:
        self._resp = resp
        self._cm = cm
        self.status = resp.status_code

    @property
    def content_type(self) -> str:
        return self._resp.headers.get("content-type", "")

    async def chunks(self) -> AsyncIterator[bytes]:
        """Raw body bytes as they arrive (no decoding, no buffering)."""
        try:
            async for chunk in self._resp.aiter_raw():
                yield chunk
        except (httpx.TransportError, httpx.StreamError) as e:
            raise _map(e) from None

    async def read(self, limit: int = 16 << 20) -> bytes:
        out = bytearray()
        async for c in self.chunks():
            out += c
            if len(out) > limit:
                raise UpstreamError("E02", f"engine response over {limit} bytes")
        return bytes(out)

    async def aclose(self) -> None:
        await self._cm.__aexit__(None, None, None)


class EngineClient:
    def __init__(self, *, connect_timeout_s: float = 2.0, idle_timeout_s: float = 30.0, max_connections: int = 4096) -> None:
        self.idle_timeout_s = idle_timeout_s
        self._c = httpx.AsyncClient(
            http1=True,
            http2=False,
            timeout=httpx.Timeout(connect=connect_timeout_s, read=idle_timeout_s, write=idle_timeout_s, pool=connect_timeout_s),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections, keepalive_expiry=60.0),
            trust_env=False,
        )

    async def open(self, method: str, url: str, *, body: bytes | None = None, headers: dict[str, str] | None = None) -> Upstream:
        """Send a request and return once the engine's response headers arrived."""
        h = {"content-type": "application/json", "accept": "text/event-stream, application/json"}
        if headers:
            h.update(headers)
        cm = self._c.stream(method, url, content=body, headers=h)
        try:
            resp = await cm.__aenter__()
        except (httpx.TransportError, httpx.StreamError) as e:
            raise _map(e) from None
        return Upstream(resp, cm)

    async def post_json(self, url: str, obj: Any, *, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        up = await self.open("POST", url, body=orjson.dumps(obj), headers=headers)
        try:
            return up.status, await up.read()
        finally:
            await up.aclose()

    async def get(self, url: str, *, timeout_s: float) -> int:
        try:
            r = await self._c.get(url, timeout=timeout_s)
            return r.status_code
        except (httpx.TransportError, httpx.StreamError) as e:
            raise _map(e) from None

    async def aclose(self) -> None:
        await self._c.aclose()
