"""h1.cycle.H1Direct (the direct path): a streaming answer's head, chunks and end written
straight to the transport byte for byte as h11 -- the oracle -- frames the same messages,
the connection's states moved on as its send would move them; and nothing written,
nothing changed, whenever the ASGI path would not write the same."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import h11
import pytest

from narwhal.http import h1
from narwhal.http.h1 import cycle
from narwhal.http.h1.cycle import CLOSED, REQUEST, RESPONSE, H1Direct
from narwhal.http.h1fast import DIRECT_BUFFER
from narwhal.http.lean import LeanLock


class _Transport:
    def __init__(self) -> None:
        self.out: list[bytes] = []
        self.buffered = 0
        self.closing = False

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return self.buffered


def _proto(conn: h1.Connection, t: _Transport) -> Any:
    cfg = SimpleNamespace(keep_alive_max_requests=1 << 40, response_headers=lambda proto: [(b"date", b"Thu, 03 Dec 2026 00:00:00 GMT")],
                          log=SimpleNamespace(access_logger=None))  # Narwhal's server: no access log
    return SimpleNamespace(h1=conn, lean=SimpleNamespace(transport=t, send_lock=LeanLock()), config=cfg, requests=1)


def _read(conn: Any, request: bytes) -> None:
    conn.receive_data(request)
    while not isinstance(conn.next_event(), (h1.Request, h11.Request)):
        pass
    conn.next_event()  # EndOfMessage


def _direct(http_version: bytes = b"1.1", content_length: bool = False) -> tuple[H1Direct, Any, h1.Connection, _Transport]:
    conn = h1.Connection()
    _read(conn, b"POST / HTTP/%b\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % http_version)
    headers = [(b"content-length", b"10")] if content_length else []
    conn.send(h1.Response(200, headers))
    t = _Transport()
    stream = SimpleNamespace(state=RESPONSE, closed=False)
    return H1Direct(stream, _proto(conn, t)), stream, conn, t  # type: ignore[arg-type]


def test_h1direct_frames_a_chunk_as_h11_does() -> None:
    d, _, conn, t = _direct()
    assert d.write(b"data: x\n\n")
    assert t.out == [conn.send(h1.Data(b"data: x\n\n"))]


def _declining(why: str) -> tuple[H1Direct, Any, h1.Connection, _Transport]:
    """An H1Direct in its response body with `why` true of it: one of the cases in which
    the ASGI path would not write what H1Direct writes."""
    d, stream, conn, t = _direct(http_version=b"1.0" if why == "http10" else b"1.1", content_length=why == "content_length")
    d._proto.config = SimpleNamespace(log=SimpleNamespace(access_logger=object() if why == "access_log" else None))
    if why == "not_in_response":
        stream.state = CLOSED
    elif why == "closed":
        stream.closed = True
    elif why == "buffer_full":
        t.buffered = DIRECT_BUFFER + 1
    elif why == "closing":
        t.closing = True
    elif why == "lock_held":
        d._lock._locked = True
    elif why == "client_error":
        conn.cs.error(h1.CLIENT)
    return d, stream, conn, t


_DECLINES = ["not_in_response", "closed", "buffer_full", "closing", "lock_held", "http10", "content_length"]


@pytest.mark.parametrize("why", _DECLINES)
@pytest.mark.parametrize("method", ["write", "write_chunk"])
def test_h1direct_declines_whenever_asgi_would_not_write_the_same(why: str, method: str) -> None:
    d, _, _, t = _declining(why)
    assert getattr(d, method)(b"data: x\n\n") is False
    assert t.out == []


def test_h1direct_write_chunk_writes_the_framed_bytes_as_they_are() -> None:
    d, _, conn, t = _direct()
    framed = conn.send(h1.Data(b"data: x\n\n"))
    assert d.write_chunk(framed) and t.out == [framed]


def _fresh(whole: bool = True, request: bytes = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n") -> tuple[H1Direct, Any, h1.Connection, _Transport]:
    """An H1Direct on a connection whose request is in and whose response has not begun;
    `whole`: read in one step (next_whole, where it takes it), else event by event."""
    conn = h1.Connection()
    conn.receive_data(request)
    if not (whole and conn.next_whole()):
        while not isinstance(conn.next_event(), h1.Request):
            pass
        conn.next_event()
    t = _Transport()
    stream = SimpleNamespace(state=REQUEST, closed=False, response=None)
    return H1Direct(stream, _proto(conn, t)), stream, conn, t  # type: ignore[arg-type]


def test_h1direct_start_writes_the_head_h11_would_and_moves_the_states_on() -> None:
    d, stream, conn, t = _fresh()
    headers = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")]
    assert d.start(200, headers)
    ref = h11.Connection(h11.SERVER)
    ref.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    ref.next_event(), ref.next_event()
    assert t.out == [ref.send(h11.Response(status_code=200, headers=[*headers, (b"date", b"Thu, 03 Dec 2026 00:00:00 GMT")]))]
    assert stream.state is RESPONSE and stream.response["status"] == 200
    assert conn.our_state is h1.SEND_BODY
    assert d.write(b"data: x\n\n")  # and the body goes on as chunks
    assert stream.response["headers"] == ()  # no access log: the stream keeps no head of its own


def test_h1direct_start_keeps_the_head_for_an_access_log() -> None:
    d, stream, _, _ = _fresh()
    d._proto.config.log = SimpleNamespace(access_logger=object())
    headers = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")]
    assert d.start(200, headers)
    assert stream.response == {"type": "http.response.start", "status": 200, "headers": headers}


_REQUESTS = {
    "keep_alive": b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n",
    "connection_close": b"POST / HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: 0\r\n\r\n",
    "http10": b"POST / HTTP/1.0\r\ncontent-length: 0\r\n\r\n",
}


@pytest.mark.parametrize("ahead", [False, True], ids=["built_at_start", "built_ahead"])
@pytest.mark.parametrize("first", [b"", b"data: {}\n\n"], ids=["head_only", "with_first_event"])
@pytest.mark.parametrize("request_kind", list(_REQUESTS))
@pytest.mark.parametrize("whole", [False, True], ids=["event_by_event", "whole"])
def test_h1direct_start_writes_byte_for_byte_what_h11_writes(whole: bool, request_kind: str, first: bytes, ahead: bool) -> None:
    """The head built whole (send_head, send_prepared), or by the connection's own clean-up
    (a client that asked to close, HTTP/1.0): the same bytes and states as h11 sending the
    Response and then the first Data, in one write; so too with the head built ahead
    (H1Direct.prepare), where a state in which another head is due (close, HTTP/1.0) has
    it built at the start."""
    d, _, conn, t = _fresh(whole, _REQUESTS[request_kind])
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-request-id", b"abc")]
    prepared = d.prepare(200, headers) if ahead else None
    assert (prepared is not None) == ahead
    assert d.start(200, headers, first, prepared)
    ref = h11.Connection(h11.SERVER)
    ref.receive_data(_REQUESTS[request_kind])
    ref.next_event(), ref.next_event()
    want = ref.send(h11.Response(status_code=200, headers=[*headers, (b"date", b"Thu, 03 Dec 2026 00:00:00 GMT")])) or b""
    if first:
        want += ref.send(h11.Data(data=first)) or b""
    assert t.out == [want]
    assert repr(conn.our_state) == repr(ref.our_state) and conn.keep_alive == (ref.our_state is not h11.MUST_CLOSE and request_kind == "keep_alive")
    assert conn.send(h1.EndOfMessage()) == ref.send(h11.EndOfMessage())
    assert repr(conn.our_state) == repr(ref.our_state)


@pytest.mark.parametrize("stale", ["status", "a_header_added", "the_next_second", "a_bad_value"])
def test_h1direct_start_never_writes_a_head_built_ahead_that_is_not_the_head_now(stale: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 21: a head built ahead is written only for the same status, as many headers
    and within the same second (hypercorn's Date); otherwise the head of now is built."""
    clock = [1_000_000.2]
    monkeypatch.setattr(cycle, "_time", lambda: clock[0])
    d, _, conn, t = _fresh(True, _REQUESTS["keep_alive"])
    d._proto.config.response_headers = lambda proto: [(b"date", b"second %d" % int(clock[0]))]
    headers = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")]
    prepared = d.prepare(200, headers)
    assert prepared is not None
    status = 200
    if stale == "status":
        status = 201
    elif stale == "a_header_added":  # (the app appends: x-narwhal-projected-ttft-ms)
        headers = [*headers, (b"x-narwhal-projected-ttft-ms", b"5")]
    elif stale == "the_next_second":
        clock[0] += 1.0
    else:  # built ahead for good headers, started with a value h11 would refuse: declined
        headers = [headers[0], (b"x-request-id", b"a\r\nset-cookie: x")]
        assert d.start(status, headers, b"", prepared) is False and t.out == []
        return
    assert d.start(status, headers, b"", prepared)
    ref = h11.Connection(h11.SERVER)
    ref.receive_data(_REQUESTS["keep_alive"])
    ref.next_event(), ref.next_event()
    assert t.out == [ref.send(h11.Response(status_code=status, headers=[*headers, (b"date", b"second %d" % int(clock[0]))]))]
    assert conn.our_state is h1.SEND_BODY and ref.our_state is h11.SEND_BODY


@pytest.mark.parametrize("why", ["crlf_in_a_value", "nul_in_a_value", "already_started", "lock_held", "closing", "last_keep_alive_request"])
def test_h1direct_start_declines_what_asgi_must_send(why: str) -> None:
    d, stream, _, t = _fresh()
    headers = [(b"content-type", b"text/event-stream")]
    if why == "crlf_in_a_value":
        headers.append((b"x-request-id", b"a\r\nset-cookie: x"))
    elif why == "nul_in_a_value":
        headers.append((b"x-request-id", b"a\0b"))
    elif why == "already_started":
        stream.state = RESPONSE
    elif why == "lock_held":
        d._lock._locked = True
    elif why == "closing":
        t.closing = True
    elif why == "last_keep_alive_request":
        d._proto.requests = d._proto.config.keep_alive_max_requests
    assert d.start(200, headers) is False and t.out == []


@pytest.mark.parametrize("last", [b"", b"data: {}\n\ndata: [DONE]\n\n"], ids=["end_only", "with_last_events"])
@pytest.mark.parametrize("request_kind", ["keep_alive", "connection_close"])
def test_h1direct_end_writes_byte_for_byte_what_h11_writes_in_one_write(request_kind: str, last: bytes) -> None:
    """Item 17: the last events and h11's last chunk in one write, the same bytes and
    states as h11 sending Data(last) and EndOfMessage; the stream CLOSED as hypercorn's
    _send_closed leaves it (its StreamClosed is `closed()`, over real HTTP below)."""
    d, stream, conn, t = _fresh(True, _REQUESTS[request_kind])
    headers = [(b"content-type", b"text/event-stream")]
    assert d.start(200, headers, b"data: {}\n\n")
    ref = h11.Connection(h11.SERVER)
    ref.receive_data(_REQUESTS[request_kind])
    ref.next_event(), ref.next_event()
    ref.send(h11.Response(status_code=200, headers=[*headers, (b"date", b"Thu, 03 Dec 2026 00:00:00 GMT")]))
    ref.send(h11.Data(data=b"data: {}\n\n"))
    want = (ref.send(h11.Data(data=last)) if last else b"") + ref.send(h11.EndOfMessage())  # type: ignore[operator]
    del t.out[:]
    assert d.end(last) is True
    assert t.out == [want]
    assert repr(conn.our_state) == repr(ref.our_state) and conn.our_state in (h1.DONE, h1.MUST_CLOSE)
    assert stream.state is CLOSED


@pytest.mark.parametrize("why", [*_DECLINES, "access_log", "client_error"])
def test_h1direct_end_declines_whenever_asgi_would_not_write_the_same(why: str) -> None:
    d, stream, conn, t = _declining(why)
    state, before = conn.our_state, stream.state
    assert d.end(b"data: [DONE]\n\n") is False
    assert t.out == [] and conn.our_state is state and stream.state is before  # nothing written, nothing moved on
