"""serving.relay_path (issue 25): the direct path writes what the ASGI path would, and only
when it would; the relay step is the same on both. The relay's behaviour tests run on both
paths (tests/conftest.py `relay_path`); these test the pieces and that each path is the one
taken."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import h11
import httpx
import orjson
import pytest
from hypercorn.protocol.http_stream import ASGIHTTPState

from narwhal.core import fastevent
from narwhal.core.relay import StreamRelay
from narwhal.http import hyper
from narwhal.http.h1fast import _NO_PROPOSALS, LeanH11State
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream import http1
from narwhal.upstream.engines import EngineSpec
from narwhal.worker.direct import DirectFeed
from tests.helpers import running_router, sse

# -- H1Direct: h11's framing, and nothing when the ASGI path would not write ---------------


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


def _direct(http_version: bytes = b"1.1", content_length: bool = False) -> tuple[hyper.H1Direct, Any, h11.Connection, _Transport]:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST / HTTP/%b\r\nhost: x\r\ncontent-length: 0\r\n\r\n" % http_version)
    while not isinstance(conn.next_event(), h11.Request):
        pass
    conn.next_event()  # EndOfMessage
    headers = [(b"content-length", b"10")] if content_length else []
    conn.send(h11.Response(status_code=200, headers=headers))
    t = _Transport()
    server = SimpleNamespace(transport=t, send_lock=asyncio.Lock())
    stream = SimpleNamespace(state=ASGIHTTPState.RESPONSE, closed=False)
    proto = SimpleNamespace(connection=conn)
    return hyper.H1Direct(stream, proto, server), stream, conn, t  # type: ignore[arg-type]


def test_h1direct_frames_a_chunk_as_h11_does() -> None:
    d, _, conn, t = _direct()
    assert d.write(b"data: x\n\n")
    assert t.out == [conn.send(h11.Data(data=b"data: x\n\n"))]


def _declining(why: str) -> tuple[hyper.H1Direct, Any, h11.Connection, _Transport]:
    """An H1Direct in its response body with `why` true of it: one of the cases in which
    the ASGI path would not write what H1Direct writes."""
    d, stream, conn, t = _direct(http_version=b"1.0" if why == "http10" else b"1.1", content_length=why == "content_length")
    d._proto.config = SimpleNamespace(log=SimpleNamespace(access_logger=object() if why == "access_log" else None))
    if why == "not_in_response":
        stream.state = ASGIHTTPState.CLOSED
    elif why == "closed":
        stream.closed = True
    elif why == "buffer_full":
        t.buffered = hyper.DIRECT_BUFFER + 1
    elif why == "closing":
        t.closing = True
    elif why == "lock_held":
        d._lock._locked = True
    elif why == "client_error":
        conn._cstate.process_error(h11.CLIENT)
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
    framed = conn.send(h11.Data(data=b"data: x\n\n"))
    assert d.write_chunk(framed) and t.out == [framed]


def _fresh(cls: type[h11.Connection] = h11.Connection, request: bytes = b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n") -> tuple[hyper.H1Direct, Any, h11.Connection, _Transport]:
    """An H1Direct on a connection whose request is in and whose response has not begun."""
    conn = cls(h11.SERVER)
    conn.receive_data(request)
    while not isinstance(conn.next_event(), h11.Request):
        pass
    conn.next_event()
    t = _Transport()
    server = SimpleNamespace(transport=t, send_lock=asyncio.Lock())
    stream = SimpleNamespace(state=ASGIHTTPState.REQUEST, closed=False)
    cfg = SimpleNamespace(keep_alive_max_requests=1 << 40, response_headers=lambda proto: [(b"date", b"Thu, 03 Dec 2026 00:00:00 GMT")],
                          log=SimpleNamespace(access_logger=None))  # Narwhal's server: no access log
    proto = SimpleNamespace(connection=conn, config=cfg, keep_alive_requests=1)
    return hyper.H1Direct(stream, proto, server), stream, conn, t  # type: ignore[arg-type]


def test_h1direct_start_writes_the_head_h11_would_and_moves_the_states_on() -> None:
    d, stream, conn, t = _fresh()
    headers = [(b"content-type", b"text/event-stream"), (b"x-request-id", b"abc")]
    assert d.start(200, headers)
    ref = h11.Connection(h11.SERVER)
    ref.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    ref.next_event(), ref.next_event()
    assert t.out == [ref.send(h11.Response(status_code=200, headers=[*headers, (b"date", b"Thu, 03 Dec 2026 00:00:00 GMT")]))]
    assert stream.state is ASGIHTTPState.RESPONSE and stream.response["status"] == 200
    assert conn.our_state is h11.SEND_BODY
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
@pytest.mark.parametrize("cls", [h11.Connection, hyper.PreparedH11], ids=["h11", "prepared"])
def test_h1direct_start_writes_byte_for_byte_what_h11_writes(cls: type[h11.Connection], request_kind: str, first: bytes, ahead: bool) -> None:
    """Item 15: the head built as h11 would leave it (PreparedH11), or h11's own clean-up
    (a client that asked to close, HTTP/1.0): the same bytes and states as h11 sending the
    Response and then the first Data, in one write. Item 21: so too with the head built
    ahead (H1Direct.prepare), where a state in which h11 would write another head (close,
    HTTP/1.0) has it built at the start as before."""
    d, _, conn, t = _fresh(cls, _REQUESTS[request_kind])
    headers = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"), (b"x-request-id", b"abc")]
    prepared = d.prepare(200, headers) if ahead else None
    assert (prepared is not None) == (ahead and cls is hyper.PreparedH11)
    assert d.start(200, headers, first, prepared)
    ref = h11.Connection(h11.SERVER)
    ref.receive_data(_REQUESTS[request_kind])
    ref.next_event(), ref.next_event()
    want = ref.send(h11.Response(status_code=200, headers=[*headers, (b"date", b"Thu, 03 Dec 2026 00:00:00 GMT")])) or b""
    if first:
        want += ref.send(h11.Data(data=first)) or b""
    assert t.out == [want]
    assert conn.our_state is ref.our_state and type(conn._writer) is type(ref._writer)
    assert getattr(conn, "prepared", None) is None  # nothing left to mistake for a later response
    assert conn.send(h11.EndOfMessage()) == ref.send(h11.EndOfMessage())


@pytest.mark.parametrize("stale", ["status", "a_header_added", "the_next_second", "a_bad_value"])
def test_h1direct_start_never_writes_a_head_built_ahead_that_is_not_the_head_now(stale: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Item 21: a head built ahead is written only for the same status, as many headers
    and within the same second (hypercorn's Date); otherwise the head of now is built."""
    from narwhal.http import h1fast

    clock = [1_000_000.2]
    monkeypatch.setattr(h1fast, "_time", lambda: clock[0])
    d, _, conn, t = _fresh(hyper.PreparedH11, _REQUESTS["keep_alive"])
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
    assert conn.our_state is ref.our_state is h11.SEND_BODY


def test_prepared_h11_builds_any_other_response_as_h11_does() -> None:
    """A Response not built by H1Direct (a refusal's head, with content-length) takes h11's
    own clean-up."""
    conn, ref = hyper.PreparedH11(h11.SERVER), h11.Connection(h11.SERVER)
    for c in (conn, ref):
        c.receive_data(_REQUESTS["keep_alive"])
        c.next_event(), c.next_event()
    hs = [(b"content-type", b"application/json"), (b"content-length", b"2")]
    assert conn.send(h11.Response(status_code=429, headers=hs)) == ref.send(h11.Response(status_code=429, headers=hs))
    assert conn.send(h11.Data(data=b"{}")) == ref.send(h11.Data(data=b"{}"))


@pytest.mark.parametrize("why", ["crlf_in_a_value", "nul_in_a_value", "already_started", "lock_held", "closing", "last_keep_alive_request"])
def test_h1direct_start_declines_what_asgi_must_send(why: str) -> None:
    d, stream, _, t = _fresh()
    headers = [(b"content-type", b"text/event-stream")]
    if why == "crlf_in_a_value":
        headers.append((b"x-request-id", b"a\r\nset-cookie: x"))
    elif why == "nul_in_a_value":
        headers.append((b"x-request-id", b"a\0b"))
    elif why == "already_started":
        stream.state = ASGIHTTPState.RESPONSE
    elif why == "lock_held":
        d._lock._locked = True
    elif why == "closing":
        t.closing = True
    elif why == "last_keep_alive_request":
        d._proto.keep_alive_requests = d._proto.config.keep_alive_max_requests
    assert d.start(200, headers) is False and t.out == []


@pytest.mark.parametrize("last", [b"", b"data: {}\n\ndata: [DONE]\n\n"], ids=["end_only", "with_last_events"])
@pytest.mark.parametrize("request_kind", ["keep_alive", "connection_close"])
def test_h1direct_end_writes_byte_for_byte_what_h11_writes_in_one_write(request_kind: str, last: bytes) -> None:
    """Item 17: the last events and h11's last chunk in one write, the same bytes and
    states as h11 sending Data(last) and EndOfMessage; the stream CLOSED as hypercorn's
    _send_closed leaves it (its StreamClosed is `closed()`, over real HTTP below)."""
    d, stream, conn, t = _fresh(hyper.PreparedH11, _REQUESTS[request_kind])
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
    assert conn.our_state is ref.our_state and conn.our_state in (h11.DONE, h11.MUST_CLOSE)
    assert stream.state is ASGIHTTPState.CLOSED


@pytest.mark.parametrize("why", [*_DECLINES, "access_log", "client_error"])
def test_h1direct_end_declines_whenever_asgi_would_not_write_the_same(why: str) -> None:
    d, stream, conn, t = _declining(why)
    state, before = conn.our_state, stream.state
    assert d.end(b"data: [DONE]\n\n") is False
    assert t.out == [] and conn.our_state is state and stream.state is before  # nothing written, nothing moved on


# -- DirectFeed: a step is handled once, by the callback or by the task ------------------


def _event(ids: list[int], text: str = "a", finish: str | None = None) -> bytes:
    c = {"index": 0, "delta": {"content": text}, "token_ids": ids, "finish_reason": finish}
    return b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [c]}) + b"\n\n"


def _relay() -> StreamRelay:
    return StreamRelay(checks_ids=True, client_ids=False, client_usage=False)


class _Sink:
    """What DirectFeed uses of a streaming client's sink."""

    def __init__(self, *, head: bool = True, write: bool = True, started: bool = True) -> None:
        self.headers_sent = started
        self.out: list[bytes] = []
        self._head, self._write = head, write
        self.chunk_writer: _Chunks | None = None  # an HTTP/2 client's: no compiled step

    def write_now(self, data: bytes) -> bool:
        assert self.headers_sent
        if self._write:
            self.out.append(data)
        return self._write

    def start_now(self, first: bytes) -> bool:
        assert not self.headers_sent
        if self._head:
            self.headers_sent = True
            self.out.append(b"HEAD|" + first)
        return self._head


def _feed(relay: StreamRelay | None = None, sink: _Sink | None = None, held: list[bytes] | None = None) -> tuple[DirectFeed, list[float]]:
    firsts: list[float] = []
    return DirectFeed(relay or _relay(), lambda: 1.0, sink, [] if held is None else held, firsts.append), firsts


def test_direct_feed_starts_the_stream_with_its_first_token_and_hands_the_end_and_failures_to_the_task() -> None:
    sink = _Sink(started=False)
    f, firsts = _feed(sink=sink)
    assert f.take(_event([1])) is True and f.pending is None  # head and first token in one write
    assert len(sink.out) == 1 and sink.out[0].startswith(b"HEAD|data: ") and firsts == [1.0]  # its books after its bytes
    assert f.take(_event([2])) is True and f.pending is None and firsts == [1.0]
    assert b"token_ids" not in sink.out[1]  # T10: stripped on this path too
    assert f.take(b"data: {not json}\n\n") is False and f.pending is not None and f.pending[0].failure == ("E02", "an engine event is not JSON")
    assert f.take(_event([3], finish="stop") + b"data: [DONE]\n\n") is False and f.pending[0].done  # type: ignore[index]


def test_direct_feed_holds_what_comes_before_the_first_token_and_writes_it_with_the_head() -> None:
    sink = _Sink(started=False)
    held: list[bytes] = []
    f, _ = _feed(sink=sink, held=held)
    role = b"data: " + orjson.dumps({"id": "x", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}) + b"\n\n"
    assert f.take(role) is True and sink.out == [] and len(held) == 1  # the task's own buffer
    assert f.take(_event([1])) is True and held == []
    assert len(sink.out) == 1 and sink.out[0].count(b"data: ") == 2  # one write: head, role event, first token


def test_direct_feed_hands_a_declined_head_to_the_task_without_holding_its_bytes() -> None:
    sink = _Sink(started=False, head=False)
    held: list[bytes] = []
    f, firsts = _feed(sink=sink, held=held)
    assert f.take(_event([1])) is False and f.pending is not None and f.pending[0].first_token
    assert held == [] and firsts == []  # the task appends the step's bytes and starts through ASGI, then keeps the books


def test_direct_feed_checks_token_ids_T03() -> None:
    f, _ = _feed(sink=_Sink())
    f.take(_event([1]))
    assert f.take(_event([-5])) is False
    assert f.pending is not None and f.pending[0].failure is not None and f.pending[0].failure[0] == "E03"


def test_direct_feed_hands_over_a_write_the_sink_declines() -> None:
    f, _ = _feed(sink=_Sink(write=False))
    assert f.take(_event([1])) is False
    step = f.pending[0] if f.pending else None
    assert step is not None and step.out and step.failure is None  # the task writes it through ASGI


def test_direct_feed_for_an_assembling_relay_writes_nothing() -> None:
    from narwhal.core.assembly import Assembler

    relay = StreamRelay(checks_ids=True, client_ids=False, client_usage=False, assembler=Assembler("chat"))
    f, firsts = _feed(relay=relay)
    assert f.take(_event([1])) is True and firsts == [1.0]
    assert f.take(_event([2])) is True
    assert f.take(_event([3], finish="stop") + b"data: [DONE]\n\n") is False and f.pending is not None and f.pending[0].done


# -- DirectFeed.whole: the compiled step, and the books as `take` keeps them --------------


class _Chunks:
    """A client connection's write_chunk (H1Direct's), writing or declining."""

    def __init__(self, ok: bool = True) -> None:
        self.ok = ok
        self.out: list[bytes] = []

    def write_chunk(self, framed: bytes) -> bool:
        if self.ok:
            self.out.append(framed)
        return self.ok


def _framed(payload: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(payload), payload)


def _books(relay: StreamRelay) -> tuple[int, int, int, float | None]:
    return relay.events, relay.token_count, relay.arrivals.tokens, relay.arrivals.last_at


def _native_feed(chunks: _Chunks, *, started: bool = True, native: bool = True, relay: StreamRelay | None = None) -> tuple[DirectFeed, StreamRelay]:
    relay = relay or _relay()
    sink = _Sink()
    sink.chunk_writer = chunks  # type: ignore[attr-defined]
    f = DirectFeed(relay, lambda: 1.0, sink, [], lambda now: None, native=native)
    if started:
        assert f.take(_event([1])) is True  # the first token: always the Python step's
    return f, relay


needs_native = pytest.mark.skipif(fastevent.event is None, reason="the compiled step was not built (no C compiler at install)")


@needs_native
def test_whole_writes_what_take_writes_and_keeps_the_same_books() -> None:
    ev = _event([7, 8], text='q"\n\u00e9')
    chunks = _Chunks()
    f, relay = _native_feed(chunks)
    assert f.native and f.whole(_framed(ev)) is True
    ref, ref_sink = _relay(), _Sink()
    g, _ = _feed(relay=ref, sink=ref_sink)
    assert g.take(_event([1])) and g.take(ev)
    assert chunks.out == [_framed(ref_sink.out[-1])]  # byte for byte what H1Direct.write frames of `take`'s output
    assert _books(relay) == _books(ref) == (2, 3, 3, 1.0)


@needs_native
@pytest.mark.parametrize("case", ["not_started", "writer_declines", "bad_id", "finish", "two_events", "not_native"])
def test_whole_declines_and_changes_nothing(case: str) -> None:
    """Whatever `whole` does not take leaves the relay as it was: the read is decoded and
    `take`n, which then handles it (a failure, the end, a held event)."""
    chunks = _Chunks(ok=case != "writer_declines")
    f, relay = _native_feed(chunks, started=case != "not_started", native=case != "not_native")
    data = {
        "bad_id": _framed(_event([-5])),
        "finish": _framed(_event([9], finish="stop")),
        "two_events": _framed(_event([9]) + _event([10])),
    }.get(case, _framed(_event([9])))
    before = _books(relay)
    if case == "not_native":  # serving.relay_native false: the connection never offers a read whole
        assert not f.native
        return
    assert f.native and f.whole(data) is False
    assert _books(relay) == before and chunks.out == []


def test_whole_is_never_offered_for_an_assembling_relay_or_without_a_chunk_writer() -> None:
    from narwhal.core.assembly import Assembler

    assembling = StreamRelay(checks_ids=True, client_ids=False, client_usage=False, assembler=Assembler("chat"))
    assert not DirectFeed(assembling, lambda: 1.0, None, [], lambda now: None, native=True).native
    assert not DirectFeed(_relay(), lambda: 1.0, _Sink(), [], lambda now: None, native=True).native  # no chunk_writer: HTTP/2
    no_ids = StreamRelay(checks_ids=False, client_ids=False, client_usage=False)
    sink = _Sink()
    sink.chunk_writer = _Chunks()  # type: ignore[attr-defined]
    assert not DirectFeed(no_ids, lambda: 1.0, sink, [], lambda now: None, native=True).native  # T08: counted in Python


# -- the path taken, over real HTTP -----------------------------------------------------


_ROUTERS: dict[str, Any] = {}


@pytest.fixture(scope="module")
def routed(relay_path: str) -> Iterator[tuple[str, str]]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=Timing(time_scale=0.25))]) as mocks:
        specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None) for m in mocks]
        cfg = {"serving": {"relay_path": relay_path}, "admission": {"mode": "open", "prediction": {"profile_on_start": False}}}
        with running_router(cfg, specs) as rr:
            _ROUTERS[relay_path] = rr
            yield rr.url, relay_path


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    n = {"direct_writes": 0, "direct_reads": 0, "direct_starts": 0, "direct_ends": 0, "native": 0}
    write, start, push, end, whole = hyper.H1Direct.write, hyper.H1Direct.start, http1._Conn._push, hyper.H1Direct.end, DirectFeed.whole

    def counting_whole(self: DirectFeed, data: bytes) -> bool:
        ok = whole(self, data)  # taken whole by the compiled step: a direct read and write
        n["native"] += ok
        n["direct_reads"] += ok
        n["direct_writes"] += ok
        return ok

    def counting_end(self: hyper.H1Direct, last: bytes) -> bool:
        ok = end(self, last)
        n["direct_ends"] += ok and bool(last)
        return ok

    def counting_start(self: hyper.H1Direct, status: int, headers: list[tuple[bytes, bytes]], first: bytes = b"", prepared: Any = None) -> bool:
        ok = start(self, status, headers, first, prepared)
        n["direct_starts"] += ok and bool(first)
        return ok

    def counting_write(self: hyper.H1Direct, data: bytes) -> bool:
        ok = write(self, data)
        n["direct_writes"] += ok
        return ok

    def counting_push(self: Any, data: bytes) -> None:
        n["direct_reads"] += self._direct is not None
        push(self, data)

    monkeypatch.setattr(hyper.H1Direct, "write", counting_write)
    monkeypatch.setattr(hyper.H1Direct, "start", counting_start)
    monkeypatch.setattr(hyper.H1Direct, "end", counting_end)
    monkeypatch.setattr(http1._Conn, "_push", counting_push)
    monkeypatch.setattr(DirectFeed, "whole", counting_whole)
    return n


def _chat(stream: bool, n: int = 12) -> dict[str, Any]:
    return {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "stream": stream, "max_tokens": n, "mock": {"tpot_ms": 5}}


@pytest.mark.parametrize("http2", [False, True], ids=["h1", "h2"])
def test_the_path_each_request_takes(routed: tuple[str, str], counted: dict[str, int], http2: bool) -> None:
    """direct: an HTTP/1.1 stream's engine reads are fed from the engine connection's
    callback, its head written with its first token and the events after it straight to
    the client's connection; a non-streaming answer's reads are fed there too, over either protocol
    (an HTTP/2 stream's events go through ASGI send, so its reads wake its task). asgi:
    none of it. The answers are the same."""
    url, path = routed
    with httpx.Client(http2=http2, http1=not http2, timeout=30) as c:
        s = sse(url, _chat(True), client=c)
        assert s.status == 200 and s.done and len(s.chunks) == 13
        streamed, writes, starts = counted["direct_reads"], counted["direct_writes"], counted["direct_starts"]
        # the next request on the same connection: the stream's end recycled it (item 17)
        r = c.post(url + "/v1/chat/completions", json=_chat(False))
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 12
        s2 = sse(url, _chat(True, 3), client=c)
        assert s2.status == 200 and s2.done and len(s2.chunks) == 4
        r = c.post(url + "/v1/chat/completions", json=_chat(False, 1))  # after s2's end, its count is in
        assert r.status_code == 200
    ends = counted["direct_ends"]
    assembled = counted["direct_reads"] - streamed
    native = counted["native"]
    if path == "asgi":
        assert (streamed, writes, starts, assembled, ends, native) == (0, 0, 0, 0, 0, 0)
    elif http2:
        assert (streamed, writes, starts, ends, native) == (0, 0, 0, 0, 0) and assembled >= 3
    else:
        # 12 token events 1.25 ms apart: the role event's read is held, the first token's
        # starts the stream, the last one's goes to the task, which writes it with the
        # stream's end; on a busy machine reads coalesce events (hence no more than 3 asked)
        assert starts == 1 and ends == 2  # both streams
        assert streamed >= 3 and streamed - 3 <= writes + starts <= streamed
        assert assembled >= 3
        # the compiled step (serving.relay_native, built by the install) takes the token
        # events between the first and the last that came one a read
        assert 1 <= native <= counted["direct_writes"]


# -- another ASGI server's scope: no extensions, the receive() watcher and ASGI send -----


def _asgi_call(rr: Any, body: dict[str, Any], *, disconnect_after: int | None = None) -> list[dict[str, Any]]:
    """Call the app on the router's loop with a plain ASGI scope (no `extensions`, as
    granian gives it); the client disconnects after `disconnect_after` body messages."""
    raw = orjson.dumps(body)

    async def go() -> list[dict[str, Any]]:
        sent: list[dict[str, Any]] = []
        gone = asyncio.Event()
        msgs = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if msgs:
                return msgs.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(m: dict[str, Any]) -> None:
            sent.append(m)
            if disconnect_after is not None and sum(1 for x in sent if x["type"] == "http.response.body") >= disconnect_after:
                gone.set()

        scope = {"type": "http", "http_version": "1.1", "method": "POST", "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
                 "query_string": b"", "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "scheme": "http", "root_path": ""}
        await asyncio.wait_for(rr.app(scope, receive, send), 20)
        return sent

    return asyncio.run_coroutine_threadsafe(go(), rr.loop).result(timeout=30)


def test_a_scope_without_extensions_streams_and_is_cancelled_by_its_disconnect(routed: tuple[str, str]) -> None:
    _, path = routed
    rr = _ROUTERS[path]
    sent = _asgi_call(rr, _chat(True, n=6))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert sent[0]["status"] == 200 and body.endswith(b"data: [DONE]\n\n") and body.count(b"data: ") == 8
    before = rr.books()["terminal"]["cancelled"]
    _asgi_call(rr, _chat(True, n=400), disconnect_after=3)
    rr.balanced()
    assert rr.books()["terminal"]["cancelled"] == before + 1


_SWITCH_SCRIPTS = [  # (client bytes, the server's events): each runs under h11's state and LeanH11State
    ("keep-alive, twice", b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", [h11.Response(status_code=200, headers=[(b"content-length", b"0")]), h11.EndOfMessage()]),
    ("upgrade accepted", b"GET / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
     [h11.InformationalResponse(status_code=101, headers=[(b"upgrade", b"websocket")])]),
    ("upgrade declined", b"GET / HTTP/1.1\r\nhost: x\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
     [h11.Response(status_code=200, headers=[(b"content-length", b"0")]), h11.EndOfMessage()]),
    ("CONNECT accepted", b"CONNECT x:443 HTTP/1.1\r\nhost: x\r\n\r\n", [h11.Response(status_code=200, headers=[])]),
    ("CONNECT refused", b"CONNECT x:443 HTTP/1.1\r\nhost: x\r\n\r\n", [h11.Response(status_code=403, headers=[(b"content-length", b"0")]), h11.EndOfMessage()]),
]


@pytest.mark.parametrize(("name", "request_bytes", "events"), _SWITCH_SCRIPTS, ids=[s[0] for s in _SWITCH_SCRIPTS])
def test_lean_h11_state_moves_as_h11s_own(name: str, request_bytes: bytes, events: list[Any]) -> None:
    """LeanH11State (one shared empty set of switch proposals) against h11's ConnectionState:
    the same states, proposals and bytes at every step, over two request cycles."""

    def run(conn: h11.Connection) -> list[Any]:
        seen: list[Any] = []
        for _ in range(2):
            conn.receive_data(request_bytes)
            ev = conn.next_event()
            while ev is not h11.NEED_DATA and not isinstance(ev, h11.ConnectionClosed) and ev is not h11.PAUSED:
                seen.append((type(ev).__name__, conn.states, set(conn._cstate.pending_switch_proposals)))
                if isinstance(ev, h11.EndOfMessage):
                    break
                ev = conn.next_event()
            for out in events:
                seen.append((conn.send(out), conn.states, set(conn._cstate.pending_switch_proposals)))
            if conn.states != {h11.CLIENT: h11.DONE, h11.SERVER: h11.DONE}:
                break
            conn.start_next_cycle()
        return seen

    adopted = h11.Connection(h11.SERVER)
    hyper.PreparedH11.adopt(adopted)  # as HardenedH11Protocol makes its connection one
    expected = run(h11.Connection(h11.SERVER))
    for lean in (hyper.PreparedH11(h11.SERVER), adopted):
        assert type(lean) is hyper.PreparedH11 and type(lean._cstate) is LeanH11State
        assert run(lean) == expected
        if not lean._cstate.pending_switch_proposals:  # none pending: the shared one, no set of its own
            assert lean._cstate.pending_switch_proposals is _NO_PROPOSALS
