"""HTTP/2 served over the `h2` library's public API: one client connection's frames in,
ASGI streams out (conn.LeanConnection runs it: ALPN h2, a prior-knowledge preface, or an
h2c upgrade from h1.cycle).

The connection is h2's `H2Connection`; what Narwhal adds is the ASGI cycle per stream and
the hardening a public router needs (hyper.py's defects, each fixed here by construction):

  D1  flow control: a stream's body is sent as far as its window allows; with a zero
      window the app's send waits for a WINDOW_UPDATE (nothing is buffered for it), so a
      client that reads nothing holds its sender, and serving.send_stall_ms drops it.
  D2  stream limit: a stream past serving.max_streams_per_connection is refused
      (RST_STREAM REFUSED_STREAM) -- its headers decoded, HPACK kept in step -- and the
      connection goes on (RFC 9113 5.1.2). h2 would raise TooManyStreamsError and lose
      HPACK state; `_Connection` (overrides.py lists it) leaves the count to us.
  D3  a stream whose app ended without finishing its answer is reset CANCEL.
  D4  control frames (SETTINGS, PING, RST_STREAM, empty DATA) and refused streams are
      charged to a token bucket per connection; a flood gets GOAWAY ENHANCE_YOUR_CALM,
      the connection closes and its address is penalised (defect 8). A stream opened and
      reset in the same read (rapid reset) is never offered to the app and costs
      RAPID_RESET_COST tokens.
  D9  a read is fed to h2 in FEED_BYTES pieces with a loop turn between them.
  D10 a stream closed with its app's receive queue full drops the unread body and
      queues http.disconnect without waiting.
  Also: a request while the server stops is reset and MAX_CONCURRENT_STREAMS set to 0; the
  connection idle and the server stopping: GOAWAY; Updated(idle) drives the keep-alive
  timer as for HTTP/1.1.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hypercorn.events import Closed, RawData, Updated

from . import hyper
from .h1fast import CLOSE, CloseHook
from .scope import ServerSide, http_scope, response_headers, tell_disconnect

__all__ = ["H2Server", "H2Stream", "FEED_BYTES", "RAPID_RESET_COST"]

FEED_BYTES = 4096  # D9: bytes of one read handed to h2 per loop turn
RAPID_RESET_COST = 3  # D4: control-frame tokens a stream opened and reset in one read costs
_CONTROL = (h2.events.RemoteSettingsChanged, h2.events.PingReceived, h2.events.StreamReset)
_BUSY, _IDLE_NOW = Updated(idle=False), Updated(idle=True)


class _Connection(h2.connection.H2Connection):
    """D2: h2's connection, its public `open_inbound_streams` answering 0, so that h2 never
    raises TooManyStreamsError (which would lose the HPACK state); H2Server refuses a stream
    past the limit itself once h2 has decoded it."""

    @property
    def open_inbound_streams(self) -> int:
        return 0


class _Bucket:
    __slots__ = ("rate", "tokens", "at")

    def __init__(self, rate: float) -> None:
        self.rate, self.tokens, self.at = rate, 2.0 * rate, time.monotonic()

    def take(self, n: float = 1.0) -> bool:
        now = time.monotonic()
        self.tokens = min(2.0 * self.rate, self.tokens + (now - self.at) * self.rate)
        self.at = now
        self.tokens -= n
        return self.tokens >= 0.0


class H2Server(ServerSide):
    """One client connection's HTTP/2 (module docstring). `lean` is the conn.LeanConnection."""

    def __init__(self, app: Any, config: Any, context: Any, group: Any, state: Any, ssl: bool, client: Any, server: Any, lean: Any) -> None:
        super().__init__(app, config, context, group, state, ssl, client, server, lean)
        self.conn = c = _Connection(config=h2.config.H2Configuration(client_side=False, header_encoding=None))
        c.local_settings = h2.settings.Settings(client=False, initial_values={
            h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: config.h2_max_concurrent_streams,
            h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: config.h2_max_header_list_size,
        })
        self.limit = config.h2_max_concurrent_streams
        self.streams: dict[int, H2Stream] = {}
        self.requests = 0
        self.closed = False
        self.calmed = False
        self.bucket = _Bucket(hyper.limits().control_frames_per_s)
        self.windows: list[asyncio.Future[None]] = []  # D1: senders waiting for a window
        self.counted = True
        hyper.COUNTS.h2 += 1

    async def initiate(self, headers: list[tuple[bytes, bytes]] | None = None, settings: bytes | None = None) -> None:
        if settings is not None:
            self.conn.initiate_upgrade_connection(settings)
        else:
            self.conn.initiate_connection()
        await self.flush()
        if headers is not None:  # the upgraded request: stream 1, its body (none) ended
            await self._open(1, headers)
            st = self.streams.get(1)
            if st is not None:
                await st.body_end()

    async def handle(self, event: Any) -> None:
        if type(event) is RawData:
            data = event.data
            for i in range(0, len(data), FEED_BYTES):  # D9
                if self.calmed or self.closed:
                    return
                if i:
                    await asyncio.sleep(0)
                await self._receive(data[i : i + FEED_BYTES])
        elif type(event) is Closed:
            if self.counted:
                self.counted = False
                hyper.COUNTS.h2 -= 1
            self.closed = True
            for sid in list(self.streams):
                await self._close_stream(sid)
            self.wake()

    async def _receive(self, data: bytes) -> None:
        try:
            events = self.conn.receive_data(data)
        except h2.exceptions.ProtocolError:
            await self.flush()
            await self.send(Closed())
            return
        await self._events(events)

    async def _events(self, events: list[Any]) -> None:
        if self.calmed:
            return
        reset = {ev.stream_id for ev in events if type(ev) is h2.events.StreamReset}
        if reset:  # D4, rapid reset: opened and reset in one read, never offered
            born = {ev.stream_id for ev in events if type(ev) is h2.events.RequestReceived} & reset
            if born:
                events = [ev for ev in events if getattr(ev, "stream_id", None) not in born or type(ev) is h2.events.StreamReset]
                if not self.bucket.take((RAPID_RESET_COST - 1) * len(born)):
                    await self._calm()
                    return
        for ev in events:  # D4
            control = isinstance(ev, _CONTROL) or (type(ev) is h2.events.DataReceived and not ev.data and ev.stream_ended is None)
            if control and not self.bucket.take():
                await self._calm()
                return
        c = self.conn
        for ev in events:
            kind = type(ev)
            if kind is h2.events.RequestReceived:
                sid = ev.stream_id
                if len(self.streams) >= self.limit:  # D2 (counted as the events come: one read may open many)
                    c.reset_stream(sid, h2.errors.ErrorCodes.REFUSED_STREAM)
                    hyper.COUNTS.refused_streams += 1
                    if not self.bucket.take():  # D4: each refusal costs a RST_STREAM
                        await self._calm()
                        return
                elif self.context.terminated.is_set():
                    c.reset_stream(sid)
                    c.update_settings({h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 0})
                else:
                    await self._open(sid, ev.headers)
                    await self.send(_BUSY)
                if self.requests > self.config.keep_alive_max_requests:
                    c.close_connection()
            elif kind is h2.events.DataReceived:
                st = self.streams.get(ev.stream_id)
                if st is not None:
                    await st.body(ev.data)
                try:
                    c.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                except h2.exceptions.StreamClosedError:
                    pass
            elif kind is h2.events.StreamEnded:
                st = self.streams.get(ev.stream_id)
                if st is not None:
                    await st.body_end()
            elif kind is h2.events.StreamReset:
                await self._close_stream(ev.stream_id)
                self.wake()
            elif kind is h2.events.WindowUpdated or kind is h2.events.RemoteSettingsChanged:
                self.wake()
            elif kind is h2.events.ConnectionTerminated:
                await self.send(Closed())
        await self.flush()

    async def _calm(self) -> None:
        self.calmed = True
        hyper.COUNTS.calmed += 1
        peer = self.client[0] if self.client else None
        if peer:  # defect 8
            hyper.PENALTIES.penalise(peer, hyper.limits().abuse_penalty_s, time.monotonic())
        self.conn.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, additional_data=b"too many control frames")
        await self.flush()
        await self.send(Closed())

    async def _open(self, sid: int, headers: list[tuple[bytes, bytes]]) -> None:
        st = H2Stream(self, sid)
        self.streams[sid] = st
        self.requests += 1
        await st.start(headers)
        await self.context.mark_request()

    async def _close_stream(self, sid: int) -> None:
        st = self.streams.pop(sid, None)
        if st is not None:
            await st.closed_event()
            self.wake()

    async def stream_closed(self, sid: int) -> None:
        """A stream's answer is done (or abandoned): closed, the idle state told."""
        await self._close_stream(sid)
        idle = not self.streams
        if idle and self.context.terminated.is_set():
            self.conn.close_connection()
            await self.flush()
        await self.send(_IDLE_NOW if idle else _BUSY)

    async def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            await self.send(RawData(data=data))

    def wake(self) -> None:
        ws, self.windows = self.windows, []
        for w in ws:
            if not w.done():
                w.set_result(None)

    async def window(self) -> None:
        """D1: until a window may have opened (a WINDOW_UPDATE, new settings, a reset, the
        connection's close)."""
        w = asyncio.get_running_loop().create_future()
        self.windows.append(w)
        await w


class H2Stream:
    """One HTTP/2 request's ASGI cycle (its scope, receive queue and send)."""

    __slots__ = ("proto", "sid", "state", "closed", "app_put", "scope", "response", "start_time", "hook", "method")

    def __init__(self, proto: H2Server, sid: int) -> None:
        self.proto = proto
        self.sid = sid
        self.state = "request"
        self.closed = False
        self.app_put: Any = None
        self.scope: Any = None
        self.response: Any = None
        self.start_time = 0.0
        self.hook: CloseHook | None = None
        self.method = "GET"

    async def start(self, raw: list[tuple[bytes, bytes]]) -> None:
        p = self.proto
        config = p.config
        self.start_time = time.time()
        method, target, authority, host = b"GET", b"", None, b""
        headers = [(b"host", b"")]
        for name, value in raw:
            if name == b":method":
                method = value
            elif name == b":path":
                target = value
            elif name == b":authority":
                authority = value
            elif name == b"host":
                host = value
            elif name[:1] != b":":
                headers.append((name, value))
        headers[0] = (b"host", authority if authority is not None else host)
        self.method = method.decode("ascii").upper()
        self.scope = scope = http_scope("2", self.method, target, headers, p, config, {})
        scope["extensions"][CLOSE] = self.hook = CloseHook()
        if config.server_names and headers[0][1].decode() not in config.server_names:
            await self._head(404, [(b"content-length", b"0")], end=True)
            self.state = "closed"
            self.closed = True
            await config.log.access(scope, {"status": 404, "headers": []}, time.time() - self.start_time)
            return
        self.app_put = await p.group.spawn_app(p.app, config, scope, self.app_send)

    async def body(self, data: bytes) -> None:
        if not self.closed and self.app_put is not None:
            await self.app_put({"type": "http.request", "body": bytes(data), "more_body": True})

    async def body_end(self) -> None:
        if not self.closed and self.app_put is not None:
            await self.app_put({"type": "http.request", "body": b"", "more_body": False})

    async def closed_event(self) -> None:
        """The stream closed: the hook fires, the app is told http.disconnect (D10)."""
        if self.closed:
            return
        self.closed = True
        if self.hook is not None:
            self.hook.fire()
        if self.state != "closed":
            await self.proto.config.log.access(self.scope, None, time.time() - self.start_time)
        if self.app_put is not None:
            await tell_disconnect(self.app_put)  # D10

    async def _head(self, status: int, headers: list[tuple[bytes, bytes]], *, end: bool = False) -> None:
        p = self.proto
        try:
            p.conn.send_headers(self.sid, [(b":status", b"%d" % status), *headers, *p.config.response_headers("h2")], end_stream=end)
        except h2.exceptions.ProtocolError:  # reset, or the connection closed, meanwhile
            return
        await p.flush()

    async def _data(self, data: bytes) -> None:
        """D1: as much as the window allows at a time, waiting for it to open."""
        p = self.proto
        c = p.conn
        while data:
            if self.closed or p.closed:
                return
            try:
                n = min(c.local_flow_control_window(self.sid), c.max_outbound_frame_size, len(data))
            except h2.exceptions.ProtocolError:
                return
            if n <= 0:
                await p.window()
                continue
            try:
                c.send_data(self.sid, data[:n])
            except h2.exceptions.ProtocolError:
                return
            data = data[n:]
            await p.flush()

    async def _end(self) -> None:
        p = self.proto
        if not self.closed and not p.closed:
            try:
                p.conn.end_stream(self.sid)
            except h2.exceptions.ProtocolError:
                return
            await p.flush()

    async def app_send(self, message: Any) -> None:
        p = self.proto
        if message is None:  # the app has ended
            if not self.closed:
                if self.state == "request":
                    await self._head(500, [(b"content-length", b"0")], end=True)
                    self.state = "closed"
                    await p.config.log.access(self.scope, {"status": 500, "headers": []}, time.time() - self.start_time)
                elif self.state != "closed":  # D3: an answer begun and abandoned
                    try:
                        p.conn.reset_stream(self.sid, h2.errors.ErrorCodes.CANCEL)
                        await p.flush()
                    except h2.exceptions.ProtocolError:
                        pass
                await p.stream_closed(self.sid)
            return
        kind = message["type"]
        if kind == "http.response.start" and self.state == "request":
            self.response = message
            headers = response_headers(message)
            status = int(message["status"])
            await self._head(status, headers)
            self.state = "response"
        elif kind == "http.response.body" and self.state == "response":
            body = message.get("body", b"")
            status = int(self.response["status"])
            if body and not (self.method == "HEAD" or 100 <= status < 200 or status in (204, 304)):
                await self._data(bytes(body))
            if not message.get("more_body", False):
                await self._end()
                self.state = "closed"
                await p.config.log.access(self.scope, self.response, time.time() - self.start_time)
                await p.stream_closed(self.sid)
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} in state {self.state}")
