"""serving.relay_path (issue 25): the direct path writes what the ASGI path would, and only
when it would; the relay step is the same on both. The relay's behaviour tests run on both
paths (tests/conftest.py `relay_path`); these test the pieces and that each path is the one
taken."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from narwhal.core import fastevent
from narwhal.core.relay import StreamRelay
from narwhal.http import hyper
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream import http1
from narwhal.upstream.engines import EngineSpec
from narwhal.worker.direct import DirectFeed
from tests.helpers import running_router, sse

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
