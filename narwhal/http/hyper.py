"""hypercorn 0.18, hardened: the upstream defects a public router cannot live with, fixed
at the layer they live in, in this one file (the pieces of items 11, 12 and 15 the app
uses live in h1fast.py, the lean primitives of items 12 and 14 in lean.py, the
connection of defects 5, 6, 8 and items 14 and 16 in conn.py).
`install(limits)` swaps the subclasses in before serving; everything else is hypercorn's
own code.

Upstream defects (docs/stack.md "hypercorn's defects"; hypercorn 0.18.0, h2 4.x):
  1. h2 flow control: `H2Protocol._send_data` pops min(window, frame size) bytes; with a
     zero window that is `StreamBuffer.pop(0)`, which un-pauses the writer, so an app's
     sends never block and a stream's buffer grows without bound while the client reads
     nothing. Fixed: with a zero window nothing is popped; the stream waits for a
     WINDOW_UPDATE (the writer stays paused at the buffer's high-water mark, 32 KiB).
  2. h2 stream limit: a stream beyond SETTINGS_MAX_CONCURRENT_STREAMS raises h2's
     TooManyStreamsError out of `receive_data`, and hypercorn drops the whole connection
     (every other stream on it). RFC 9113 5.1.2: refuse the stream. Fixed: the headers
     are decoded (HPACK state stays in step) and the stream is reset REFUSED_STREAM.
  3. h2 streams the app abandoned (a client that never read; its answer was given up)
     keep their buffer and stream slot. Fixed: reset CANCEL, buffer dropped.
  4. h2 control frames are not rate limited (SETTINGS/PING floods slowed other clients
     100x). Fixed: a token bucket per connection over SETTINGS, PING, RST_STREAM and
     empty DATA frames; a flood gets GOAWAY ENHANCE_YOUR_CALM and the connection closes.
     Rapid reset (CVE-2023-44487): a stream whose HEADERS and RST_STREAM arrive in the
     same read is dropped before hypercorn creates it, so it costs no ASGI task and never
     reaches the app (the app's own check catches a reset that arrives later); it is
     charged RAPID_RESET_COST tokens, the frames parsed for it.
  5. After a client's FIN the connection waits for the keep-alive timer (CLOSE-WAIT, a
     file descriptor held up to keep_alive_timeout). Fixed: EOF stops the idle timer.
  6. Not hypercorn's but the kernel's: a client socket's send buffer autotunes up to
     net.ipv4.tcp_wmem's maximum (4 MiB here), so a client that never reads makes the
     router relay megabytes (tens of thousands of events, and their CPU) before its
     writes block. Bounded: SO_SNDBUF of CLIENT_SNDBUF per client socket, ample for
     token streams (a few KB/s each) and for any answer the router assembles.
  7. hypercorn answers bytes that are not an HTTP/1.1 request (400) and an oversized head
     (431) with an empty body. Fixed: the error envelope of rows H08 and H09.
  8. Not a hypercorn defect but what the calm answer above leaves open: an attacker whose
     connection got ENHANCE_YOUR_CALM reconnects at once, and every frame of the next
     flood is parsed again. Bounded: its address is penalised for
     serving.abuse_penalty_ms; while penalised, its new connections are closed at accept,
     before any byte is read (at most PENALTY_ADDRESSES addresses, oldest forgotten). The
     app penalises the same way for abuse it sees itself (`penalise`: row H10).
  9. hypercorn hands h2 a whole read (up to 64 KiB) at once, and h2 parses every frame in
     it before the loop runs anything else: 520 streams' HEADERS in one read cost ~50 ms of
     pure-Python parsing, a stall for every other client. Fixed: a read is fed to h2 in
     FEED_BYTES pieces with a loop turn between them (no more bytes are read from that
     connection meanwhile), so one connection holds the loop ~5 ms at most per turn.
     Streams refused past the stream limit (2) count against the control-frame bucket
     (4): each costs a RST_STREAM, and a client that keeps opening them is flooding.
  10. A deadlock: the app's receive queue holds max_app_queue_size (10) messages, and
     the connection's reader blocks putting more body into it. An app that answers
     before reading the whole body (408 H07, R03, a client gone) ends its stream, and
     hypercorn then puts http.disconnect into that same full queue from the app's own
     task: the app waits for itself, the reader waits for the app, the connection and
     the request are held for ever (1-byte chunked uploads left every request open).
     Fixed: when the queue is full at StreamClosed, the unread body messages are
     dropped (nobody will read them) and the disconnect is queued without waiting.
  11. Not a defect but the relay's cost: every ASGI send of a stream's body goes through
     hypercorn's app_send -> h11 framing -> the connection's send lock -> StreamWriter.write
     -> drain, a third of the router's CPU per relayed event (docs/performance.md). For an
     HTTP/1.1 response with chunked framing, `H1Direct` (scope extension DIRECT) writes a
     body chunk straight to the connection's transport, framed as h11 frames it, from
     any callback (no task, no await) -- but only while that is exactly what the ASGI path
     would do: the stream is in its response body, h11 is sending a chunked body, nothing
     else holds the send lock, and the transport's buffer is under DIRECT_BUFFER (past it
     the ASGI path, whose drain waits, takes over: a client that reads nothing still
     blocks its sender, and serving.send_stall_ms still drops it). The response start
     (item 15) and end (item 17) go through h11's own state machine too, so it sees a
     whole, valid message.
  12. Memory per open stream: hypercorn's per-request asyncio.Queue (four deques and an
     Event, 3.3 KiB before anything waits) and its asyncio.Event per HTTP/1.1 connection
     and two per HTTP/2 stream (0.86 KiB each) are swapped for `lean.LeanQueue` and
     `lean.LeanEvent`, same semantics, nothing allocated until something waits.
  13. Not a defect: every response's head gets hypercorn's Date header, formatted anew
     each time (wsgiref's format_date_time, 3 % of the router's CPU at 200 short requests
     a second). `ServerConfig` keeps the headers of the current second per protocol.
  14. Not a defect: hypercorn's keep-alive timer is a task (wait_for inside it makes a
     second) stopped when each request starts and restarted when it ends, each time
     cancelled and awaited: loop turns on every request's path before the app runs.
     `lean.LeanIdle` is the same rule as one loop timer (LeanConnection.idle_task).
  15. Not a defect: h11 rebuilds every response head it sends (content-length dropped,
     transfer-encoding set, each a pass over all headers with its regexes, and a third
     when the Response is made again). `H1Direct.start` builds the SSE head as h11 would
     leave it and sends it through `PreparedH11` as built, with the first event in the
     same write (one segment to the client, not two).
  16. Not a defect: hypercorn's asyncio server gives each connection a task reading
     through a StreamReader, a StreamWriter and an asyncio.TaskGroup (~6 KiB per open
     connection, a quarter of an open stream's cost). conn.py's `LeanConnection` is its
     TCPServer as one protocol object -- with defects 5, 6 and 8 and item 14 -- handing
     each read to hypercorn's ProtocolWrapper from data_received; `conn.serve` is its
     worker_serve with that connection. The rules live there; this file's classes are
     what it serves with.
  17. Not a defect: a stream's end through ASGI is two sends -- its last events (a write
     of their own), then http.response.body with more_body False: app_send, EndBody
     through h11 and the send lock (a second write), the access log, StreamClosed.
     `H1Direct.end` writes the last events and h11's last chunk in one write under
     write's guards and moves h11 and the stream on as those sends would; `closed()` is
     the StreamClosed that follows (the recycle for the next request is hypercorn's).
  18. Not a defect: h11 reads a request head line by line, a regex and a match per header
     line, then validates every header again in `Request` (~20 us warm, ~70 in the
     router's loop, the largest single part of a request's intake). `PreparedH11` reads
     a whole head of the common shape (POST or GET, HTTP/1.1, plain field lines, within
     16 KiB) with `h1head.parse_head`: one regex over its field lines, the same Request
     h11's reader would make; anything else -- and every error and limit -- is h11's, and
     everything after the head (state, keep-alive, Expect, the body) goes on as h11's.
  19. Not a defect: a request's cycle through h11 and hypercorn is an event at a time --
     next_event's Request, Data and EndOfMessage, each through h11's state machine and a
     hypercorn await (the body reaching the app as two messages, so the app's body read
     arms a timer) -- and the response's head and end go through h11's send (~30 us warm of
     h11 alone per request). When a whole common request is in the buffer at the start of
     a cycle (POST, a Content-Length whose bytes are all there, no Expect, Upgrade or
     Connection but keep-alive), `PreparedH11.next_whole` reads it in one step and
     `HardenedH11Protocol._handle_events` makes its stream and queues its body as one
     message; a chunked response's head and end to it are `send_head` and `send_end`. A
     client that writes its head and body apart (httpx) has its head read the same way
     and the rest of its body, once whole in the buffer, in one step (`next_rest`).
     Each step leaves h11 exactly as its own next_event or send would (tested with h11 as
     the oracle), or declines and changes nothing; hypercorn's loop then goes on as before.
  22. Not a defect: such a whole request's stream was made as hypercorn makes any -- a
     Request event, HTTPStream.handle's checks of version and server name, then this
     class's look-up of the connection behind its send -- and parse_head's Request
     checked every header again. `HardenedHTTPStream.start_whole` makes the same scope
     from what next_whole read (tested against hypercorn's own handle), and `request_of`
     sets the Request's fields h11's reader would (the scan checked them): ~2.5 us warm
     less per request, ~2.5 % of a request's router CPU at the first-token bench's load.
  Also counted here: the open client connections by protocol and state, for /metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import unquote

import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h11
import hypercorn.asyncio.task_group as _task_group
import hypercorn.asyncio.tcp_server as _tcp_server
import hypercorn.asyncio.worker_context as _worker_context
import hypercorn.protocol as _protocol
import hypercorn.protocol.h2 as _h2mod
import hypercorn.protocol.h11 as _h11mod
from hypercorn.config import Config as HyperConfig
from hypercorn.events import Closed, RawData, Updated
from hypercorn.protocol.events import Request, StreamClosed
from hypercorn.protocol.h2 import H2Protocol
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from narwhal_generated import errors as E

from ..core import refusals as answers
from .h1fast import CLOSE, DIRECT, DIRECT_BUFFER, CloseHook, H1Direct, PreparedH11
from .lean import LeanEvent, LeanQueue

__all__ = ["Limits", "ConnectionCounts", "COUNTS", "install", "penalise", "HardenedH2Protocol", "HardenedH11Protocol", "ConnectionCollector",
           "H1Direct", "PreparedH11", "DIRECT", "DIRECT_BUFFER", "CloseHook", "CLOSE", "LeanTaskGroup", "ServerConfig", "spawn_lean_app"]


@dataclass(frozen=True, slots=True)
class Limits:
    control_frames_per_s: int = 200
    abuse_penalty_s: float = 10.0  # serving.abuse_penalty_ms; 0: off


@dataclass
class ConnectionCounts:
    """Open client connections: total, and how many have a request in flight (busy)."""

    open: int = 0
    busy: int = 0
    h2: int = 0  # HTTP/2 connections open
    refused_streams: int = 0  # streams refused past max_streams_per_connection (total)
    calmed: int = 0  # connections closed with ENHANCE_YOUR_CALM (total)
    penalised: int = 0  # connections closed at accept, their address penalised (total)


class ConnectionCollector:
    """/metrics: narwhal_client_connections{state=idle|busy} (busy: a request in flight),
    narwhal_client_connections_h2, and the totals of refused streams and calmed floods."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = GaugeMetricFamily("narwhal_client_connections", "Open client connections, by state (busy: a request in flight).", labels=["state"])
        g.add_metric(["idle"], COUNTS.open - COUNTS.busy)
        g.add_metric(["busy"], COUNTS.busy)
        yield g
        yield GaugeMetricFamily("narwhal_client_connections_h2", "Open HTTP/2 client connections.", value=COUNTS.h2)
        yield CounterMetricFamily("narwhal_h2_refused_streams", "HTTP/2 streams refused past serving.max_streams_per_connection.", value=COUNTS.refused_streams)
        yield CounterMetricFamily("narwhal_h2_calmed_connections", "HTTP/2 connections closed with ENHANCE_YOUR_CALM (control-frame floods).", value=COUNTS.calmed)
        yield CounterMetricFamily("narwhal_penalised_connections", "Client connections closed at accept: their address was calmed within serving.abuse_penalty_ms.", value=COUNTS.penalised)
        yield GaugeMetricFamily("narwhal_penalised_addresses", "Client addresses currently penalised.", value=PENALTIES.size())


PENALTY_ADDRESSES = 65536  # the most addresses remembered at once


class Penalties:
    """Defect 8: client addresses penalised until a monotonic time, in a bounded table
    (insertion-ordered: the oldest penalty is forgotten first when it is full)."""

    def __init__(self, limit: int = PENALTY_ADDRESSES) -> None:
        self.limit = limit
        self._until: dict[str, float] = {}
        # told of every penalty this process decides (with serving.workers > 1 the other
        # workers learn it through the authority: narwhal/workers.py)
        self.listener: Any = None

    def size(self) -> int:
        return len(self._until)

    def penalise(self, addr: str, seconds: float, now: float, *, shared: bool = True) -> None:
        """`shared`: a penalty decided here (passed to the listener); False for one
        another worker decided."""
        if seconds <= 0.0:
            return
        self._until.pop(addr, None)
        while len(self._until) >= self.limit:
            del self._until[next(iter(self._until))]
        self._until[addr] = now + seconds
        if shared and self.listener is not None:
            self.listener(addr, seconds)

    def penalised(self, addr: str, now: float) -> bool:
        until = self._until.get(addr)
        if until is None:
            return False
        if until <= now:
            del self._until[addr]
            return False
        return True

    def clear(self) -> None:
        self._until.clear()


COUNTS = ConnectionCounts()
PENALTIES = Penalties()
_LIMITS = Limits()


class _RefusingH2Connection(h2.connection.H2Connection):
    """Defect 2: a HEADERS frame past the stream limit opens a stream that is refused at
    once, instead of TooManyStreamsError tearing the connection down."""

    _bypass = False
    refused = 0  # streams refused on this connection (defect 9 charges them to the bucket)

    @property  # type: ignore[override]
    def open_inbound_streams(self) -> int:
        n = super().open_inbound_streams
        return 0 if self._bypass else n

    def _receive_headers_frame(self, frame: Any) -> Any:
        if frame.stream_id in self.streams or self.open_inbound_streams < self.local_settings.max_concurrent_streams:
            return super()._receive_headers_frame(frame)
        self._bypass = True
        try:
            frames, events = super()._receive_headers_frame(frame)
        finally:
            self._bypass = False
        self.reset_stream(frame.stream_id, h2.errors.ErrorCodes.REFUSED_STREAM)
        COUNTS.refused_streams += 1
        self.refused += 1
        return frames, [e for e in events if getattr(e, "stream_id", None) != frame.stream_id]


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


_CONTROL = (h2.events.RemoteSettingsChanged, h2.events.PingReceived, h2.events.StreamReset)


class HardenedH2Protocol(H2Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        old = self.connection
        conn = _RefusingH2Connection(config=old.config)
        conn.DEFAULT_MAX_INBOUND_FRAME_SIZE = old.DEFAULT_MAX_INBOUND_FRAME_SIZE
        conn.local_settings = old.local_settings
        self.connection = conn
        self._bucket = _Bucket(_LIMITS.control_frames_per_s)
        self._counted = True
        self._calmed = False
        self._refused_seen = 0
        COUNTS.h2 += 1

    async def handle(self, event: Any) -> None:
        if isinstance(event, Closed) and self._counted:
            self._counted = False
            COUNTS.h2 -= 1
        if isinstance(event, RawData) and len(event.data) > FEED_BYTES:  # defect 9
            data = event.data
            for i in range(0, len(data), FEED_BYTES):
                if self._calmed or self.closed:
                    return
                if i:
                    await asyncio.sleep(0)
                await super().handle(RawData(data[i : i + FEED_BYTES]))
            return
        await super().handle(event)

    async def _calm(self) -> None:
        self._calmed = True
        COUNTS.calmed += 1
        peer = self.client[0] if self.client else None
        if peer:  # defect 8
            PENALTIES.penalise(peer, _LIMITS.abuse_penalty_s, time.monotonic())
        self.connection.close_connection(error_code=h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, additional_data=b"too many control frames")
        await self._flush()
        await self.send(Closed())

    async def _send_data(self, stream_id: int) -> None:
        # defect 1: a zero window pops nothing (pop(0) would un-pause the writer)
        buf = self.stream_buffers.get(stream_id)
        if buf is not None and buf.buffer and min(self.connection.local_flow_control_window(stream_id), self.connection.max_outbound_frame_size) <= 0:
            self.priority.block(stream_id)
            return
        await super()._send_data(stream_id)

    async def _handle_events(self, events: list[h2.events.Event]) -> None:
        if self._calmed:
            return
        reset = {ev.stream_id for ev in events if isinstance(ev, h2.events.StreamReset)}
        if reset:  # defect 4, rapid reset: opened and reset in one read, never created
            born = {ev.stream_id for ev in events if isinstance(ev, h2.events.RequestReceived)} & reset
            if born:
                events = [ev for ev in events if getattr(ev, "stream_id", None) not in born or isinstance(ev, h2.events.StreamReset)]
                # each was a whole stream parsed for nothing (HEADERS, DATA, RST_STREAM):
                # charged RAPID_RESET_COST frames, its RST_STREAM event below the third
                if not self._bucket.take((RAPID_RESET_COST - 1) * len(born)):
                    await self._calm()
                    return
        refused = self.connection.refused - self._refused_seen  # type: ignore[attr-defined]
        if refused:  # defect 9: refused streams are charged like control frames
            self._refused_seen += refused
            if not self._bucket.take(refused):
                await self._calm()
                return
        for ev in events:  # defect 4
            control = isinstance(ev, _CONTROL) or (isinstance(ev, h2.events.DataReceived) and not ev.data and ev.stream_ended is None)
            if control and not self._bucket.take():
                await self._calm()
                return
        await super()._handle_events(events)

    async def stream_send(self, event: Any) -> None:
        if isinstance(event, StreamClosed):  # defect 3
            buf = self.stream_buffers.get(event.stream_id)
            if buf is not None and not buf._complete:
                try:
                    self.connection.reset_stream(event.stream_id, h2.errors.ErrorCodes.CANCEL)
                    await self._flush()
                except h2.exceptions.ProtocolError:
                    pass
                await buf.close()
                self.stream_buffers.pop(event.stream_id, None)
                try:
                    self.priority.remove_stream(event.stream_id)
                except Exception:  # noqa: BLE001 - priority.MissingStreamError: already gone
                    pass
        await super().stream_send(event)




class HardenedHTTPStream(HTTPStream):
    """Defect 10: StreamClosed never blocks on a full app queue. Item 11: an HTTP/1.1
    request's scope carries its H1Direct under DIRECT."""

    async def start_whole(self, raw_path: bytes, headers: list[tuple[bytes, bytes]], state: Any, proto: Any) -> None:
        """Item 22: `handle(Request(...))` for an HTTP/1.1 POST that PreparedH11.next_whole
        read, without the Request event and HTTPStream.handle's checks of what it already
        knows: the same scope (HTTP/1.1: no trailers, push or early-hints extension), the
        same spawn, and the extensions below set before the app runs. The caller has
        checked that config.server_names is empty (every server name valid: hypercorn's
        valid_server_name)."""
        self.start_time = time.time()
        path, _, query_string = raw_path.partition(b"?")
        ext: dict[str, Any] = {}
        self.scope = scope = {
            "type": "http",
            "http_version": "1.1",
            "asgi": {"spec_version": "2.1", "version": "3.0"},
            "method": "POST",
            "scheme": self.scheme,
            "path": unquote(path.decode("ascii")),
            "raw_path": path,
            "query_string": query_string,
            "root_path": self.config.root_path,
            "headers": headers,
            "client": self.client,
            "server": self.server,
            "state": state.copy(),
            "extensions": ext,
        }
        self._hook(ext, proto)
        self.app_put = await self.task_group.spawn_app(self.app, self.config, scope, self.app_send)

    def _hook(self, ext: dict[str, Any], proto: Any) -> None:
        """The extensions the app finds in its scope: the stream's CloseHook, and over
        HTTP/1.1 on a conn.LeanConnection (`proto` the H11Protocol the stream sends
        through) its H1Direct."""
        ext[CLOSE] = self._close_hook = CloseHook()
        server = getattr(getattr(proto, "send", None), "__self__", None)
        if isinstance(proto, H11Protocol) and getattr(server, "lean", False):  # conn.LeanConnection
            ext[DIRECT] = H1Direct(self, proto, server)

    async def handle(self, event: Any) -> None:
        if isinstance(event, Request):
            await super().handle(event)
            # the app's task is spawned but has not run yet: it sees the extensions
            if not hasattr(self, "scope"):
                return
            self._hook(self.scope["extensions"], getattr(self.send, "__self__", None))
            return
        if isinstance(event, StreamClosed):
            hook = getattr(self, "_close_hook", None)
            if hook is not None:
                hook.fire()
        if isinstance(event, StreamClosed) and self.app_put is not None:
            q = getattr(self.app_put, "__self__", None)
            if isinstance(q, (asyncio.Queue, LeanQueue)) and q.full():
                while not q.empty():  # unread body: the app answered, or is told it is gone
                    q.get_nowait()
                self.closed = True
                if self.state != ASGIHTTPState.CLOSED:
                    await self.config.log.access(self.scope, None, time.time() - self.start_time)
                q.put_nowait({"type": "http.disconnect"})
                return
        await super().handle(event)


class HardenedH11Protocol(H11Protocol):
    """Defect 7: the server's own refusals carry the error envelope (H08, H09). Item 15:
    its connection is a PreparedH11."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if type(self.connection) is h11.Connection:
            PreparedH11.adopt(self.connection)  # the same object, two methods more

    async def _handle_events(self) -> None:
        """Item 19: a common request's head (PreparedH11.next_whole) is taken in one step,
        its stream made, and its body, when all of it is there (then, or in a later read:
        next_rest), queued as one message, as hypercorn's loop would make and queue them
        from h11's Request, Data and EndOfMessage (its protocol check is a no-op for a
        POST with no Upgrade); then, and for anything else, hypercorn's loop."""
        c = self.connection
        if type(c) is PreparedH11:
            body: bytes | None = None
            if self.stream is None:
                got = c.next_whole()
                if got is not None:
                    req, body = got
                    await self.send(Updated(idle=False))
                    await self._create_whole(req)
            else:
                body = c.next_rest()  # the rest of a body whose head came first
            st = self.stream
            if body is not None and isinstance(st, HTTPStream) and not st.closed and st.app_put is not None:
                await st.app_put({"type": "http.request", "body": body, "more_body": False})
        await super()._handle_events()

    async def _create_whole(self, request: h11.Request) -> None:
        """hypercorn's `_create_stream` for a request next_whole read: no Upgrade, so an
        HTTP stream (never a websocket), and its headers listed once, as hypercorn lists
        them (lower-case names, or raw ones under h11_pass_raw_headers)."""
        config = self.config
        self.stream = st = _h11mod.HTTPStream(self.app, config, self.context, self.task_group, self.ssl, self.client, self.server, self.stream_send, _h11mod.STREAM_ID)
        raw = config.h11_pass_raw_headers
        headers = [(r if raw else n, v) for r, n, v in request.headers._full_items]
        if type(st) is HardenedHTTPStream and not config.server_names:  # item 22
            await st.start_whole(request.target, headers, self.connection_state, self)
        else:
            await st.handle(Request(stream_id=_h11mod.STREAM_ID, headers=headers, http_version="1.1", method="POST", raw_path=request.target, state=self.connection_state))
        self.keep_alive_requests += 1
        await self.context.mark_request()

    async def _send_error_response(self, status_code: int) -> None:
        row = E.H09 if status_code == 431 else E.H08
        status, headers, body = answers.render(row)
        hdrs = [*headers, (b"content-length", str(len(body)).encode()), (b"connection", b"close"), *self.config.response_headers("h11")]
        await self._send_h11_event(h11.Response(status_code=status, headers=hdrs))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


RAPID_RESET_COST = 3  # control-frame tokens a stream opened and reset in one read costs
FEED_BYTES = 4096  # defect 9: bytes of one read handed to h2 per loop turn
CLIENT_SNDBUF = 256 * 1024  # bytes (the kernel doubles it for its bookkeeping)


class ServerConfig(HyperConfig):
    """Item 13: response_headers computed once per second and protocol (a new list each
    call: hypercorn extends it)."""

    _cached: dict[str, tuple[int, list[tuple[bytes, bytes]]]]

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        now = int(time.time())
        cache = self.__dict__.setdefault("_cached", {})
        hit = cache.get(protocol)
        if hit is None or hit[0] != now:
            hit = cache[protocol] = (now, super().response_headers(protocol))
        return list(hit[1])


class LeanTaskGroup(_task_group.TaskGroup):
    """Item 12: the ASGI app's receive queue is a LeanQueue (the rest is hypercorn's
    spawn_app: the same _handle, receive = queue.get, app_put = queue.put)."""

    async def spawn_app(self, app: Any, config: Any, scope: Any, send: Any) -> Any:
        return spawn_lean_app(self.spawn, self._loop, app, config, scope, send)


def spawn_lean_app(spawn: Any, loop: asyncio.AbstractEventLoop, app: Any, config: Any, scope: Any, send: Any) -> Any:
    """hypercorn's spawn_app body with item 12's LeanQueue, for any task group's `spawn`
    (LeanTaskGroup's, conn.ConnTasks'): returns the app's app_put."""
    app_queue = LeanQueue(config.max_app_queue_size)
    sync_spawn, call_soon = _loop_helpers(loop)
    spawn(_task_group._handle, app, config, scope, app_queue.get, send, sync_spawn, call_soon)
    return app_queue.put


_HELPERS: tuple[Any, Any, Any] | None = None  # (loop, sync_spawn, call_soon): one loop per process


def _loop_helpers(loop: asyncio.AbstractEventLoop) -> tuple[Any, Any]:
    """hypercorn's per-request sync_spawn and call_soon depend on the loop alone: made once
    per loop, not per request (0.5 KiB per open stream)."""
    global _HELPERS
    if _HELPERS is None or _HELPERS[0] is not loop:

        def _call_soon(func: Any, *args: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(func(*args), loop).result()

        _HELPERS = (loop, partial(loop.run_in_executor, None), _call_soon)
    return _HELPERS[1], _HELPERS[2]


def penalise(scope: dict[str, Any]) -> None:
    """Penalise the client address of an ASGI scope for serving.abuse_penalty_ms (defect
    8): for abuse the app sees (H10, a body in 1-byte pieces), as for a calmed flood."""
    client = scope.get("client")
    if client:
        PENALTIES.penalise(client[0], _LIMITS.abuse_penalty_s, time.monotonic())


def install(limits: Limits) -> None:
    """Serve with the hardened classes (idempotent)."""
    global _LIMITS
    _LIMITS = limits
    _protocol.H2Protocol = HardenedH2Protocol  # type: ignore[misc]
    _h11mod.HTTPStream = HardenedHTTPStream  # type: ignore[misc]
    _h2mod.HTTPStream = HardenedHTTPStream  # type: ignore[misc]
    _protocol.H11Protocol = HardenedH11Protocol  # type: ignore[misc]
    _tcp_server.TaskGroup = LeanTaskGroup  # type: ignore[misc]
    _worker_context.WorkerContext.event_class = LeanEvent  # type: ignore[assignment]
