"""HTTP/1.1 straight to the client's connection (hyper.py items 11, 12 and 15): the pieces
the app uses through the scope's extensions, kept beside hyper.py so that file stays the
server's hardening. hyper.py documents each item and re-exports these names.

  * `H1Direct` (scope extension DIRECT): a response's head, body chunks and end written to
    the connection's transport (the head and chunks from any callback), byte for byte as
    hypercorn and h11 would write them, or nothing (False) whenever the ASGI path would
    not write the same.
  * `PreparedH11`: h11's server connection that sends a head H1Direct built whole as built,
    and reads a common request head the short way (h1head.py).
  * `CloseHook` (scope extension CLOSE): the app learns that its stream closed without a
    task waiting on receive().
"""

from __future__ import annotations

from collections.abc import Callable
from time import time as _time
from typing import Any

import h11
from h11._readers import READERS, ContentLengthReader
from h11._receivebuffer import ReceiveBuffer
from h11._state import ConnectionState
from h11._util import Sentinel
from h11._writers import (
    WRITERS,
    ChunkedWriter,  # h11 0.16: how a chunked body is framed (H1Direct checks it)
)
from hypercorn.protocol.events import StreamClosed
from hypercorn.protocol.h11 import H11Protocol
from hypercorn.protocol.http_stream import ASGIHTTPState, HTTPStream

from .h1head import parse_head

__all__ = ["DIRECT", "CLOSE", "DIRECT_BUFFER", "CloseHook", "H1Direct", "PreparedH11", "PreparedHead", "LeanH11State"]


DIRECT = "narwhal.h1_direct"  # the scope extension holding a stream's H1Direct (item 11)
CLOSE = "narwhal.close"  # the scope extension holding a stream's CloseHook (item 12)


class CloseHook:
    """Item 12: the app learns that its stream closed (the client went away, or the
    connection closed) without a task waiting on receive() (1.4 KiB per open stream):
    `closed` once it has, and `cb` is called then if set."""

    __slots__ = ("closed", "cb")

    def __init__(self) -> None:
        self.closed = False
        self.cb: Callable[[], object] | None = None

    def fire(self) -> None:
        if not self.closed:
            self.closed = True
            cb, self.cb = self.cb, None
            if cb is not None:
                cb()
DIRECT_BUFFER = 64 * 1024  # bytes waiting in the transport past which H1Direct declines


class H1Direct:
    """Item 11: an HTTP/1.1 stream's body chunks written straight to its transport (and
    item 17: its end).

    `write(data)` either writes `data` as one chunk, exactly as h11 would frame it, and
    returns True, or writes nothing and returns False (the caller sends it through ASGI).
    Synchronous: callable from a protocol callback."""

    __slots__ = ("_stream", "_proto", "_conn", "_lock", "_transport")

    def __init__(self, stream: HTTPStream, proto: H11Protocol, server: Any) -> None:
        self._stream = stream
        self._proto = proto
        self._conn = proto.connection
        self._lock = server.send_lock
        self._transport = server.transport

    def prepare(self, status: int, headers: list[tuple[bytes, bytes]]) -> PreparedHead | None:
        """Item 21: the head `start(status, headers)` would write, built now (while the
        engine works on the first token, off the client's time to it), or None. start
        writes it only for the same status and headers (equal lists) within the same second
        (hypercorn's Date header); otherwise it builds the head as before."""
        conn = self._conn
        if type(conn) is not PreparedH11:
            return None
        if _refused_value(headers):
            return None
        second = int(_time())
        head = conn.head_bytes(status, [*headers, *self._proto.config.response_headers("h11")])
        return None if head is None else (status, second, headers, head)

    def start(self, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"", prepared: PreparedHead | None = None) -> bool:
        """The response head, as ASGI's http.response.start would send it (hypercorn's
        headers added, h11's state moved on), and `first` body bytes as its first chunk,
        written now in one write; False: nothing was done (send it through ASGI). h11 is
        told the headers are parsed: the app's names are its own lower-case constants and a
        value with CR, LF or NUL (which h11 would refuse) declines here. `prepared`: what
        prepare(status, headers) built, written if it still is that head."""
        st = self._stream
        t = self._transport
        proto = self._proto
        conn = self._conn
        if (
            st.state is not _REQUEST or st.closed or conn.our_state is not _SEND_RESPONSE or self._lock._locked or t.is_closing()
            or proto.keep_alive_requests >= proto.config.keep_alive_max_requests  # hypercorn would add connection: close
        ):
            return False
        data = None
        if prepared is not None and prepared[0] == status and prepared[1] == int(_time()) and prepared[2] == headers and type(conn) is PreparedH11:
            data = conn.send_prepared(prepared[3])
        if data is None:
            if _refused_value(headers):
                return False
            hs = [*headers, *proto.config.response_headers("h11")]
            # item 19: the head h11 would write, written here, h11's state moved on as it would
            data = conn.send_head(status, hs) if type(conn) is PreparedH11 else None
        if data is None:
            if type(conn) is PreparedH11 and conn.their_http_version == b"1.1" and conn._cstate.keep_alive:
                # item 15: the head h11's clean-up would make (a chunked body: its framing header
                # last, title-cased, as set_comma_header appends it), built once
                ev = h11.Response(status_code=status, headers=[*hs, _CHUNKED], _parsed=True)
                conn.prepared = ev
            else:
                ev = h11.Response(status_code=status, headers=hs, _parsed=True)
            data = conn.send(ev)
        # hypercorn's access log alone reads it again (not hs: one list less per stream);
        # with none (Narwhal's server turns it off), one shared head per status, none per stream
        if proto.config.log.access_logger is None:
            st.response = _STARTED.get(status) or _STARTED.setdefault(status, {"type": "http.response.start", "status": status, "headers": ()})
        else:
            st.response = {"type": "http.response.start", "status": status, "headers": headers}
        st.state = _RESPONSE
        if first and type(conn._writer) is ChunkedWriter:
            data = (data or b"") + b"%x\r\n%b\r\n" % (len(first), first)
        elif first:  # not chunked after all (an HTTP/1.0 client): the body as ASGI sends it
            data = (data or b"") + (conn.send(h11.Data(data=first)) or b"")
        if data:
            t.write(data)
        return True

    def write(self, data: bytes) -> bool:
        return self.write_chunk(b"%x\r\n%b\r\n" % (len(data), data) if data else b"")

    def write_chunk(self, framed: bytes) -> bool:
        """`write` for bytes framed already as one chunk (`%x\r\n...\r\n`, as `write`
        frames them; the compiled step's): written now under the same guards (True), or
        nothing (False)."""
        t = self._transport
        st = self._stream
        c = self._conn
        if (
            st.state is not _RESPONSE or st.closed or c.our_state is not _SEND_BODY or type(c._writer) is not ChunkedWriter
            or self._lock._locked or t.is_closing() or t.get_write_buffer_size() > DIRECT_BUFFER
        ):
            return False
        if framed:
            t.write(framed)
        return True

    def end(self, last: bytes) -> bool:
        """Item 17: the response's `last` body bytes and its end (h11's EndOfMessage: the
        last chunk) written in one write, h11's state moved on as ASGI's final
        http.response.body would move it, and the stream CLOSED as hypercorn's
        `_send_closed` leaves it; False: nothing was done (end it through ASGI). The same
        guards as `write`, and hypercorn's access log off (it is written in between);
        `closed()` must follow, as the StreamClosed hypercorn sends next."""
        t = self._transport
        st = self._stream
        c = self._conn
        if (
            st.state is not _RESPONSE or st.closed or c.our_state is not _SEND_BODY or type(c._writer) is not ChunkedWriter
            or c.their_state is _ERROR or self._lock._locked or t.is_closing() or t.get_write_buffer_size() > DIRECT_BUFFER
            or self._proto.config.log.access_logger is not None
        ):
            return False
        tail = c.send_end() if type(c) is PreparedH11 else None  # item 19
        if tail is None:
            tail = c.send(_EOM) or b""  # b"0\r\n\r\n"; h11: our side DONE
        t.write(b"%x\r\n%b\r\n%b" % (len(last), last, tail) if last else tail)
        st.state = _CLOSED
        return True

    async def closed(self) -> None:
        """After `end`: hypercorn's StreamClosed, as `_send_closed` sends it (the
        connection is recycled for the next request, or closed)."""
        st = self._stream
        await st.send(StreamClosed(stream_id=st.stream_id))


def _refused_value(headers: list[tuple[bytes, bytes]]) -> bool:
    """A header value with CR, LF or NUL: h11 would refuse it, so the head goes through ASGI."""
    return any(b"\r" in v or b"\n" in v or b"\0" in v for _, v in headers)


_EOM = h11.EndOfMessage()
_CHUNKED = (b"Transfer-Encoding", b"chunked")
# a head H1Direct.prepare built: (status, the second it was built in, the app's headers,
# the bytes)
PreparedHead = tuple[int, int, list[tuple[bytes, bytes]], bytes]
_STARTED: dict[int, Any] = {}  # status -> the http.response.start hypercorn's stream keeps (never changed)


class PreparedH11(h11.Connection):
    """Item 15: h11's server connection, except that a Response H1Direct built whole (the
    headers h11's clean-up would give it) is sent as built: h11 rebuilds a response's headers
    twice and validates them three times (~25 us of the first token's path); item 18: a
    common request head is read by h1head.parse_head. Anything else is h11's own path.
    HardenedH11Protocol's connection is one of these."""

    prepared: h11.Response | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        LeanH11State.adopt(self._cstate)

    @staticmethod
    def adopt(conn: h11.Connection) -> None:
        """`conn` (h11's, fresh) becomes one of these: the same objects, methods changed."""
        conn.__class__ = PreparedH11
        LeanH11State.adopt(conn._cstate)

    def _extract_next_receive_event(self) -> Any:
        """Item 18: a client's request head, whole in the buffer, read the short way
        (h1head.parse_head: the very Request h11's reader would make, or None); anything
        else, and everything after the head, is h11's reader's. h11's next_event then
        processes it as its own (state, keep-alive, Expect, the body's reader)."""
        buf = self._receive_buffer
        if self.their_state is _IDLE and type(buf) is ReceiveBuffer and buf:
            got = parse_head(buf._data)
            if got is not None:
                buf._extract(got[1])
                return got[0]
        return super()._extract_next_receive_event()

    def _clean_up_response_headers_for_sending(self, response: h11.Response) -> h11.Response:
        if response is self.prepared:
            self.prepared = None
            return response
        self.prepared = None
        return super()._clean_up_response_headers_for_sending(response)  # type: ignore[misc]

    # -- item 19: a whole request's cycle in three steps, each what h11 would do --------
    # Invariant, each tested against h11 itself as the oracle (tests/http/test_h1cycle.py):
    # when a step answers, the bytes it gives (or takes) and the state it leaves -- both
    # sides' states, keep-alive, the pending switch proposals, the request method, their
    # HTTP version, 100-continue, the reader, the writer, the receive buffer -- are exactly
    # those of h11's own next_event / send; when it declines (None) it changed nothing.

    def next_whole(self) -> tuple[h11.Request, bytes | None] | None:
        """A common request read in one step: a head `parse_head` reads, `POST`, a
        Content-Length, no Expect, no Upgrade, no Connection but keep-alive, at the start
        of a cycle. Returns (the Request, its body) when all of the body is in the buffer,
        the connection left as h11's next_event leaves it after the Request, its Data and
        EndOfMessage (the client DONE, the server to SEND_RESPONSE); or (the Request, None)
        when it is not (a client that writes its head and body apart, as httpx does), left
        as after the Request alone (the client to SEND_BODY, its body's reader set): the
        body is h11's to read, or `next_rest`'s."""
        cs = self._cstate
        states = cs.states
        buf = self._receive_buffer
        if (
            states[_CLIENT] is not _IDLE or states[_SERVER] is not _IDLE or not cs.keep_alive or cs.pending_switch_proposals
            or self.client_is_waiting_for_100_continue or self._receive_buffer_closed or type(buf) is not ReceiveBuffer
        ):
            return None
        data = buf._data
        got = parse_head(data)
        if got is None:
            return None
        req, k = got
        if req.method != b"POST":
            return None
        n = -1
        for _, name, value in req.headers._full_items:
            if name == b"content-length":
                n = int(value)
            elif name == b"expect" or name == b"upgrade" or (name == b"connection" and value.lower() != b"keep-alive"):
                return None
        if n < 0:
            return None
        buf._extract(k)
        states[_SERVER] = _SEND_RESPONSE
        self._request_method = b"POST"
        self.their_http_version = b"1.1"
        self._writer = _WRITE_RESPONSE
        if len(buf) < n:  # the body is still coming
            states[_CLIENT] = _SEND_BODY
            self._reader = ContentLengthReader(n)
            return req, None
        body = bytes(buf._extract(n)) if n else b""
        states[_CLIENT] = _DONE
        self._reader = _READ_DONE
        return req, body

    def next_rest(self) -> bytes | None:
        """The rest of a Content-Length body, when all of it is in the buffer: returned in
        one step, the connection left as h11's next_event leaves it after the body's Data
        and its EndOfMessage (the client DONE). Declines while a 100 Continue is owed (h11's
        loop sends it first), a protocol switch is proposed, or keep-alive is off."""
        cs = self._cstate
        r = self._reader
        buf = self._receive_buffer
        if (
            cs.states[_CLIENT] is not _SEND_BODY or type(r) is not ContentLengthReader or type(buf) is not ReceiveBuffer
            or not cs.keep_alive or cs.pending_switch_proposals or self.client_is_waiting_for_100_continue
        ):
            return None
        n = r._remaining
        if n <= 0 or len(buf) < n:
            return None
        body = bytes(buf._extract(n))
        cs.states[_CLIENT] = _DONE
        self._reader = _READ_DONE
        return body

    def send_head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The head of a chunked response to a POST whose request was read whole, as h11's
        send of Response(status, headers + Transfer-Encoding: chunked) writes it (after its
        clean-up, which leaves such headers as they are); the server to SEND_BODY with a
        chunked writer. Declines a status that has no body (1xx, 204, 304), a Host,
        Content-Length, Transfer-Encoding or Connection header (h11 would move or check
        them), and any other state."""
        head = self.head_bytes(status, headers)
        return None if head is None else self._send_built(head)

    @staticmethod
    def head_bytes(status: int, headers: list[tuple[bytes, bytes]]) -> bytes | None:
        """The bytes send_head writes for (status, headers), whatever the state: built
        ahead (a stream's head while its engine works), written by send_prepared. None
        where send_head declines for the status or a header."""
        if status < 200 or status == 204 or status == 304 or status > 999:
            return None
        lines = [b"HTTP/1.1 %d \r\n" % status]
        for name, value in headers:
            if name.lower() in _CHECKED:
                return None
            lines.append(b"%s: %s\r\n" % (name, value))
        lines.append(b"Transfer-Encoding: chunked\r\n\r\n")
        return b"".join(lines)

    def send_prepared(self, head: bytes) -> bytes | None:
        """send_head for a head head_bytes built: `head`, with h11's state moved on as
        send_head moves it, or None (nothing changed) in any state send_head declines."""
        return self._send_built(head)

    def _send_built(self, head: bytes) -> bytes | None:
        cs = self._cstate
        states = cs.states
        if (
            states[_SERVER] is not _SEND_RESPONSE or states[_CLIENT] is not _DONE or not cs.keep_alive or cs.pending_switch_proposals
            or self._request_method != b"POST" or self.their_http_version != b"1.1" or self._writer is not _WRITE_RESPONSE
        ):
            return None
        states[_SERVER] = _SEND_BODY
        self.client_is_waiting_for_100_continue = False
        self._writer = ChunkedWriter()
        self.prepared = None
        return head

    def send_end(self) -> bytes | None:
        """A chunked body's end, as h11's send of EndOfMessage (no trailers) writes it: the
        server DONE, no writer. Declines unless the client is DONE and keep-alive is on (h11
        would move both sides on)."""
        cs = self._cstate
        states = cs.states
        if states[_SERVER] is not _SEND_BODY or states[_CLIENT] is not _DONE or not cs.keep_alive or cs.pending_switch_proposals or type(self._writer) is not ChunkedWriter:
            return None
        states[_SERVER] = _DONE
        self._writer = None
        return b"0\r\n\r\n"


_NO_PROPOSALS: frozenset[Any] = frozenset()


class LeanH11State(ConnectionState):
    """h11's connection state, except that "no protocol switch proposed" is one shared
    empty frozenset, not a set per connection: h11 makes a new empty set at every
    Response, kept for the stream's life (216 B per open stream). h11 changes the set in
    one place only, a client's Upgrade or CONNECT proposal, where a set of its own is made
    first; everything else reads it."""

    @staticmethod
    def adopt(state: ConnectionState) -> None:
        """h11's state object becomes one of these (the same object; no set of its own)."""
        state.__class__ = LeanH11State
        if not state.pending_switch_proposals:
            state.pending_switch_proposals = _NO_PROPOSALS  # type: ignore[assignment]

    def process_client_switch_proposal(self, switch_event: type[Sentinel]) -> None:
        if self.pending_switch_proposals is _NO_PROPOSALS:
            self.pending_switch_proposals = set()
        super().process_client_switch_proposal(switch_event)

    def process_event(self, role: type[Sentinel], event_type: type[h11._events.Event], server_switch_event: type[Sentinel] | None = None) -> None:
        super().process_event(role, event_type, server_switch_event)
        if not self.pending_switch_proposals:
            self.pending_switch_proposals = _NO_PROPOSALS  # type: ignore[assignment]


_REQUEST = ASGIHTTPState.REQUEST
_RESPONSE = ASGIHTTPState.RESPONSE
_CLOSED = ASGIHTTPState.CLOSED
_ERROR = h11.ERROR
_IDLE = h11.IDLE
_DONE = h11.DONE
_SEND_RESPONSE = h11.SEND_RESPONSE
_SEND_BODY = h11.SEND_BODY
_CLIENT = h11.CLIENT
_SERVER = h11.SERVER
_READ_DONE = READERS[(h11.CLIENT, h11.DONE)]  # h11 0.16: what a client that is DONE is read with
_WRITE_RESPONSE = WRITERS[(h11.SERVER, h11.SEND_RESPONSE)]
_CHECKED = frozenset((b"host", b"content-length", b"transfer-encoding", b"connection"))  # send_head declines these
