"""One engine connection of the HTTP/1.1 client (http1.py): the asyncio protocol that
parses a response (head, Content-Length or chunked body, or read-to-close), bounds it,
times it out when idle, and hands its body to the consumer; and the wheel of idle
deadlines the pool's connections share.

Rules
  * Errors: `ConnectTimeout`, `ReadTimeout` (idle for idle_timeout_s; checked on a `_Wheel`, at most idle_timeout_s/16 late), `ConnectionFailed`
    (refused, reset, closed early, protocol violation) and `BodyTooLarge` (`read` past its
    limit), all subclasses of `H1Error`. `str(error)` says what happened in words a client
    may read: never an address, never the engine's bytes. `error.detail` adds both, for
    the log.
  * A consumer may take the body as it arrives instead (`H1Response.direct(handler)`): the
    handler is called from `data_received` with each read's decoded bytes, in order, and
    nothing queues; when it returns False (it wants its task), or raises, direct delivery
    stops and the awaiting task wakes. Bytes that arrive after that queue as usual.
    A handler whose `native` is true is first offered each read that begins at a chunk
    boundary of a chunked body, undecoded (`handler.whole(data)`). True: it took the read,
    framing and all; it may only when the read is exactly one whole chunk (not the last),
    so the decoder is at a chunk boundary after it as before (worker/direct.py's compiled
    step takes nothing else). False: decoded and handed over as above.
  * Bounded: the response head (status line and headers) and the trailers of a chunked
    body at _MAX_HEAD bytes, a chunk-size line at 1,024, the body `read` collects at its
    limit, and the decoded bytes waiting for the consumer at _HIGH_WATER (reading pauses).
    The head is collected in a bytearray and searched from where the last search ended.
  * A body read to its end goes back to the pool that lent the connection (`_release_to`:
    any object with `_release(conn)`, the pool; this module does not know http1.py).
"""

from __future__ import annotations

import asyncio
import math
import socket
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["H1Error", "ConnectTimeout", "ReadTimeout", "ConnectionFailed", "BodyTooLarge", "IDLE_GRAIN", "MIN_GRAIN_S"]

_MAX_HEAD = 64 * 1024
_HIGH_WATER = 1 << 20
IDLE_GRAIN = 1 / 16  # an idle deadline is checked at most this share of idle_timeout_s late
MIN_GRAIN_S = 0.005


class H1Error(Exception):
    """str(): what happened, in words (no address, no engine bytes); detail: for the log."""

    def __init__(self, message: str, detail: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail or message


class ConnectTimeout(H1Error):
    pass


class ReadTimeout(H1Error):
    pass


class ConnectionFailed(H1Error):
    pass


class BodyTooLarge(H1Error):
    pass


class _Wheel:
    """The idle deadlines of a pool's connections, in slots of `grain` seconds: one loop
    timer per occupied slot, not one per connection (a TimerHandle with its libuv timer
    is ~0.5 KiB per open stream). Invariant: a connection in slot k has a deadline in
    ((k-1)*grain, k*grain] and is checked when slot k's timer fires, so at most `grain`
    late; a connection whose timer was cancelled is no longer in its slot."""

    __slots__ = ("loop", "grain", "slots")

    def __init__(self, loop: asyncio.AbstractEventLoop, grain: float) -> None:
        self.loop = loop
        self.grain = grain
        self.slots: dict[int, dict[_Conn, None]] = {}

    def add(self, conn: _Conn, due: float) -> int:
        k = math.ceil(due / self.grain)
        slot = self.slots.get(k)
        if slot is None:
            slot = self.slots[k] = {}
            self.loop.call_at(k * self.grain, self._fire, k)
        slot[conn] = None
        return k

    def remove(self, conn: _Conn, k: int) -> None:
        slot = self.slots.get(k)
        if slot is not None:
            slot.pop(conn, None)

    def _fire(self, k: int) -> None:
        for c in self.slots.pop(k, None) or ():
            c._check_idle()


_HEXDIG = b"0123456789abcdefABCDEF"
_KEPT = {n: n for n in ("connection", "transfer-encoding", "content-length", "content-type")}  # response headers kept (names shared)


class _Conn(asyncio.Protocol):
    """One connection. State: head -> body -> done; `_chunks` holds decoded body bytes
    the consumer has not taken yet."""

    __slots__ = (
        "key", "loop", "transport", "closed", "_buf", "_state", "_remaining", "_chunked",
        "_chunks", "_chunks_len", "_waiter", "_eof", "_error", "status", "headers", "keep_alive",
        "got_bytes", "last_rx", "_timer", "idle_timeout", "_paused", "_head_waiter", "_release_to", "_head",
        "_direct", "_direct_exc", "_wheel", "_whole",
    )

    def __init__(self, key: tuple[str, int], loop: asyncio.AbstractEventLoop, idle_timeout: float, wheel: _Wheel) -> None:
        self.key = key
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_timeout = idle_timeout
        self._wheel = wheel
        self._timer: int | None = None  # the wheel's slot while armed
        self._paused = False
        self._release_to: Any = None  # the H1Pool to release to when the body ends (http1.py)
        self._direct: Callable[[bytes], bool] | None = None  # the consumer's handler while direct
        self._direct_exc: BaseException | None = None
        self._whole = False  # the handler takes whole reads at a chunk boundary (`whole`)
        self._reset()

    def _reset(self) -> None:
        self._buf = b""
        self._head = bytearray()  # the response head while it arrives
        self._state = "idle"
        self._remaining = 0
        self._chunked = False
        self._chunks: list[bytes] = []
        self._chunks_len = 0
        self._waiter: asyncio.Future[None] | None = None
        self._head_waiter: asyncio.Future[None] | None = None
        self._eof = False
        self._error: BaseException | None = None
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = True
        self.got_bytes = False
        self.last_rx = 0.0

    # -- asyncio.Protocol ------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are not asyncio.Transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:
                pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._state in ("head", "body") and self._error is None:
            if self._state == "body" and not self._chunked and self._remaining < 0:
                self._eof = True  # read-to-close body ended
                self._state = "done"
            else:
                self._error = ConnectionFailed("closed the connection", f"connection closed by the engine ({exc or 'EOF'})")
        self._wake()
        self._cancel_timer()

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self.last_rx = self.loop.time()
        d = self._direct
        if d is not None and self._whole and self._remaining == 0 and not self._buf and not self._chunks and self._state == "body":
            # a read at a chunk boundary, nothing queued: the handler may take it whole,
            # framing and all (`whole`, see H1Response.direct); if not, it is decoded below
            try:
                if d.whole(data):  # type: ignore[attr-defined]  # _whole: it has one
                    return
            except Exception as e:  # noqa: BLE001 - the consumer's task raises it
                self._direct_exc = e
                self._wake()
                return
        if self._state == "idle" or self._state == "done":
            return  # bytes after a response: ignored (the connection will not be reused)
        try:
            if self._state == "head":
                rest = self._feed_head(data)
                if rest is None:
                    return  # the head goes on
                data = rest
            self._buf = self._buf + data if self._buf else data
            self._parse()
        except H1Error as e:
            self._error = e
            self._abort()
        if self._release_to is not None and self._state == "done":
            pool, self._release_to = self._release_to, None
            self._cancel_timer()
            if self.reusable:
                pool._release(self)
            else:
                self._abort()
            return
        if self._direct is None or self._chunks or self._error is not None or self._eof:
            self._wake()  # (a handler that took this read keeps its task asleep)

    def eof_received(self) -> bool | None:
        return False

    # -- parsing ---------------------------------------------------------------------

    def _feed_head(self, data: bytes) -> bytes | None:
        """Collect the response head; parse it once whole. Returns the bytes after it, or
        None while it goes on. Linear: each search starts where the last one ended."""
        h = self._head
        scan = max(0, len(h) - 3)
        h += data
        end = h.find(b"\r\n\r\n", scan)
        if end < 0:
            if len(h) > _MAX_HEAD:
                raise ConnectionFailed(f"sent a response head over {_MAX_HEAD} bytes")
            return None
        if end > _MAX_HEAD:
            raise ConnectionFailed(f"sent a response head over {_MAX_HEAD} bytes")
        rest = bytes(h[end + 4 :])
        self._head = bytearray()
        self._parse_head(bytes(h[:end]))
        return rest

    def _parse_head(self, head: bytes) -> None:
        lines = head.split(b"\r\n")
        parts = lines[0].split(b" ", 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise ConnectionFailed("answered something that is not an HTTP/1.x response", f"not an HTTP/1.x response: {lines[0][:80]!r}")
        try:
            self.status = int(parts[1])
        except ValueError:
            raise ConnectionFailed("sent a malformed HTTP status line", f"bad status line {lines[0][:80]!r}") from None
        h = self.headers
        for ln in lines[1:]:
            k, sep, v = ln.partition(b":")
            if sep:
                name = _KEPT.get(k.strip().lower().decode("latin-1"))
                if name is not None:  # what the framing and the consumer read; the rest dropped (memory per open stream)
                    h[name] = sys.intern(v.strip().decode("latin-1"))  # one copy of "text/event-stream" for every stream
        if h.get("connection", "").lower() == "close" or parts[0] == b"HTTP/1.0":
            self.keep_alive = False
        te = h.get("transfer-encoding", "").lower()
        if "chunked" in te:
            self._chunked = True
            self._remaining = 0
        elif "content-length" in h:
            cl = h["content-length"]
            if not cl.isdigit() or not cl.isascii():
                raise ConnectionFailed("sent a malformed Content-Length", f"bad Content-Length {cl[:40]!r}")
            self._remaining = int(cl)
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self._remaining = 0
        else:
            self._remaining = -1  # read to close
            self.keep_alive = False
        self._state = "body"
        if self._head_waiter is not None and not self._head_waiter.done():
            self._head_waiter.set_result(None)
        if not self._chunked and self._remaining == 0:
            self._state = "done"
            self._eof = True

    def _parse(self) -> None:
        """Decode the body bytes waiting in _buf onto _chunks."""
        if self._state != "body" or not self._buf:
            return
        if not self._chunked:
            data = self._buf
            self._buf = b""
            if self._remaining >= 0:
                if len(data) >= self._remaining:
                    data = data[: self._remaining]
                    self._remaining = 0
                    self._state = "done"
                    self._eof = True
                else:
                    self._remaining -= len(data)
            self._push(data)
            return
        buf = self._buf
        if self._remaining == 0:
            # the common read: exactly one whole chunk (what the loop below does with it,
            # without the loop); anything else -- a size line that is not hex digits alone
            # (an extension, blanks, a bad size), more or less than one chunk, the last
            # chunk -- goes the loop's way
            nl = buf.find(b"\r\n")
            size_s = buf[:nl]
            if 0 < nl <= 16 and not size_s.lstrip(_HEXDIG):  # hex digits only (1*HEXDIG)
                size = int(size_s, 16)
                end = nl + 2 + size
                if size > 0 and len(buf) == end + 2 and buf.endswith(b"\r\n"):
                    self._buf = b""
                    self._push(buf[nl + 2 : end])
                    return
        pos = 0
        out = []
        while True:
            if self._remaining > 0:
                take = min(self._remaining, len(buf) - pos)
                if take <= 0:
                    break
                out.append(buf[pos : pos + take])
                pos += take
                self._remaining -= take
                if self._remaining:
                    break
                self._remaining = -2  # expect CRLF after the chunk data
            if self._remaining == -2:
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ConnectionFailed("sent malformed chunked encoding", "bad chunk terminator")
                pos += 2
                self._remaining = 0
            nl = buf.find(b"\r\n", pos)
            if nl < 0:
                if len(buf) - pos > 1024:
                    raise ConnectionFailed("sent malformed chunked encoding", "chunk size line over 1024 bytes")
                break
            size_s = buf[pos:nl].split(b";", 1)[0].strip()
            # RFC 9112 chunk-size = 1*HEXDIG: int() alone also takes "-5", "+5", "0x5", "1_0"
            if not size_s or size_s.lstrip(_HEXDIG):
                raise ConnectionFailed("sent malformed chunked encoding", f"bad chunk size {size_s[:20]!r}")
            size = int(size_s, 16)
            if size == 0:
                # the last chunk: the body ends at the blank line after any trailers
                if buf.find(b"\r\n\r\n", nl) < 0:
                    if len(buf) - pos > _MAX_HEAD:
                        raise ConnectionFailed(f"sent trailers over {_MAX_HEAD} bytes")
                    break  # wait for the rest; pos still points at this size line
                self._state = "done"
                self._eof = True
                pos = len(buf)
                break
            pos = nl + 2
            self._remaining = size
        self._buf = buf[pos:]
        if out:
            self._push(out[0] if len(out) == 1 else b"".join(out))

    def _push(self, data: bytes) -> None:
        if data:
            d = self._direct
            if d is not None and not self._chunks:
                try:
                    if d(data):
                        return
                except Exception as e:  # noqa: BLE001 - the consumer's task raises it
                    self._direct_exc = e
                self._direct = None  # the data was the handler's; the task takes over
                return
            self._chunks.append(data)
            self._chunks_len += len(data)
            if self._chunks_len > _HIGH_WATER and self.transport is not None and not self._paused:
                self.transport.pause_reading()
                self._paused = True

    def _wake(self) -> None:
        self._direct = None  # a woken task reads on with next_chunk: no more reads go to a handler
        w = self._waiter
        if w is not None and not w.done():
            e = self._direct_exc
            if e is not None:  # the handler raised: its task raises it (direct)
                self._direct_exc = None
                w.set_exception(e)
            else:
                w.set_result(None)
        hw = self._head_waiter
        if hw is not None and not hw.done() and (self._error is not None or self.closed):
            hw.set_result(None)

    # -- timers ----------------------------------------------------------------------

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = self._wheel.add(self, self.last_rx + self.idle_timeout)

    def _check_idle(self) -> None:
        self._timer = None
        if self._release_to is not None:  # the rest of a finished body never came
            self._release_to = None
            self._abort()
            return
        if self._state not in ("head", "body"):
            return
        due = self.last_rx + self.idle_timeout
        if self.loop.time() >= due:
            self._error = ReadTimeout(f"sent nothing for {self.idle_timeout:g} s")
            self._abort()
            self._wake()
        else:
            self._timer = self._wheel.add(self, due)

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._wheel.remove(self, self._timer)
            self._timer = None

    def fail(self, error: H1Error) -> None:
        """End the exchange now with `error` (the router cut it): the reader wakes and
        raises it, the connection is aborted (the engine sees the request end)."""
        if self._error is None:
            self._error = error
        self._abort()
        self._wake()

    def _abort(self) -> None:
        self.closed = True
        self.keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    # -- consumer side ---------------------------------------------------------------

    def start(self, data: bytes) -> None:
        self._reset()
        self._state = "head"
        self.last_rx = self.loop.time()
        assert self.transport is not None
        self.transport.write(data)
        self._arm()

    async def wait_head(self) -> None:
        while self._state == "head" and self._error is None and not self.closed:
            self._head_waiter = self.loop.create_future()
            self._arm()
            await self._head_waiter
        self._head_waiter = None  # not held for the stream's life
        if self._error is not None:
            raise self._error
        if self._state == "head":
            raise ConnectionFailed("closed the connection before the response head")

    async def next_chunk(self) -> bytes:
        """The body bytes received since the last call; b"" at the end of the body."""
        while True:
            if self._chunks:
                data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
                self._chunks = []
                self._chunks_len = 0
                if self._paused and self.transport is not None:
                    self.transport.resume_reading()
                    self._paused = False
                return data
            if self._error is not None:
                raise self._error
            if self._eof:
                self._cancel_timer()
                return b""
            if self.closed:
                raise ConnectionFailed("closed the connection before the end of the body")
            self._waiter = self.loop.create_future()
            self._arm()
            await self._waiter
            self._waiter = None

    def direct(self, handler: Callable[[bytes], bool]) -> asyncio.Future[None]:
        """Deliver the body to `handler` from data_received until it returns False or
        raises, an error or the end of the body comes, or bytes queue; the future returned
        is done then (raising what the handler raised), and the caller reads on with
        next_chunk. No coroutine of its own: an open stream waits on this future alone
        (memory per open stream). Every wake-up ends the handler's turn (_wake); so does
        the response's close. Idle timeout as next_chunk's."""
        w = self._waiter = self.loop.create_future()
        if self._chunks or self._error is not None or self._eof or self.closed:
            w.set_result(None)
            return w
        self._direct = handler
        # a handler with `native` true also has `whole(data) -> bool`: a read that starts
        # at a chunk boundary, offered before it is decoded (True: taken, framing and all)
        self._whole = self._chunked and getattr(handler, "native", False)
        self._arm()
        return w

    @property
    def reusable(self) -> bool:
        return self._state == "done" and self.keep_alive and not self.closed and not self._buf
