"""The picker's decisions, sans-IO (narwhal/gateway/decide.py): the rows a request through
the gateway meets are rendered exactly as the HTTP path renders them, the grant's body is
the direct path's engine body, and the response is read by the direct path's relay step."""

from __future__ import annotations

import orjson
import pytest

from narwhal.core.admission import Scheduler
from narwhal.core.clock import ManualClock
from narwhal.core.dialects import decode_body
from narwhal.core.fleet import EngineState
from narwhal.core.prediction import Margin
from narwhal.core.refusals import render
from narwhal.core.reroute import fallbacks, moved
from narwhal.core.tickets import Dispatch, Enqueued, Refuse, Work
from narwhal.gateway.decide import (
    DESTINATION,
    BodyReader,
    Head,
    Piece,
    ResponseReader,
    TooLarge,
    endpoint_of,
    grant,
    refusal,
    route_of,
    subset_of,
)
from narwhal_generated import errors as E


@pytest.mark.parametrize(("path", "route"), [
    (b"/v1/chat/completions", "chat"),
    (b"/v1/completions", "completion"),
    (b"/v1/chat/completions?x=1", "chat"),
    (b"/v1/models", None),
    (b"/v1/chat/completions/", None),
])
def test_route_of(path: bytes, route: str | None) -> None:
    assert route_of(Head(((":path", path),))) == route


@pytest.mark.parametrize(("row", "fields", "retry_after"), [
    (E.R01, {"reason": "standby"}, b"1"),
    (E.R02, {"limit": 4}, b"1"),
    (E.R03, {"limit": 10}, None),
    (E.R05, {"model": "nope", "configured": "narwhal-demo"}, None),
    (E.R11, {"limit": 0}, b"1"),
])
def test_a_refusal_is_the_http_paths_answer_plus_the_request_id(row: E.ErrorRow, fields: dict[str, object], retry_after: bytes | None) -> None:
    im = refusal(row, "rid-1", **fields)
    status, headers, body = render(row, **fields)
    assert (im.status, im.body) == (status, body)
    assert im.headers == (*headers, (b"x-request-id", b"rid-1"))
    assert dict(im.headers).get(b"retry-after") == retry_after
    assert set(orjson.loads(im.body)["error"]) == {"message", "type", "param", "code"}
    assert (im.row, im.cls) == (row.id, row.counter)


@pytest.mark.parametrize(("chunks", "limit", "content_length", "kept"), [
    ([(b"ab", False), (b"cd", True)], 10, None, b"abcd"),
    ([(b"abcd", True)], 4, b"4", b"abcd"),
    ([(b"abc", False), (b"de", True)], 4, None, None),  # R03 at the first chunk past the limit
    ([], 4, b"5", None),  # R03 from Content-Length, before any chunk
])
def test_body_reader_R03(chunks: list[tuple[bytes, bool]], limit: int, content_length: bytes | None, kept: bytes | None) -> None:
    head = Head(((":path", b"/v1/completions"),) + ((("content-length", content_length),) if content_length else ()))
    try:
        r = BodyReader(limit, head)
        for c, end in chunks:
            r.feed(c, end)
    except TooLarge:
        assert kept is None
        return
    assert kept is not None and r.done and r.body == kept


@pytest.mark.parametrize(("url", "endpoint"), [
    ("http://10.0.0.7:8000", "10.0.0.7:8000"),
    ("http://10.0.0.7:8000/", "10.0.0.7:8000"),
    ("http://10.0.0.7", "10.0.0.7:80"),
    ("https://10.0.0.7", "10.0.0.7:443"),
    ("http://[fd00::1]:9000", "[fd00::1]:9000"),
])
def test_endpoint_of(url: str, endpoint: str) -> None:
    assert endpoint_of(url) == endpoint


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
def test_T01_T08_the_grant_forwards_the_direct_paths_engine_body(dialect: str) -> None:
    client = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}
    r = grant(("10.0.0.7:8000",), client, dialect=dialect, model="served", rid="rid-1")
    assert orjson.loads(r.body) == decode_body(client, dialect=dialect, model="served")
    h = dict(r.set_headers)
    assert h[DESTINATION] == b"10.0.0.7:8000"
    assert h["content-length"] == b"%d" % len(r.body)
    assert r.endpoint == "10.0.0.7:8000"


def test_a_grant_with_fallbacks_names_them_in_order_after_the_engine() -> None:
    r = grant(("10.0.0.7:8000", "10.0.0.9:8000", "10.0.0.8:8000"), {"model": "m", "prompt": "x"}, dialect="vllm", model=None, rid="r")
    assert dict(r.set_headers)[DESTINATION] == b"10.0.0.7:8000,10.0.0.9:8000,10.0.0.8:8000"
    assert r.endpoint == "10.0.0.7:8000,10.0.0.9:8000,10.0.0.8:8000"  # envoy.lb's value: the same


def _events(*objs: dict[str, object]) -> bytes:
    return b"".join(b"data: " + orjson.dumps(o) + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


_CHUNKS = (
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
    {"choices": [{"index": 0, "delta": {"content": "Hi"}, "token_ids": [7]}]},
    {"choices": [{"index": 0, "delta": {"content": " there"}, "token_ids": [8], "finish_reason": "stop"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
)


def _reader(stream: bool, client_ids: bool = False, client_usage: bool = False) -> ResponseReader:
    return ResponseReader(route="chat", stream=stream, client_ids=client_ids, client_usage=client_usage, dialect="vllm", prompt_tokens=3,
                          exact_prompt=False, max_event_bytes=1 << 20, max_answer_bytes=1 << 20, hosts=(), rid="rid-1", engine="u0")


@pytest.mark.parametrize(("client_ids", "client_usage"), [(False, False), (True, False), (False, True), (True, True)])
def test_T10_streamed_ids_and_usage_reach_the_client_only_when_asked(client_ids: bool, client_usage: bool) -> None:
    r = _reader(True, client_ids, client_usage)
    assert r.headers(Head(((":status", b"200"),))).remove_headers == ()
    piece, first = r.chunk(_events(*_CHUNKS), False, 1.0)
    assert first and not piece.end
    last, _ = r.chunk(b"", True, 1.1)
    assert last.end and last.body == b""
    out = piece.body
    assert (b"token_ids" in out) == client_ids
    assert (b'"usage"' in out) == client_usage
    assert out.endswith(b"data: [DONE]\n\n")
    assert r.ended is not None and r.ended.cls == "completed"
    assert r.relay.token_count == 2 and r.relay.finish_reason == "stop"


def test_a_non_streaming_client_gets_the_assembled_answer_at_the_end() -> None:
    r = _reader(False)
    m = r.headers(Head(((":status", b"200"), ("content-length", b"99"))))
    assert dict(m.set_headers)["content-type"] == b"application/json" and m.remove_headers == ("content-length",)
    raw = _events(*_CHUNKS)
    a, _ = r.chunk(raw[:40], False, 1.0)
    b, _ = r.chunk(raw[40:], False, 1.1)
    c, _ = r.chunk(b"", True, 1.2)
    assert a.body == b"" and not b.end and c.end
    answer = orjson.loads(b.body + c.body)
    assert answer["choices"][0]["message"]["content"] == "Hi there"
    assert "token_ids" not in answer["choices"][0]
    assert answer["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [True, False])
def test_T03_a_bad_token_id_fails_the_answer_E03_and_the_rest_is_answered_empty(stream: bool) -> None:
    r = _reader(stream)
    r.headers(Head(((":status", b"200"),)))
    bad = {"choices": [{"index": 0, "delta": {"content": "x"}, "token_ids": [True]}]}
    piece, _ = r.chunk(_events(_CHUNKS[0], bad), False, 1.0)
    assert r.ended is not None and (r.ended.cls, r.ended.row) == ("failed", "E03")
    if stream:
        assert piece.body.endswith(b"data: [DONE]\n\n") and b'"code":"' + E.E03.code.encode() + b'"' in piece.body
    else:
        assert orjson.loads(piece.body)["error"]["code"] == E.E03.code
    rest, _ = r.chunk(b"data: {}\n\n", True, 1.1)
    assert rest.body == b"" and rest.end


@pytest.mark.parametrize(("status", "row"), [(500, E.E04), (503, E.E04), (400, E.E05), (404, E.E05)])
def test_E04_E05_an_engine_error_answer_is_the_rows_envelope_in_its_words(status: int, row: E.ErrorRow) -> None:
    r = _reader(True)
    m = r.headers(Head(((":status", b"%d" % status), ("content-length", b"60"))))
    assert dict(m.set_headers)[":status"] == b"%d" % row.status and m.remove_headers == ("content-length",)
    raw = b'{"error": {"message": "no room at http://10.1.2.3:8000/v1", "param": "max_tokens"}}'
    a, _ = r.chunk(raw[:20], False, 1.0)
    b, _ = r.chunk(raw[20:], True, 1.1)
    assert a == Piece(b"", False) and b.end
    err = orjson.loads(b.body)["error"]
    assert err["code"] == row.code and err["param"] == ("max_tokens" if row.param == "from_check" else row.param)  # E05 passes a field path on
    assert "10.1.2.3" not in err["message"] and "<address>" in err["message"] and "engine u0" in err["message"]
    assert r.ended is not None and (r.ended.cls, r.ended.row) == ("failed", row.id)


def test_a_stream_cut_before_done_fails_E02() -> None:
    r = _reader(True)
    r.headers(Head(((":status", b"200"),)))
    r.chunk(b"data: " + orjson.dumps(_CHUNKS[1]) + b"\n\n", False, 1.0)
    piece, _ = r.chunk(b"", True, 1.1)
    assert r.ended is not None and r.ended.row == "E02" and piece.end and piece.body.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(("value", "subset"), [
    (None, None),
    ("10.0.0.7:8000", frozenset({"10.0.0.7:8000"})),
    ("10.0.0.7:8000, 10.0.0.8:8000", frozenset({"10.0.0.7:8000", "10.0.0.8:8000"})),
    (["10.0.0.7:8000", " "], frozenset({"10.0.0.7:8000"})),
    ("", frozenset()),
])
def test_subset_of(value: str | list[str] | None, subset: frozenset[str] | None) -> None:
    assert subset_of(value) == subset


# -- the scheduler's side of a gateway request (core/reroute.py, Work.only) -------------------


def _engine(name: str, b0: float, *, slots: int = 2, healthy: bool = True) -> EngineState:
    e = EngineState(name, f"http://{name}", role="unified", dialect="vllm", prefill_slots=slots, decode_slots=slots)
    e.prefill.lin.theta = [b0, 1000.0, 0.0]  # b0 ms + 1 ms a token
    e.start_model.theta = [5.0, 0.0]
    e.healthy = healthy
    return e


def _work(clk: ManualClock, only: frozenset[str] | None = None) -> Work:
    return Work(route="chat", prompt_tokens=100, max_tokens=16, budget_ms=60000.0, arrival=clk.now(), max_wait_s=10.0, deadline_s=None, only=only)


def _sched(*es: EngineState) -> Scheduler:
    return Scheduler(es, mode="predictive", queue_limit=8, margin=Margin(initial=1.0, adaptive=False))


@pytest.mark.parametrize(("only", "placed"), [
    (None, "fast"),  # the best projection of the fleet
    (frozenset({"slow"}), "slow"),  # the subset's engine, though another is better: never refused while it has room
    (frozenset({"slow", "fast"}), "fast"),
    (frozenset({"down"}), None),  # none of the subset eligible: R09
    (frozenset(), None),
])
def test_subset_hint_restricts_placement_to_its_engines(only: frozenset[str] | None, placed: str | None) -> None:
    clk = ManualClock()
    s = _sched(_engine("slow", 400.0), _engine("fast", 10.0), _engine("down", 1.0, healthy=False))
    got = s.admit(_work(clk, only), clk.now())
    if placed is None:
        assert isinstance(got, Refuse) and got.row is E.R09
    else:
        assert isinstance(got, Dispatch) and got.engine == placed


def test_subset_hint_waits_on_its_own_engine_rather_than_refuse_or_leave_it() -> None:
    clk = ManualClock()
    s = _sched(_engine("a", 10.0, slots=1), _engine("b", 10.0, slots=1))
    assert isinstance(s.admit(_work(clk, frozenset({"a"})), clk.now()), Dispatch)
    got = s.admit(_work(clk, frozenset({"a"})), clk.now())  # a is full, b free: queued on a, never placed on b
    assert isinstance(got, Enqueued) and got.engine == "a"


def test_fallbacks_are_free_eligible_engines_of_the_subset_best_first() -> None:
    clk = ManualClock()
    es = {n: _engine(n, b0) for n, b0 in (("a", 10.0), ("b", 300.0), ("c", 100.0), ("full", 1.0), ("down", 1.0))}
    es["full"].prefill_slots = es["full"].decode_slots = 1
    es["down"].healthy = False
    other = _engine("other", 500.0)
    other.dialect = "sglang"  # the forwarded body is built for a's dialect: never a fallback
    s = _sched(*es.values(), other)
    s.reserve("full", _work(clk), clk.now())  # fills `full`
    d = s.admit(_work(clk), clk.now())
    assert isinstance(d, Dispatch) and d.engine == "a"
    assert fallbacks(s, d.ticket, 8) == ("c", "b")  # least projected prefill first; full, unhealthy, another dialect left out
    assert fallbacks(s, d.ticket, 1) == ("c",)
    assert fallbacks(s, d.ticket, 0) == ()
    sub = s.admit(_work(clk, frozenset({"a", "b"})), clk.now())
    assert isinstance(sub, Dispatch) and fallbacks(s, sub.ticket, 8) == ("b",)  # within the subset only


def test_served_elsewhere_moves_the_slot_and_the_books_balance() -> None:
    clk = ManualClock()
    a, b = _engine("a", 10.0), _engine("b", 20.0)
    s = _sched(a, b)
    d = s.admit(_work(clk), clk.now())
    assert isinstance(d, Dispatch) and d.engine == "a" and (a.prefill_in_use, b.prefill_in_use) == (1, 0)
    moved(s, d.ticket, "b", clk.now())
    assert (a.prefill_in_use, a.decode_in_use, b.prefill_in_use, b.decode_in_use) == (0, 0, 1, 1)
    assert d.ticket.engine == "b" and "a" in d.ticket.excluded and fallbacks(s, d.ticket, 8) == ()
    s.first_token(d.ticket, clk.now())
    s.finish(d.ticket, clk.now())
    assert (a.prefill_in_use, a.decode_in_use, b.prefill_in_use, b.decode_in_use) == (0, 0, 0, 0)
