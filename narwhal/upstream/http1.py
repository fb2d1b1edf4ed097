"""A small HTTP/1.1 client on asyncio protocols, for the engine side of the relay: the
pool (`H1Pool`) and the response a caller reads (`H1Response`); one connection's protocol
(framing, bounds, idle timer, direct delivery) is h1conn.py's.

Why not a general-purpose client: on the relay path every engine event is one read, and a
layered client (httpx -> httpcore -> anyio) spends most of the router's CPU per event there
(docs/performance.md). This client does only what engines need: one request at a time
per connection, keep-alive pooling per host, Content-Length or chunked bodies (or
read-to-close), an idle timeout, and abort on close so an engine sees a client's
disconnect at once.

Rules
  * A response body that was not read to its end is never returned to the pool: the
    connection is aborted (that is how a cancelled request reaches the engine).
  * A request on a reused keep-alive connection that fails before any response byte is
    retried once on a new connection (the server closed the idle connection first).
  * Cleartext only: `http://` URLs. There is no TLS to engines (an `https://` engine URL
    is refused when the configuration loads, naming the engine).
  * Errors (h1conn.py): `ConnectTimeout`, `ReadTimeout`, `ConnectionFailed`,
    `BodyTooLarge` (`read` past its limit), all `H1Error`: words a client may read in
    `str(error)`, the address and the engine's bytes in `error.detail`, for the log.
  * Userinfo (`http://user:pass@host`) never goes on the wire as such: the Host header
    names host and port only, and the credentials become `Authorization: Basic ...`. An
    engine's credentials are better registered with `H1Pool.authorize` under its host and
    port, so that the URL the router passes around carries none (see `split_userinfo`).
"""

from __future__ import annotations

import asyncio
import base64
import os
import socket
from collections import deque
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from .h1conn import (
    _HEXDIG,
    IDLE_GRAIN,
    MIN_GRAIN_S,
    BodyTooLarge,
    ConnectionFailed,
    ConnectTimeout,
    H1Error,
    ReadTimeout,
    _Conn,
    _Wheel,
)

__all__ = [
    "H1Pool", "H1Response", "H1Error", "ConnectTimeout", "ReadTimeout", "ConnectionFailed", "BodyTooLarge",
    "split_userinfo", "basic_authorization",
    "_Conn", "_Wheel", "_HEXDIG",  # one connection's protocol (h1conn.py), as tests and benchmarks reach it here
]


def basic_authorization(user: str, password: str) -> str:
    """The Authorization header value of HTTP Basic authentication (RFC 7617, UTF-8)."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def split_userinfo(url: str) -> tuple[str, str | None]:
    """(the URL without userinfo, the Authorization value its userinfo stands for or None).
    Percent-escapes in the user name and password are decoded."""
    u = urlsplit(url)
    userinfo, at, hostport = u.netloc.rpartition("@")
    if not at:
        return url, None
    user, _, password = userinfo.partition(":")
    return urlunsplit((u.scheme, hostport, u.path, u.query, u.fragment)), basic_authorization(unquote(user), unquote(password))


TARGETS = 1024  # engine URLs whose parse H1Pool keeps (engines x routes; past it, parsed anew)


def _why(e: OSError) -> str:
    """A connect failure in words without the address (asyncio's own messages name it)."""
    if isinstance(e, socket.gaierror):
        return "name resolution failed"
    if e.errno is not None and e.errno > 0:
        return os.strerror(e.errno).lower()
    return "connection failed"


class H1Response:
    __slots__ = ("_pool", "_conn", "status", "headers", "_done")

    def __init__(self, pool: H1Pool, conn: _Conn) -> None:
        self._pool = pool
        self._conn = conn
        self.status = conn.status
        self.headers = conn.headers
        self._done = False

    async def next_chunk(self) -> bytes:
        data = await self._conn.next_chunk()
        if not data:
            self._done = True
        return data

    def direct(self, handler: Callable[[bytes], bool]) -> asyncio.Future[None]:
        """See _Conn.direct: the body to `handler` as it arrives, until it wants its task."""
        return self._conn.direct(handler)

    async def read(self, limit: int = 16 << 20) -> bytes:
        """The whole body; BodyTooLarge past `limit` bytes (nothing past it is kept)."""
        out = bytearray()
        while True:
            c = await self.next_chunk()
            if not c:
                return bytes(out)
            if len(out) + len(c) > limit:
                raise BodyTooLarge(f"sent a response body over {limit} bytes")
            out += c

    def close(self, *, complete: bool = False) -> None:
        """Release the connection: back to the pool when the body was read whole, else
        aborted (an engine sees an abandoned request end at once).

        complete: the caller saw the logical end of the response (an SSE stream's
        `data: [DONE]`); the framing's own end (the last chunk) may still be on its way,
        and the connection goes back to the pool when it arrives (within a short bound)."""
        conn = self._conn
        conn._cancel_timer()
        conn._direct = conn._direct_exc = None  # a reader cancelled in direct(): its handler is done
        if conn._state == "done" and conn.reusable and (self._done or complete):
            conn._chunks = []
            self._pool._release(conn)
        elif complete and conn._state == "body" and not conn.closed:
            conn._release_to = self._pool
            conn._chunks = []
            conn._timer = conn.loop.call_later(1.0, conn._check_idle)
        else:
            conn._abort()


class H1Pool:
    def __init__(self, *, connect_timeout_s: float = 2.0, idle_timeout_s: float = 30.0, max_idle_per_host: int = 1024) -> None:
        self.connect_timeout = connect_timeout_s
        self.idle_timeout = idle_timeout_s
        self.max_idle = max_idle_per_host
        self._idle: dict[tuple[str, int], deque[_Conn]] = {}
        self._auth: dict[tuple[str, int], str] = {}  # (host, port) -> Authorization
        self._targets: dict[str, tuple[tuple[str, int], str, str, str, bool, str | None]] = {}  # url -> _target(url)
        self.connects = 0  # connections opened, for tests and metrics
        self._wheel: _Wheel | None = None

    async def _connect(self, key: tuple[str, int]) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel that
            # arrives in the turn the connection completes (an R13 deadline, a client
            # gone), and the request would run on (tests/engines/test_http1.py)
            async with asyncio.timeout(self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Conn(key, loop, self.idle_timeout, self._wheel_for(loop)), key[0], key[1])
        except TimeoutError:
            ms = f"{self.connect_timeout * 1000:g}"
            raise ConnectTimeout(f"no connection within {ms} ms", f"connect to {key[0]}:{key[1]} timed out after {ms} ms") from None
        except OSError as e:
            why = _why(e)
            raise ConnectionFailed(f"unreachable ({why})", f"connect to {key[0]}:{key[1]}: {why} ({e})") from None
        self.connects += 1
        return conn

    def _wheel_for(self, loop: asyncio.AbstractEventLoop) -> _Wheel:
        grain = max(MIN_GRAIN_S, self.idle_timeout * IDLE_GRAIN)
        w = self._wheel
        if w is None or w.loop is not loop or w.grain != grain:
            w = self._wheel = _Wheel(loop, grain)
        return w

    def _release(self, conn: _Conn) -> None:
        q = self._idle.setdefault(conn.key, deque())
        if len(q) < self.max_idle:
            conn._state = "idle"
            q.append(conn)
        else:
            conn._abort()

    def _take(self, key: tuple[str, int]) -> _Conn | None:
        q = self._idle.get(key)
        while q:
            c = q.pop()
            if not c.closed and c.transport is not None and not c.transport.is_closing():
                return c
        return None

    def _key(self, u: Any) -> tuple[str, int]:
        return (u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80))

    def _target(self, url: str) -> tuple[tuple[str, int], str, str, str, bool, str | None]:
        """What a request to `url` is sent with, parsed once per URL (at most TARGETS kept):
        (host and port, scheme, path with its query, the Host header, whether the URL
        carries userinfo, the Basic credentials it makes). Userinfo never goes in Host."""
        u = urlsplit(url)
        path = (u.path or "/") + (f"?{u.query}" if u.query else "")
        netloc = u.netloc
        user_auth = None
        userinfo = "@" in netloc
        if userinfo:
            _, user_auth = split_userinfo(url)
            netloc = netloc.rpartition("@")[2]
        t = (self._key(u), u.scheme, path, netloc, userinfo, user_auth)
        if len(self._targets) >= TARGETS:
            self._targets.clear()
        self._targets[url] = t
        return t

    def authorize(self, url: str, authorization: str) -> None:
        """Send `Authorization: authorization` on every request to url's host and port."""
        self._auth[self._key(urlsplit(url))] = authorization

    async def request(self, method: str, url: str, *, body: bytes = b"", headers: dict[str, str] | None = None, timeout_s: float | None = None,
                      sent: Callable[[], None] | None = None) -> H1Response:
        """Send a request; return once the response head arrived. `sent()`, if given, is
        called once the request is written, before the wait for the head (work the caller
        does while the engine works on the request); once only, a raise ends the request."""
        t = self._targets.get(url)
        if t is None:
            t = self._target(url)
        key, scheme, path, netloc, userinfo, user_auth = t
        if scheme != "http":  # config validation refuses others at start-up (narwhal/config.py)
            raise ConnectionFailed(f"only http:// engine URLs are supported, not {scheme}://")
        auth = user_auth if userinfo else self._auth.get(key)
        head = [f"{method} {path} HTTP/1.1\r\nHost: {netloc}\r\nContent-Length: {len(body)}\r\n"]
        if auth is not None and not (headers and any(k.lower() == "authorization" for k in headers)):
            head.append(f"Authorization: {auth}\r\n")
        for k, v in (headers or {}).items():
            head.append(f"{k}: {v}\r\n")
        head.append("\r\n")
        data = "".join(head).encode("latin-1") + body
        for attempt in (0, 1):
            conn = self._take(key)
            reused = conn is not None
            if conn is None:
                conn = await self._connect(key)
            if timeout_s is not None:
                conn.idle_timeout = timeout_s
            else:
                conn.idle_timeout = self.idle_timeout
            conn.start(data)
            try:
                if sent is not None:
                    sent, done = None, sent
                    done()
                await conn.wait_head()
            except ConnectionFailed:
                conn._abort()
                if reused and not conn.got_bytes and attempt == 0:
                    continue  # the engine closed the idle connection first: once more, fresh
                raise
            except BaseException:
                conn._abort()
                raise
            return H1Response(self, conn)
        raise ConnectionFailed("unreachable")  # pragma: no cover

    def forget(self, url: str) -> None:
        """An engine left the fleet: close its idle connections, drop its credentials."""
        key = self._key(urlsplit(url))
        for c in self._idle.pop(key, ()):
            c._abort()
        self._auth.pop(key, None)

    def close(self) -> None:
        for q in self._idle.values():
            for c in q:
                c._abort()
        self._idle.clear()

    def stats(self) -> dict[str, Any]:
        return {"connects": self.connects, "idle": sum(len(q) for q in self._idle.values())}
