"""The per-event and per-request work of the router, one benchmark each (issue #5 item 1):
assembly throughput, token-ID validation, SSE parsing, request validation, the relay step,
and one predictive admission decision with 1,000 queued requests over 64 engines."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from benchmarks.conftest import sse, vllm_chunk
from narwhal.core.admission import Scheduler
from narwhal.core.assembly import Assembler
from narwhal.core.fleet import EngineState
from narwhal.core.prediction import Margin
from narwhal.core.relay import StreamRelay
from narwhal.core.requests import parse_request
from narwhal.core.sse import SSEParser
from narwhal.core.tickets import Dispatch, Enqueued, Refuse, Ticket, Work
from narwhal.core.tokens import check_token_ids

# -- assembly --------------------------------------------------------------------------


def test_assembly_1000_deltas_into_one_response(benchmark: Any, chunks: list[dict[str, Any]]) -> None:
    def assemble() -> dict[str, Any]:
        a = Assembler("chat")
        for c in chunks:
            a.feed(c)
        res = a.finish(prompt_tokens=12, completion_tokens=1001)
        assert isinstance(res, dict)
        return res

    res = benchmark(assemble)
    assert res["choices"][0]["message"]["content"].startswith("tok tok")
    benchmark.extra_info["events_per_round"] = len(chunks)


# -- token IDs -------------------------------------------------------------------------


def test_token_id_check_per_event(benchmark: Any) -> None:
    ev = vllm_chunk(7)
    n, bad = benchmark(check_token_ids, ev)
    assert (n, bad) == (1, None)
    benchmark.extra_info["events_per_round"] = 1


# -- SSE -------------------------------------------------------------------------------


def test_sse_parse_one_event_per_read(benchmark: Any) -> None:
    """The realistic case: each engine event arrives in its own read."""
    raw = sse(vllm_chunk(3))
    p = SSEParser()
    out = benchmark(p.feed, raw)
    assert len(out) == 1
    benchmark.extra_info["events_per_round"] = 1


def test_sse_parse_64_events_in_one_read(benchmark: Any) -> None:
    raw = b"".join(sse(vllm_chunk(i)) for i in range(64))
    p = SSEParser()
    out = benchmark(p.feed, raw)
    assert len(out) == 64
    benchmark.extra_info["events_per_round"] = 64


# -- the relay step (parse + token-ID check + forward), per event ----------------------


def test_relay_step_per_event_streaming_client(benchmark: Any) -> None:
    """One engine event through StreamRelay.feed for a streaming client that did not ask
    for token IDs (the router validates and strips them)."""
    relay = StreamRelay(checks_ids=True, client_ids=False, client_usage=False)
    raw = sse(vllm_chunk(5))
    step = benchmark(relay.feed, raw, 0.0)
    assert step.failure is None and step.out.startswith(b"data: ")
    benchmark.extra_info["events_per_round"] = 1


def test_relay_step_per_event_ids_kept(benchmark: Any) -> None:
    """The same when the client asked for return_token_ids: the payload goes out unchanged."""
    relay = StreamRelay(checks_ids=True, client_ids=True, client_usage=True)
    raw = sse(vllm_chunk(5))
    step = benchmark(relay.feed, raw, 0.0)
    assert step.out == raw
    benchmark.extra_info["events_per_round"] = 1


# -- request validation ----------------------------------------------------------------


_BODY = orjson.dumps({
    "model": "narwhal-demo",
    "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Summarise the following text. " * 40}],
    "max_tokens": 256, "temperature": 0.7, "top_p": 0.95, "stream": True, "stream_options": {"include_usage": True},
})


def test_request_validation_per_request(benchmark: Any) -> None:
    req = benchmark(parse_request, "chat", _BODY, model="narwhal-demo")
    assert req.stream and req.max_tokens == 256
    benchmark.extra_info["requests_per_round"] = 1


_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept: */*\r\nAccept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\nUser-Agent: python-httpx/0.28.1\r\nContent-Type: application/json\r\nContent-Length: 512\r\n\r\n"
)


@pytest.mark.parametrize("way", ["h11", "general", "short-python", "short-compiled"])
def test_request_head_read_per_request(benchmark: Any, way: str) -> None:
    """A common request head read: by h11 (the oracle, through its public Connection), by
    Narwhal's general reader (h1/parse.py read_head), and the short way (h1/head.py: its
    scan in Python, and in C, _fasthead.head)."""
    import h11

    from narwhal.http import _fasthead
    from narwhal.http.h1.head import HEAD_MAX, request_of, scan
    from narwhal.http.h1.parse import Buffer, read_head

    def h11_way() -> Any:
        conn = h11.Connection(h11.SERVER)
        conn.receive_data(_HEAD)
        return conn.next_event()

    def general() -> Any:
        buf = Buffer()
        buf.add(_HEAD)
        return read_head(buf)

    def short(s: Any) -> Any:
        return request_of(s(_HEAD, HEAD_MAX))[0]  # type: ignore[index]

    if way == "h11":
        req = benchmark(h11_way)
    elif way == "general":
        req = benchmark(general)
    else:
        req = benchmark(short, scan if way == "short-python" else _fasthead.head)
    assert req.method == b"POST" and len(req.headers) == 7
    benchmark.extra_info["requests_per_round"] = 1


# -- admission -------------------------------------------------------------------------


def _fleet(engines: int = 64, queued: int = 1000) -> Scheduler:
    es = []
    for i in range(engines):
        e = EngineState(f"u{i}", f"http://u{i}", role="unified", dialect="vllm", prefill_slots=4, decode_slots=64)
        e.prefill.lin.theta = [20.0, 30.0 + i % 7, 2.0]  # ms, per 1k tokens, per 1k^2 (scaled features)
        es.append(e)
    s = Scheduler(es, mode="predictive", queue_limit=100_000, margin=Margin(initial=1.2, adaptive=True))
    k = 0
    while s.queued < queued:  # fill every slot, then queues, spread by the scheduler itself
        w = Work(route="chat", prompt_tokens=200 + (k * 37) % 1800, max_tokens=128, budget_ms=1e9, arrival=0.0, max_wait_s=1e9, deadline_s=None)
        r = s.admit(w, 0.0)
        assert isinstance(r, (Dispatch, Enqueued))
        k += 1
    return s


def _admit_and_undo(benchmark: Any, s: Scheduler) -> Dispatch | Enqueued | Refuse:
    """Benchmark one admission of a 1,024-token prompt; each round's setup finishes the
    previous round's ticket, so every round sees the same queue."""
    work = Work(route="chat", prompt_tokens=1024, max_tokens=128, budget_ms=1e9, arrival=0.0, max_wait_s=1e9, deadline_s=None)
    last: list[Ticket] = []

    def setup() -> tuple[tuple[Work, float], dict[str, Any]]:
        while last:
            s.finish(last.pop(), 0.0)
        return (work, 0.0), {}

    def admit(w: Work, now: float) -> Dispatch | Enqueued | Refuse:
        r = s.admit(w, now)
        if isinstance(r, (Dispatch, Enqueued)):
            last.append(r.ticket)
        return r

    return benchmark.pedantic(admit, setup=setup, rounds=3000, iterations=1, warmup_rounds=50)


def test_admission_decision_predictive_1000_queued_64_engines(benchmark: Any) -> None:
    """Scheduler.admit in predictive mode with 1,000 tickets queued over 64 engines (all
    their slots busy): an admitted request is enqueued; the next setup removes it again so
    every round sees the same 1,000 queued."""
    s = _fleet()
    assert s.queued == 1000 and sum(len(e.queue) for e in s.engines.values()) == 1000
    r = _admit_and_undo(benchmark, s)
    assert isinstance(r, Enqueued)
    benchmark.extra_info.update(queued=1000, engines=64, decisions_per_round=1)


def test_admission_refusal_R10_1000_queued_64_engines(benchmark: Any) -> None:
    """The same decision when it refuses (projected TTFT over budget): nothing to undo."""
    s = _fleet()
    work = Work(route="chat", prompt_tokens=1024, max_tokens=128, budget_ms=200.0, arrival=0.0, max_wait_s=10.0, deadline_s=None)
    r = benchmark(s.admit, work, 0.0)
    assert isinstance(r, Refuse) and r.row.id == "R10"
    benchmark.extra_info.update(queued=1000, engines=64, decisions_per_round=1)


@pytest.mark.parametrize("engines", [2, 16])
def test_admission_decision_predictive_1000_queued_by_engine_count(benchmark: Any, engines: int) -> None:
    """The same decision over fewer engines: its cost grows with the engines, not the queue."""
    s = _fleet(engines=engines)
    _admit_and_undo(benchmark, s)
    benchmark.extra_info.update(queued=1000, engines=engines, decisions_per_round=1)


# -- the direct path (serving.relay_path direct, issue 25) -------------------------------


@pytest.mark.parametrize("native", [False, True], ids=["python", "compiled"])
def test_direct_path_per_event_engine_read_to_client_write(benchmark: Any, native: bool) -> None:
    """All of Narwhal's work per relayed event on the direct path, without the sockets:
    the engine connection's data_received (HTTP/1.1 chunked framing) -> DirectFeed.take
    (the relay step: SSE split, orjson parse, T02-T04, T10 strip, re-serialise) ->
    H1Direct.write (the HTTP/1.1 chunk framing) onto a transport that keeps nothing; compiled:
    the same read taken whole by serving.relay_native's step (DirectFeed.whole,
    core/fastevent.py) -> H1Direct.write_chunk. What is left of a relayed event's CPU is
    the event loop and the kernel (two syscalls and a wake-up)."""
    from narwhal.core import fastevent

    if native and fastevent.event is None:
        pytest.skip("the compiled step was not built (no C compiler at install)")
    import asyncio
    from types import SimpleNamespace

    from narwhal.http import h1
    from narwhal.http.h1.cycle import RESPONSE, H1Direct
    from narwhal.http.lean import LeanLock
    from narwhal.upstream.http1 import _Conn, _Wheel
    from narwhal.worker.direct import DirectFeed

    class _Sink:
        def write(self, data: bytes) -> None:
            pass

        def is_closing(self) -> bool:
            return False

        def get_write_buffer_size(self) -> int:
            return 0

    loop = asyncio.new_event_loop()
    try:
        conn = h1.Connection()
        conn.receive_data(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
        conn.next_event(), conn.next_event()
        conn.send(h1.Response(200, []))
        cfg = SimpleNamespace(keep_alive_max_requests=1 << 40, log=SimpleNamespace(access_logger=None))
        proto = SimpleNamespace(h1=conn, lean=SimpleNamespace(transport=_Sink(), send_lock=LeanLock()), config=cfg, requests=1)
        direct = H1Direct(SimpleNamespace(state=RESPONSE, closed=False), proto)  # type: ignore[arg-type]
        relay = StreamRelay(checks_ids=True, client_ids=False, client_usage=False)
        sink = SimpleNamespace(headers_sent=True, write_now=direct.write, start_now=None, chunk_writer=direct)  # the head is out
        feed = DirectFeed(relay, loop.time, sink, [], lambda now: None, native=native)  # type: ignore[arg-type]
        up = _Conn(("127.0.0.1", 1), loop, 30.0, _Wheel(loop, 30.0 / 16))
        up._state, up._chunked, up._remaining = "body", True, 0
        up._direct = feed
        up._whole = feed.native
        assert feed.native is native
        first = sse(vllm_chunk(0))
        up.data_received(b"%x\r\n%b\r\n" % (len(first), first))  # the first token, its books kept here
        assert feed.pending is None
        ev = sse(vllm_chunk(7))
        chunk = b"%x\r\n%b\r\n" % (len(ev), ev)
        benchmark(up.data_received, chunk)
        assert up._direct is not None and feed.pending is None and relay.token_count > 1
        benchmark.extra_info["events_per_round"] = 1
    finally:
        loop.close()
