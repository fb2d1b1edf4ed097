"""The load tool's HTTP clients: a raw asyncio HTTP/1.1 client (keep-alive pool, chunked and
Content-Length bodies, SSE split as bytes arrive) and an HTTP/2 client over httpx (h2c by
prior knowledge on http://, ALPN on https://).

Rules
  * The HTTP/1.1 client is an `asyncio.Protocol`: bytes are parsed in `data_received`,
    with no stream reader, no per-line awaits and no header objects. It costs a few
    microseconds per SSE event, so one load-tool core drives far more events than a
    Python router relays (docs/stack.md: 7-8k events/s per core).
  * A `Recorder` receives the response: status and headers once, then body bytes as they
    arrive, then the end. `SSERecorder` splits events, timestamps the first and last
    output-carrying event and counts tokens (the `token_ids` list length when present,
    else one per output event); an error event marks the result as an error. For a
    non-streaming response it parses the JSON at the end: completion tokens from usage,
    the refusal or error `code` from an error envelope.
  * HTTP/2: `H2Pool` drives the `h2` state machine from an asyncio.Protocol (h2c by prior
    knowledge, a few connections, streams spread over them, a large receive window so no
    per-event WINDOW_UPDATE); `H2Client` uses httpx (needed for https/ALPN; httpx speaks
    h2c only with `http1=False, http2=True`, docs/stack.md) and costs several times more CPU
    per event.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import orjson

from .stats import Result

if TYPE_CHECKING:
    from .h2 import H2Client, H2Pool

__all__ = ["SSERecorder", "H1Pool", "make_client", "split_url", "connect"]

T = TypeVar("T")

_clock = time.perf_counter
_OUTPUT_KEYS = ("content", "reasoning_content", "reasoning", "refusal")


def split_url(url: str) -> tuple[str, str, int, str]:
    u = urlsplit(url)
    port = u.port or (443 if u.scheme == "https" else 80)
    return u.scheme, u.hostname or "127.0.0.1", port, u.path.rstrip("/")


async def connect(opening: Awaitable[T], rec: SSERecorder) -> T | None:
    """A pool's connection, or None with the connect error (and the send time) in rec.r."""
    try:
        return await opening
    except (OSError, TimeoutError) as e:
        rec.r.sent = rec.r.sent or _clock()
        rec.r.error = f"connect: {type(e).__name__}: {e}"
        return None


class SSERecorder:
    """Fills one `Result` from a streaming (SSE) or JSON response.

    `SSERecorder.tokens_seen` counts output tokens over every recorder of the process, so
    a benchmark can read token throughput over a time window."""

    __slots__ = ("r", "_buf", "_body", "_sse", "done")
    tokens_seen = 0

    def __init__(self, result: Result) -> None:
        self.r = result
        self._buf = b""
        self._body: list[bytes] = []
        self._sse = False
        self.done = False

    def on_headers(self, status: int, headers: dict[bytes, bytes], now: float) -> None:
        r = self.r
        r.status = status
        r.headers_at = now
        self._sse = status == 200 and headers.get(b"content-type", b"").startswith(b"text/event-stream")
        ra = headers.get(b"retry-after")
        if ra is not None:
            r.retry_after = ra.decode("latin-1")

    def on_body(self, data: bytes, now: float) -> None:
        if not self._sse:
            self._body.append(data)
            return
        if b"\r" in data:
            data = data.replace(b"\r\n", b"\n")
        buf = self._buf + data if self._buf else data
        start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            self._event(buf[start:end], now)
            start = end + 2
        self._buf = buf[start:]

    def _event(self, ev: bytes, now: float) -> None:
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            r = self.r
            r.events += 1
            if payload == b"[DONE]":
                self.done = True
                return
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                r.error = r.error or "malformed SSE event"
                return
            if type(obj) is not dict:
                continue
            err = obj.get("error")
            if err is not None:
                r.error = r.error or f"error event: {str(err)[:200]}"
                if type(err) is dict and err.get("code"):
                    r.code = str(err.get("code"))
                continue
            k = 0
            for c in obj.get("choices") or ():
                if type(c) is not dict:
                    continue
                ids = c.get("token_ids")
                if type(ids) is list and ids:
                    k += len(ids)
                    continue
                d = c.get("delta")
                src = d if type(d) is dict else c
                if src.get("text") or src.get("tool_calls") or any(src.get(x) for x in _OUTPUT_KEYS):
                    k += 1
            if k:
                SSERecorder.tokens_seen += k
                if r.first_token_at is None:
                    r.first_token_at = now
                r.last_token_at = now
                r.tokens += k

    def on_end(self, now: float) -> None:
        r = self.r
        r.done_at = now
        if self._sse:
            if not self.done and r.error is None:
                r.error = "stream ended without data: [DONE]"
            return
        raw = b"".join(self._body)
        try:
            obj = orjson.loads(raw) if raw else None
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict):
            err = obj.get("error")
            if isinstance(err, dict):
                r.code = str(err.get("code") or err.get("type") or "") or None
            elif err is not None:
                r.code = str(err)[:80]
            if r.status == 200 and obj.get("choices"):
                u = obj.get("usage") or {}
                r.tokens = int(u.get("completion_tokens") or 1)
                r.first_token_at = r.last_token_at = now  # a non-streaming answer's TTFT is its e2e
        if r.status != 200 and r.error is None and not r.refused:
            r.error = f"HTTP {r.status}: {raw[:160].decode('utf-8', 'replace')}"
        elif r.status == 200 and r.first_token_at is None and r.error is None:
            r.error = "no completion in a 200 response"


class _H1Conn(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, one request at a time."""

    def __init__(self, pool: H1Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.rec: SSERecorder | None = None
        self.fut: asyncio.Future[bool] | None = None
        self.buf = b""
        self.state = 0  # 0 head, 1 chunk size, 2 chunk data, 3 chunk CRLF, 4 content-length, 5 until close, 6 trailers
        self.left = 0
        self.keep = True
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.fut is not None and not self.fut.done():
            if self.state == 5 and self.rec is not None:
                self.rec.on_end(_clock())
                self.fut.set_result(False)
            else:
                self.fut.set_exception(ConnectionError(f"connection closed mid-response ({exc or 'EOF'})"))

    def send(self, raw: bytes, rec: SSERecorder) -> asyncio.Future[bool]:
        assert self.transport is not None
        self.rec = rec
        self.state = 0
        self.buf = b""
        self.keep = True
        self.fut = asyncio.get_running_loop().create_future()
        rec.r.sent = _clock()
        self.transport.write(raw)
        return self.fut

    def _finish(self, now: float) -> None:
        rec, fut = self.rec, self.fut
        self.rec = self.fut = None
        if rec is not None:
            rec.on_end(now)
        if fut is not None and not fut.done():
            fut.set_result(self.keep)

    def _head(self, head: bytes, rec: SSERecorder, now: float) -> bool:
        """The status line and headers (once a response): the body's framing next; False
        (and the connection failed) on a status line that does not parse."""
        lines = head.split(b"\r\n")
        try:
            status = int(lines[0].split(b" ", 2)[1])
        except (IndexError, ValueError):
            self._fail("bad status line")
            return False
        headers: dict[bytes, bytes] = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            headers[k.strip().lower()] = v.strip()
        if headers.get(b"connection", b"").lower() == b"close":
            self.keep = False
        rec.on_headers(status, headers, now)
        if b"chunked" in headers.get(b"transfer-encoding", b"").lower():
            self.state = 1
        elif b"content-length" in headers:
            self.left = int(headers[b"content-length"])
            self.state = 4
        else:
            self.state = 5
            self.keep = False
        return True

    def data_received(self, data: bytes) -> None:
        now = _clock()
        rec = self.rec
        if rec is None:
            return
        buf = self.buf + data if self.buf else data
        i = 0
        n = len(buf)
        while i < n or self.state == 4 and self.left == 0:
            st = self.state
            if st == 0:
                end = buf.find(b"\r\n\r\n", i)
                if end < 0:
                    break
                if not self._head(buf[i:end], rec, now):
                    return
                i = end + 4
            elif st == 1:
                end = buf.find(b"\r\n", i)
                if end < 0:
                    break
                size = int(buf[i:end].split(b";", 1)[0], 16)
                i = end + 2
                if size == 0:
                    self.state = 6
                else:
                    self.left = size
                    self.state = 2
            elif st == 2:
                take = min(self.left, n - i)
                rec.on_body(buf[i:i + take], now)
                i += take
                self.left -= take
                if self.left == 0:
                    self.state = 3
            elif st == 3:
                if n - i < 2:
                    break
                i += 2
                self.state = 1
            elif st == 6:  # trailers: up to an empty line
                end = buf.find(b"\r\n", i)
                if end < 0:
                    break
                line = buf[i:end]
                i = end + 2
                if not line:
                    self.buf = b""
                    self._finish(now)
                    return
            elif st == 4:
                take = min(self.left, n - i)
                if take:
                    rec.on_body(buf[i:i + take], now)
                i += take
                self.left -= take
                if self.left == 0:
                    self.buf = b""
                    self._finish(now)
                    return
            else:  # 5: until close
                rec.on_body(buf[i:], now)
                i = n
        self.buf = buf[i:]

    def _fail(self, why: str) -> None:
        if self.fut is not None and not self.fut.done():
            self.fut.set_exception(ConnectionError(why))
        self.keep = False
        if self.transport is not None:
            self.transport.close()


class H1Pool:
    """Keep-alive HTTP/1.1 connections to one origin; a new one whenever none is idle
    (open-loop load needs one per request in flight)."""

    def __init__(self, url: str, *, headers: dict[str, str] | None = None, connect_timeout_s: float = 5.0) -> None:
        scheme, self.host, self.port, self.prefix = split_url(url)
        if scheme != "http":
            raise ValueError("the raw HTTP/1.1 client speaks cleartext only; use --http 2 (httpx) for https")
        self.connect_timeout_s = connect_timeout_s
        hdr = f"Host: {self.host}:{self.port}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self._hdr = hdr.encode()
        self._idle: list[_H1Conn] = []
        self._all: set[_H1Conn] = set()
        self.opened = 0

    async def _conn(self) -> _H1Conn:
        while self._idle:
            c = self._idle.pop()
            if not c.closed:
                return c
        loop = asyncio.get_running_loop()
        _, c = await asyncio.wait_for(loop.create_connection(lambda: _H1Conn(self), self.host, self.port), self.connect_timeout_s)
        self.opened += 1
        self._all.add(c)
        return c

    def _raw(self, method: str, path: str, body: bytes | None, headers: dict[str, str] | None) -> bytes:
        extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items()).encode()
        if body is None:
            return f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode() + self._hdr + extra + b"\r\n"
        return (
            f"{method} {self.prefix}{path} HTTP/1.1\r\n".encode() + self._hdr + extra
            + b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )

    async def request(self, method: str, path: str, body: bytes | None, rec: SSERecorder, *, headers: dict[str, str] | None = None, timeout_s: float = 60.0) -> None:
        """Send one request; the recorder gets the response. Errors land in rec.r.error."""
        c = await connect(self._conn(), rec)
        if c is None:
            return
        fut = c.send(self._raw(method, path, body, headers), rec)
        try:
            keep = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            rec.r.error = rec.r.error or f"timeout after {timeout_s:g} s"
            self._drop(c)
            return
        except ConnectionError as e:
            rec.r.error = rec.r.error or f"{e}"
            self._drop(c)
            return
        except asyncio.CancelledError:
            self._drop(c)
            raise
        if keep and not c.closed:
            self._idle.append(c)
        else:
            self._drop(c)

    def _drop(self, c: _H1Conn) -> None:
        self._all.discard(c)
        if c.transport is not None:
            c.transport.close()

    async def aclose(self) -> None:
        for c in list(self._all):
            self._drop(c)
        self._idle.clear()
        await asyncio.sleep(0)


def make_client(url: str, http: str = "1", *, headers: dict[str, str] | None = None) -> H1Pool | H2Pool | H2Client:
    """http "1": the raw HTTP/1.1 client; "2": HTTP/2 (raw h2c by prior knowledge on http://,
    httpx with ALPN on https://); "2-httpx": HTTP/2 through httpx on http:// too."""
    from .h2 import H2Client, H2Pool

    if http in ("1", "1.1", "h1"):
        return H1Pool(url, headers=headers)
    if http in ("2", "h2", "h2c"):
        return H2Client(url, headers=headers) if url.startswith("https:") else H2Pool(url, headers=headers)
    if http == "2-httpx":
        return H2Client(url, headers=headers)
    raise ValueError(f"--http must be 1 or 2, not {http!r}")


Factory = Callable[[], Any]
