"""An HTTP/1.1 server connection, sans-IO: bytes in (`receive_data`), events out
(`next_event`), events in (`send`), bytes out. The states are states.py's table; reading
is parse.py's. The same contract as h11's server Connection, which is its test oracle
(tests/http/test_h1conn.py): for the same bytes and the same responses, the same events,
errors (`ProtocolError.status`), states and bytes.

Rules it keeps (h11's):
  K1  keep-alive ends with a request or response that says `Connection: close`, or
      one of HTTP/1.0; both sides then end MUST_CLOSE instead of DONE.
  K2  a response framed by the close (no Content-Length, not chunked: an HTTP/1.0
      client) says `Connection: close`; to an HTTP/1.1 client a response without a
      Content-Length is sent chunked.
  P1  pipelining: bytes after a request whose answer is not done wait (PAUSED) until
      start_next_cycle.
  C1  100-continue: a request of HTTP/1.1 with `Expect: 100-continue` leaves the client
      waiting until the server sends any response or the client sends body.
  L1  NEED_DATA with more than max_incomplete bytes waiting refuses with 431.
The common cycle is also offered in one step each (`next_whole`, `next_rest`,
`send_head`/`send_prepared`, `send_end`): each leaves the connection exactly as the
event-at-a-time path would, or declines (None) and changes nothing.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import states as S
from .events import (
    NEED_DATA,
    PAUSED,
    ConnectionClosed,
    Data,
    EndOfMessage,
    Fields,
    InformationalResponse,
    LocalProtocolError,
    ProtocolError,
    RemoteProtocolError,
    Request,
    Response,
)
from .head import parse_head
from .parse import (
    Buffer,
    ChunkedReader,
    ContentLengthReader,
    Http10Reader,
    body_framing,
    comma_values,
    fields_of,
    read_head,
)

__all__ = ["Connection", "MAX_INCOMPLETE", "ChunkedWriter"]

MAX_INCOMPLETE = 16 * 1024  # h11's and hypercorn's default (h11_max_incomplete_size)


def _expect_nothing(buf: Buffer) -> None:
    if buf:
        raise LocalProtocolError("got data when expecting EOF")
    return None


class ContentLengthWriter:
    __slots__ = ("remaining",)

    def __init__(self, n: int) -> None:
        self.remaining = n

    def data(self, data: bytes) -> bytes:
        self.remaining -= len(data)
        if self.remaining < 0:
            raise LocalProtocolError("too much data for declared Content-Length")
        return data

    def end(self, trailers: Fields) -> bytes:
        if self.remaining != 0:
            raise LocalProtocolError("too little data for declared Content-Length")
        if trailers:
            raise LocalProtocolError("Content-Length and trailers don't mix")
        return b""


class ChunkedWriter:
    __slots__ = ()

    def data(self, data: bytes) -> bytes:
        return b"%x\r\n%b\r\n" % (len(data), data) if data else b""

    def end(self, trailers: Fields) -> bytes:
        return b"0\r\n" + _head_fields(trailers)


class Http10Writer:
    __slots__ = ()

    def data(self, data: bytes) -> bytes:
        return data

    def end(self, trailers: Fields) -> bytes:
        if trailers:
            raise LocalProtocolError("can't send trailers to HTTP/1.0 client")
        return b""


def _head_fields(fields: Fields) -> bytes:
    """Field lines as h11 writes them: Host first, then the rest in order; the blank line."""
    out = [b"%s: %s\r\n" % (raw, v) for raw, n, v in fields if n == b"host"]
    out += [b"%s: %s\r\n" % (raw, v) for raw, n, v in fields if n != b"host"]
    out.append(b"\r\n")
    return b"".join(out)


_READ = {"chunked": ChunkedReader, "content-length": ContentLengthReader, "http/1.0": Http10Reader}
_WRITE = {"chunked": ChunkedWriter, "content-length": ContentLengthWriter, "http/1.0": Http10Writer}
_EXPECT = (S.DONE, S.MUST_CLOSE, S.CLOSED)
_CHUNKED_LINE = (b"Transfer-Encoding", b"transfer-encoding", b"chunked")
_SEND_HEAD_DECLINES = frozenset((b"host", b"content-length", b"transfer-encoding", b"connection"))
_EOM = EndOfMessage()
_REASON = re.compile(rb"(?:[ \t]|[^\x00\s])*")


class Connection:
    """One client connection's HTTP/1.1, the server's side (module docstring)."""

    __slots__ = ("cs", "buf", "closed_in", "reader", "writer", "method", "their_http_version", "client_is_waiting_for_100_continue", "max_incomplete")

    def __init__(self, max_incomplete: int = MAX_INCOMPLETE) -> None:
        self.cs = S.ConnState()
        self.buf = Buffer()
        self.closed_in = False  # the client's end of input was received
        self.reader: Callable[[Buffer], Any] | None = read_head
        self.writer: Any = "head"  # "head": a response head is what may be sent next
        self.method: bytes | None = None
        self.their_http_version: bytes | None = None
        self.client_is_waiting_for_100_continue = False
        self.max_incomplete = max_incomplete

    # -- the public reading of the state -------------------------------------------------

    @property
    def our_state(self) -> S.State:
        return self.cs.server

    @property
    def their_state(self) -> S.State:
        return self.cs.client

    @property
    def states(self) -> dict[S.State, S.State]:
        return {S.CLIENT: self.cs.client, S.SERVER: self.cs.server}

    @property
    def keep_alive(self) -> bool:
        return self.cs.keep_alive

    @property
    def they_are_waiting_for_100_continue(self) -> bool:
        return self.client_is_waiting_for_100_continue

    @property
    def trailing_data(self) -> tuple[bytes, bool]:
        return bytes(self.buf.data), self.closed_in

    @property
    def chunked(self) -> bool:
        """Our body is being sent chunked."""
        return type(self.writer) is ChunkedWriter

    # -- the event-at-a-time path ---------------------------------------------------------

    def receive_data(self, data: bytes) -> None:
        """Bytes from the client; b"": the client's end of input."""
        if data:
            if self.closed_in:
                raise RuntimeError("received close, then received more data?")
            self.buf.add(data)
        else:
            self.closed_in = True

    def next_event(self) -> Any:
        """The client's next event, NEED_DATA or PAUSED; RemoteProtocolError when its
        bytes break the protocol (the client's side ERROR from then on)."""
        if self.cs.client is S.ERROR:
            raise RemoteProtocolError("can't receive data when peer state is ERROR")
        try:
            ev = self._extract()
            if ev is not NEED_DATA and ev is not PAUSED:
                self._process(S.CLIENT, ev)
            if ev is NEED_DATA:
                if len(self.buf) > self.max_incomplete:
                    raise RemoteProtocolError("receive buffer too long", 431)  # L1
                if self.closed_in:
                    raise RemoteProtocolError("peer unexpectedly closed connection")
            return ev
        except BaseException as e:
            self._error(S.CLIENT)
            if isinstance(e, ProtocolError) and not isinstance(e, RemoteProtocolError):
                raise RemoteProtocolError(str(e), e.status) from None
            raise

    def _extract(self) -> Any:
        client = self.cs.client
        if client is S.DONE and self.buf:  # P1
            return PAUSED
        if client is S.MIGHT_SWITCH_PROTOCOL or client is S.SWITCHED_PROTOCOL:
            return PAUSED
        reader = self.reader
        assert reader is not None
        ev = reader(self.buf)
        if ev is None and not self.buf and self.closed_in:
            eof = getattr(reader, "read_eof", None)
            ev = eof() if eof is not None else ConnectionClosed()
        return NEED_DATA if ev is None else ev

    def send(self, event: Any) -> bytes | None:
        """The bytes for our event (None for ConnectionClosed); LocalProtocolError for one
        the protocol forbids here (our side ERROR from then on)."""
        kind = type(event)
        if kind is Response or kind is InformationalResponse:
            event = self._valid(event)  # a malformed response changes nothing (h11 refuses to make it)
        if self.cs.server is S.ERROR:
            raise LocalProtocolError("can't send data when our state is ERROR")
        try:
            if type(event) is _Out and event.final:
                event = _Out(event.status_code, self._clean_up(event.status_code, event.headers), event.reason, event.http_version, True)
            writer = self.writer
            self._process(S.SERVER, event)
            if kind is ConnectionClosed:
                return None
            if kind is Data:
                return writer.data(event.data)  # type: ignore[no-any-return]
            if kind is EndOfMessage:
                return writer.end(event.headers)  # type: ignore[no-any-return]
            if event.http_version != b"1.1":
                raise LocalProtocolError("only HTTP/1.1 is sent")
            return b"HTTP/1.1 %d %s\r\n" % (event.status_code, event.reason) + _head_fields(event.headers)
        except BaseException:
            self._error(S.SERVER)
            raise

    def _valid(self, ev: Response | InformationalResponse) -> _Out:
        """A response's status, reason and fields validated."""
        status = ev.status_code
        final = type(ev) is Response
        if final:
            if not 200 <= status < 1000:
                raise LocalProtocolError("Response status_code should be in range [200, 1000)")
        elif not 100 <= status < 200:
            raise LocalProtocolError("InformationalResponse status_code should be in range [100, 200)")
        if ev.reason and _REASON.fullmatch(ev.reason) is None:
            raise LocalProtocolError("illegal reason phrase")
        return _Out(status, fields_of(ev.headers, validate=True), ev.reason, ev.http_version, final)

    def _clean_up(self, status: int, fields: Fields) -> Fields:
        method = b"GET" if self.method == b"HEAD" else self.method
        framing, _ = body_framing(method, "response", status, fields)
        close = False
        if framing in ("chunked", "http/1.0"):
            fields = _set_comma(fields, b"content-length", [])
            if self.their_http_version is None or self.their_http_version < b"1.1":
                fields = _set_comma(fields, b"transfer-encoding", [])
                if self.method != b"HEAD":
                    close = True
            else:
                fields = _set_comma(fields, b"transfer-encoding", [b"chunked"])
        if not self.cs.keep_alive or close:
            conn = set(comma_values(fields, b"connection"))
            conn.discard(b"keep-alive")
            conn.add(b"close")
            fields = _set_comma(fields, b"connection", sorted(conn))
        return fields

    def _process(self, role: S.State, ev: Any) -> None:
        cs = self.cs
        old_client, old_server = cs.client, cs.server
        kind = type(ev)
        kind_name = ("response" if ev.final else "informational") if kind is _Out else _KINDS[kind]
        if role is S.CLIENT and kind is Request:
            if ev.method == b"CONNECT":
                cs.propose(S.SWITCH_CONNECT)
            if comma_values(ev.headers, b"upgrade"):
                cs.propose(S.SWITCH_UPGRADE)
        switch = None
        if role is S.SERVER and kind is _Out:
            if not ev.final and ev.status_code == 101:
                switch = S.SWITCH_UPGRADE
            elif ev.final and S.SWITCH_CONNECT in cs.proposals and 200 <= ev.status_code < 300:
                switch = S.SWITCH_CONNECT
            if switch is not None and switch not in cs.proposals:
                raise LocalProtocolError("Received server _SWITCH_UPGRADE event without a pending proposal")
        try:
            cs.event(role, kind_name, switch)
        except KeyError:
            raise LocalProtocolError(f"can't handle event type {kind_name} when role={role} and state={cs.of(role)}") from None
        if kind is Request:
            self.method = ev.method
            self.their_http_version = ev.http_version
        final = kind is Request or (kind is _Out and ev.final)
        if final and (b"close" in comma_values(ev.headers, b"connection") or ev.http_version < b"1.1"):  # K1
            cs.keep_alive_off()
        if kind is Request and ev.http_version >= b"1.1" and b"100-continue" in comma_values(ev.headers, b"expect"):  # C1
            self.client_is_waiting_for_100_continue = True
        if kind is _Out or (role is S.CLIENT and (kind is Data or kind is EndOfMessage)):
            self.client_is_waiting_for_100_continue = False
        self._moved(old_client, old_server, ev)

    def _moved(self, old_client: S.State, old_server: S.State, ev: Any = None) -> None:
        cs = self.cs
        if cs.server is not old_server:
            self.writer = self._io(cs.server, ev, _WRITE, writing=True)
        if cs.client is not old_client:
            self.reader = self._io(cs.client, ev, _READ, writing=False)

    def _io(self, state: S.State, ev: Any, table: dict[str, Any], *, writing: bool) -> Any:
        if state is S.SEND_BODY:
            if writing:
                framing, n = body_framing(self.method, "response", ev.status_code, ev.headers)
            else:
                framing, n = body_framing(None, "request", 0, ev.headers)
            return table[framing](n) if framing == "content-length" else table[framing]()
        if writing:
            return "head" if state is S.IDLE or state is S.SEND_RESPONSE else None
        if state is S.IDLE:
            return read_head
        return _expect_nothing if state in _EXPECT else None

    def _error(self, role: S.State) -> None:
        old_client, old_server = self.cs.client, self.cs.server
        self.cs.error(role)
        self._moved(old_client, old_server)

    def start_next_cycle(self) -> None:
        """Both sides back to IDLE for the next request; LocalProtocolError unless both are
        DONE (keep-alive on)."""
        old_client, old_server = self.cs.client, self.cs.server
        if not self.cs.start_next_cycle():
            raise LocalProtocolError("not in a reusable state")
        self._moved(old_client, old_server)

    # -- the common cycle in one step each ---------------------------------------------

    def next_whole(self) -> tuple[Request, bytes | None] | None:
        """A common request at the start of a cycle -- a head the scan reads, POST, a
        Content-Length, no Expect, no Upgrade, no Connection but keep-alive -- read in
        one step: (it, its body) when the whole body is here (the client DONE, as after
        Request, Data, EndOfMessage), (it, None) when not (the client in SEND_BODY, as
        after the Request alone). None: declined, nothing changed."""
        cs = self.cs
        if cs.client is not S.IDLE or cs.server is not S.IDLE or not cs.keep_alive or cs.proposals or self.closed_in:
            return None
        got = parse_head(self.buf.data)
        if got is None:
            return None
        req, k = got
        if req.method != b"POST":
            return None
        n = -1
        for _, name, value in req.headers:
            if name == b"content-length":
                n = int(value)
            elif name == b"expect" or name == b"upgrade" or (name == b"connection" and value.lower() != b"keep-alive"):
                return None
        if n < 0:
            return None
        buf = self.buf
        buf.take(k)
        cs.server = S.SEND_RESPONSE
        self.method = b"POST"
        self.their_http_version = b"1.1"
        self.writer = "head"
        if len(buf) < n:
            cs.client = S.SEND_BODY
            self.reader = ContentLengthReader(n)
            return req, None
        body = buf.take(n) if n else b""
        cs.client = S.DONE
        self.reader = _expect_nothing
        return req, body

    def next_rest(self) -> bytes | None:
        """The rest of a Content-Length body once all of it is here, in one step (the
        client DONE, as after its Data and EndOfMessage); None: declined."""
        cs = self.cs
        r = self.reader
        if cs.client is not S.SEND_BODY or type(r) is not ContentLengthReader or not cs.keep_alive or cs.proposals or self.client_is_waiting_for_100_continue:
            return None
        n = r.remaining
        if n <= 0 or len(self.buf) < n:
            return None
        body = self.buf.take(n)
        cs.client = S.DONE
        self.reader = _expect_nothing
        return body

    @staticmethod
    def head_bytes(status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The head send_head writes for (status, headers), built in any state (ahead of
        time); None for a status without a body or a header send would rewrite."""
        if status < 200 or status == 204 or status == 304 or status > 999:
            return None
        lines = [b"HTTP/1.1 %d \r\n" % status]
        for name, value in headers:
            if name.lower() in _SEND_HEAD_DECLINES:
                return None
            lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(b"Transfer-Encoding: chunked\r\n\r\n")
        return b"".join(lines)

    def send_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """A chunked response's head to a POST read whole, as send(Response) would write it
        (the headers already valid: names are tokens, values field content); None:
        declined."""
        head = self.head_bytes(status, headers)
        return None if head is None else self.send_prepared(head)

    def send_prepared(self, head: bytes) -> bytes | None:
        cs = self.cs
        if (
            cs.server is not S.SEND_RESPONSE or cs.client is not S.DONE or not cs.keep_alive or cs.proposals
            or self.method != b"POST" or self.their_http_version != b"1.1" or self.writer != "head"
        ):
            return None
        cs.server = S.SEND_BODY
        self.client_is_waiting_for_100_continue = False
        self.writer = ChunkedWriter()
        return head

    def send_end(self) -> bytes | None:
        """A chunked body's end without trailers, as send(EndOfMessage()) writes it; None:
        declined (it would move more than our side to DONE)."""
        cs = self.cs
        if cs.server is not S.SEND_BODY or cs.client is not S.DONE or not cs.keep_alive or cs.proposals or type(self.writer) is not ChunkedWriter:
            return None
        cs.server = S.DONE
        self.writer = None
        return b"0\r\n\r\n"


@dataclass(frozen=True, slots=True)
class _Out:
    """A response checked for sending (its fields validated, a final one's cleaned up)."""

    status_code: int
    headers: Fields
    reason: bytes
    http_version: bytes
    final: bool


def _set_comma(fields: Fields, name: bytes, values: list[bytes]) -> Fields:
    out = [f for f in fields if f[1] != name]
    title = name.title()
    out += [(title, name, v) for v in values]
    return out


_KINDS: dict[type, str] = {Request: "request", Data: "data", EndOfMessage: "end", ConnectionClosed: "closed"}
