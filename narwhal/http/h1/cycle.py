"""The ASGI HTTP cycle over Narwhal's HTTP/1.1 connection (narwhal.http.h1.Connection):
what conn.LeanConnection runs for an HTTP/1.1 client, every route.

`H1Server` is one client connection's HTTP/1.1: each read is fed to the Connection, and its
events become one `H1Stream` per request (the ASGI scope, receive and send); the answers'
events become bytes through the LeanConnection's `protocol_send` (its send lock, the
transport, the drain). `H1Direct` (scope extension DIRECT) writes a streaming answer's
head, chunks and end straight to the transport, from any callback, exactly as the ASGI
path would frame them -- or declines (False) whenever the ASGI path would not write the
same. The rules, each the ASGI server's contract as hypercorn kept it before:

  A1  a request is answered in order: bytes after it wait (PAUSED) until its stream
      has closed and the connection is recycled (pipelining);
  A2  a request with `Expect: 100-continue` is answered `100 Continue` at once;
  A3  bytes that break the protocol are answered with the error envelope (431: row
      H09, any other status: H08) and the connection closes;
  A4  an `Upgrade: h2c` request without a body is answered 101 and the connection goes
      on as HTTP/2 (the request its stream 1); a `PRI * HTTP/2.0` preface switches to
      HTTP/2 at once (prior knowledge);
  A5  the app's receive queue is bounded (config.max_app_queue_size): a full queue pauses
      reading; when the stream closes with the queue full, the unread body is dropped
      and http.disconnect queued without waiting (the app may be the one not reading);
  A6  the end of reading (the client's FIN) closes the request's stream (its app learns
      http.disconnect, its CloseHook fires);
  A7  after a response the connection is recycled for the next request, or closed
      (keep-alive off, or the server stopping);
  A8  an app that ends without a response gets a 500; one that sends a message out of
      turn raises (the connection fails).
"""

from __future__ import annotations

from time import time as _time
from typing import Any

from hypercorn.events import Closed, RawData, Updated

from narwhal_generated import errors as E

from ...core.refusals import render
from ..h1fast import CLOSE, DIRECT, DIRECT_BUFFER, CloseHook, PreparedHead
from ..lean import LeanEvent
from ..scope import ServerSide, http_scope, response_headers, tell_disconnect
from .connection import Connection
from .events import (
    NEED_DATA,
    PAUSED,
    ConnectionClosed,
    Data,
    EndOfMessage,
    InformationalResponse,
    LocalProtocolError,
    RemoteProtocolError,
    Request,
    Response,
)
from .states import DONE, ERROR, IDLE, SEND_BODY, SEND_RESPONSE

__all__ = ["H1Server", "H1Stream", "H1Direct", "REQUEST", "RESPONSE", "CLOSED"]

REQUEST, RESPONSE, CLOSED = "request", "response", "closed"  # an H1Stream's ASGI state
_BUSY, _IDLE = Updated(idle=False), Updated(idle=True)
_EOM = EndOfMessage()
_STARTED: dict[int, Any] = {}  # status -> the shared http.response.start kept with no access log
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\n"


class H1Server(ServerSide):
    """One client connection's HTTP/1.1 (rules A1-A8). `lean` is the conn.LeanConnection:
    its protocol_send, transport, send lock and switch to HTTP/2."""

    __slots__ = ("lean", "h1", "stream", "requests", "can_read", "switched")

    def __init__(self, app: Any, config: Any, context: Any, group: Any, state: Any, ssl: bool, client: Any, server: Any, lean: Any) -> None:
        super().__init__(app, config, context, group, state, ssl, client, server, lean)
        self.lean = lean
        self.h1 = Connection(config.h11_max_incomplete_size)
        self.stream: H1Stream | None = None
        self.requests = 0  # requests begun on this connection (keep_alive_max_requests)
        self.can_read = LeanEvent()
        self.switched = False

    async def initiate(self) -> None:
        return None

    async def handle(self, event: Any) -> None:
        if type(event) is RawData:
            self.h1.receive_data(event.data)
            await self._events()
        elif type(event) is Closed and self.stream is not None:  # A6
            await self._close_stream()

    async def _events(self) -> None:
        h = self.h1
        st = self.stream
        body: bytes | None = None
        if st is None:  # the common request in one step (Connection.next_whole)
            got = h.next_whole()
            if got is not None:
                req, body = got
                await self.send(_BUSY)
                await self._open(req)
        else:
            body = h.next_rest()
        st = self.stream
        if body is not None and st is not None and not st.closed and st.app_put is not None:
            await st.app_put({"type": "http.request", "body": body, "more_body": False})
        while True:
            if h.client_is_waiting_for_100_continue:  # A2
                await self._send_event(InformationalResponse(100, self.config.response_headers("h11")))
            try:
                ev = h.next_event()
            except RemoteProtocolError as e:  # A3
                if h.our_state is IDLE or h.our_state is SEND_RESPONSE:
                    await self._send_error(e.status)
                await self.send(Closed())
                return
            kind = type(ev)
            if kind is Request:
                await self.send(_BUSY)
                if await self._switch(ev):
                    return
                await self._open(ev)
            elif ev is PAUSED:  # A1
                await self.can_read.clear()
                await self.can_read.wait()
                if self.switched:
                    return
            elif ev is NEED_DATA or kind is ConnectionClosed or self.stream is None:
                return
            elif kind is Data:
                await self.stream.body(ev.data)
            elif kind is EndOfMessage:
                await self.stream.body_end()

    async def _switch(self, req: Request) -> bool:
        """A4: True when the connection went on as HTTP/2."""
        h = self.h1
        if req.method == b"PRI" and req.target == b"*" and req.http_version == b"2.0":
            self.switched = True
            await self.lean.switch_h2(H2_PREFACE + h.trailing_data[0], None, None)
            return True
        upgrade = b""
        body = False
        for _, name, value in req.headers:
            if name == b"upgrade":
                upgrade = value.strip()
            elif name == b"content-length" or name == b"transfer-encoding":
                body = True
        if upgrade.lower() != b"h2c" or body:
            return False
        await self._send_event(InformationalResponse(101, [*self.config.response_headers("h11"), (b"connection", b"upgrade"), (b"upgrade", b"h2c")]))
        settings = b""
        headers = [(b":method", req.method), (b":path", req.target)]
        for raw, name, value in req.headers:
            if name == b"http2-settings":
                settings = value
            elif name == b"host":
                headers.append((b":authority", value))
            headers.append((raw, value))
        self.switched = True
        await self.lean.switch_h2(h.trailing_data[0], headers, settings)
        return True

    async def _open(self, req: Request) -> None:
        self.stream = st = H1Stream(self)
        self.requests += 1
        await st.start(req)
        await self.context.mark_request()

    async def _close_stream(self) -> None:
        st = self.stream
        if st is not None:
            self.stream = None
            await st.closed_event()

    async def recycle(self) -> None:
        """A7: the stream closed (its StreamClosed)."""
        await self._close_stream()
        h = self.h1
        if not self.context.terminated.is_set() and h.our_state is DONE and h.their_state is DONE:
            h.start_next_cycle()
            await self.can_read.set()
            await self.send(_IDLE)
        else:
            await self.can_read.set()
            await self.send(Closed())

    async def _send_event(self, ev: Any) -> None:
        try:
            data = self.h1.send(ev)
        except LocalProtocolError:
            if self.h1.their_state is not ERROR:
                raise
        else:
            await self.send(RawData(data=data or b""))

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        if status >= 200:
            hs = [*headers, *self.config.response_headers("h11")]
            if self.requests >= self.config.keep_alive_max_requests:
                hs.append((b"connection", b"close"))
            await self._send_event(Response(status, hs))
        else:
            await self._send_event(InformationalResponse(status, [*headers, *self.config.response_headers("h11")]))

    async def _send_error(self, status: int) -> None:
        row = E.H09 if status == 431 else E.H08
        code, headers, body = render(row)
        hs = [*headers, (b"content-length", str(len(body)).encode()), (b"connection", b"close"), *self.config.response_headers("h11")]
        await self._send_event(Response(code, hs))
        await self._send_event(Data(body))
        await self._send_event(_EOM)


class H1Stream:
    """One request's ASGI cycle (its scope, receive queue and send)."""

    __slots__ = ("proto", "state", "closed", "app_put", "scope", "response", "start_time", "hook", "method")

    def __init__(self, proto: H1Server) -> None:
        self.proto = proto
        self.state = REQUEST
        self.closed = False
        self.app_put: Any = None
        self.scope: Any = None
        self.response: Any = None
        self.start_time = 0.0
        self.hook: CloseHook | None = None
        self.method = "GET"

    async def start(self, req: Request) -> None:
        p = self.proto
        config = p.config
        self.start_time = _time()
        raw = config.h11_pass_raw_headers
        self.method = method = "POST" if req.method == b"POST" else req.method.decode("ascii").upper()
        ext: dict[str, Any] = {}
        version = "1.1" if req.http_version == b"1.1" else req.http_version.decode()
        self.scope = scope = http_scope(version, method, req.target, [(r if raw else n, v) for r, n, v in req.headers], p, config, ext)
        ext[CLOSE] = self.hook = CloseHook()
        ext[DIRECT] = H1Direct(self, p)
        if config.server_names and _host(req) not in config.server_names:  # not a name this server serves: 404
            await p.respond(404, [(b"content-length", b"0"), (b"connection", b"close")])
            await p._send_event(_EOM)
            self.state = CLOSED
            self.closed = True
            await config.log.access(scope, {"status": 404, "headers": []}, _time() - self.start_time)
            await p.recycle()
            return
        self.app_put = await p.group.spawn_app(p.app, config, scope, self.app_send)

    async def body(self, data: bytes) -> None:
        if not self.closed:
            await self.app_put({"type": "http.request", "body": bytes(data), "more_body": True})

    async def body_end(self) -> None:
        if not self.closed:
            await self.app_put({"type": "http.request", "body": b"", "more_body": False})

    async def closed_event(self) -> None:
        """The stream closed: the hook fires, the app is told http.disconnect (A5, A6)."""
        if self.closed:
            return
        self.closed = True
        if self.hook is not None:
            self.hook.fire()
        config = self.proto.config
        if self.state is not CLOSED:
            await config.log.access(self.scope, None, _time() - self.start_time)
        if self.app_put is not None:
            await tell_disconnect(self.app_put)  # A5

    async def app_send(self, message: Any) -> None:
        """ASGI send (A8)."""
        p = self.proto
        if message is None:  # the app has ended
            if not self.closed:
                if self.state is REQUEST:
                    await p.respond(500, [(b"content-length", b"0"), (b"connection", b"close")])
                    await p._send_event(_EOM)
                    self.state = CLOSED
                    await p.config.log.access(self.scope, {"status": 500, "headers": []}, _time() - self.start_time)
                await p.recycle()
            return
        kind = message["type"]
        if kind == "http.response.start" and self.state is REQUEST:
            self.response = message
            headers = response_headers(message)
            await p.respond(int(message["status"]), headers)
            self.state = RESPONSE
        elif kind == "http.response.body" and self.state is RESPONSE:
            body = message.get("body", b"")
            if body and not _suppressed(self.method, int(self.response["status"])):
                await p._send_event(Data(bytes(body)))
            if not message.get("more_body", False):
                await p._send_event(_EOM)
                self.state = CLOSED
                await p.config.log.access(self.scope, self.response, _time() - self.start_time)
                await p.recycle()
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} in state {self.state}")


def _suppressed(method: str, status: int) -> bool:
    return method == "HEAD" or 100 <= status < 200 or status in (204, 304)


def _host(req: Request) -> str:
    for _, name, value in req.headers:
        if name == b"host":
            return value.decode()
    return ""


def _refused_value(headers: list[tuple[bytes, bytes]]) -> bool:
    """A header value with CR, LF or NUL: send would refuse it, so the head goes through ASGI."""
    return any(b"\r" in v or b"\n" in v or b"\0" in v for _, v in headers)


class H1Direct:
    """A streaming answer's head, body chunks and end written straight to the transport.

    Each method either writes exactly what the ASGI path would write for the same messages
    -- the Connection's state moved on as that path's `send` would move it -- and returns
    True, or writes nothing, changes nothing and returns False (the caller sends through
    ASGI). Synchronous (start, write, write_chunk, end): callable from a protocol callback.
    Guards: the stream is in the right ASGI state and open, the connection sends a chunked
    body (start: a response is due), nothing holds the send lock, the transport is open and
    holds at most DIRECT_BUFFER bytes (past it the ASGI path's drain waits: a client that
    reads nothing blocks its sender, and serving.send_stall_ms drops it)."""

    __slots__ = ("_stream", "_proto", "_conn", "_lock", "_transport")

    def __init__(self, stream: H1Stream, proto: H1Server) -> None:
        self._stream = stream
        self._proto = proto
        self._conn = proto.h1
        self._lock = proto.lean.send_lock
        self._transport = proto.lean.transport

    def prepare(self, status: int, headers: list[tuple[bytes, bytes]]) -> PreparedHead | None:
        """The head `start(status, headers)` would write, built now (while the engine works
        on the first token); start writes it only for the same status and headers within
        the same second (the Date header)."""
        if _refused_value(headers):
            return None
        second = int(_time())
        head = Connection.head_bytes(status, [*headers, *self._proto.config.response_headers("h11")])
        return None if head is None else (status, second, headers, head)

    def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"", prepared: PreparedHead | None = None) -> bool:
        """The head, as http.response.start would send it, and `first` as the first chunk,
        in one write; False: nothing was done."""
        st = self._stream
        t = self._transport
        proto = self._proto
        conn = self._conn
        if (
            st.state is not REQUEST or st.closed or conn.our_state is not SEND_RESPONSE or self._lock.locked() or t.is_closing()
            or proto.requests >= proto.config.keep_alive_max_requests  # the ASGI path would add connection: close
        ):
            return False
        data = None
        if prepared is not None and prepared[0] == status and prepared[1] == int(_time()) and prepared[2] == headers:
            data = conn.send_prepared(prepared[3])
        if data is None:
            if _refused_value(headers):
                return False
            hs = [*headers, *proto.config.response_headers("h11")]
            data = conn.send_head(status, hs)
            if data is None:
                try:
                    data = conn.send(Response(status, hs))
                except LocalProtocolError:  # refused before anything changed
                    return False
        if proto.config.log.access_logger is None:  # one shared start per status: nothing per stream
            st.response = _STARTED.get(status) or _STARTED.setdefault(status, {"type": "http.response.start", "status": status, "headers": ()})
        else:
            st.response = {"type": "http.response.start", "status": status, "headers": headers}
        st.state = RESPONSE
        if first:
            if conn.chunked:
                data = (data or b"") + b"%x\r\n%b\r\n" % (len(first), first)
            else:  # an HTTP/1.0 client: the body as ASGI sends it
                data = (data or b"") + (conn.send(Data(first)) or b"")
        if data:
            t.write(data)
        return True

    def write(self, data: bytes) -> bool:
        return self.write_chunk(b"%x\r\n%b\r\n" % (len(data), data) if data else b"")

    def write_chunk(self, framed: bytes) -> bool:
        """`write` for bytes framed already as one chunk: written now (True) or nothing."""
        t = self._transport
        st = self._stream
        c = self._conn
        if (
            st.state is not RESPONSE or st.closed or c.our_state is not SEND_BODY or not c.chunked
            or self._lock.locked() or t.is_closing() or t.get_write_buffer_size() > DIRECT_BUFFER
        ):
            return False
        if framed:
            t.write(framed)
        return True

    def end(self, last: bytes) -> bool:
        """The `last` body bytes and the body's end in one write, the states moved on as the
        final http.response.body would move them, the stream CLOSED; False: nothing was
        done. With an access log configured it declines (the log is written in between).
        `closed()` must follow."""
        t = self._transport
        st = self._stream
        c = self._conn
        if (
            st.state is not RESPONSE or st.closed or c.our_state is not SEND_BODY or not c.chunked or c.their_state is ERROR
            or self._lock.locked() or t.is_closing() or t.get_write_buffer_size() > DIRECT_BUFFER
            or self._proto.config.log.access_logger is not None
        ):
            return False
        tail = c.send_end()
        if tail is None:
            tail = c.send(_EOM) or b""
        t.write(b"%x\r\n%b\r\n%b" % (len(last), last, tail) if last else tail)
        st.state = CLOSED
        return True

    async def closed(self) -> None:
        """After `end`: the stream's close (the connection recycled for the next request,
        or closed)."""
        await self._proto.recycle()
