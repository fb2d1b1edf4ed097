"""The load tool's arithmetic: percentiles, goodput over offered requests, trace scaling."""

from __future__ import annotations

import pytest

from narwhal_bench.harness.load import Arrival, RequestShape, fixed_rate, trace_arrivals
from narwhal_bench.harness.stats import Result, goodput, markdown_table, percentile, summarize


def test_percentile_interpolates_between_closest_ranks() -> None:
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile(list(range(1, 12)), 90) == pytest.approx(10.0)
    assert percentile(list(range(101)), 99) == pytest.approx(99.0)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def _ok(sent: float, ttft: float, tokens: int = 3, tpot: float = 0.01) -> Result:
    r = Result(scheduled=sent, sent=sent, status=200, headers_at=sent, first_token_at=sent + ttft, tokens=tokens)
    r.last_token_at = r.first_token_at + tpot * (tokens - 1)
    r.done_at = r.last_token_at
    return r


def _refused(sent: float, latency: float = 0.001, status: int = 429, code: str = "ttft_budget_exceeded") -> Result:
    return Result(scheduled=sent, sent=sent, status=status, headers_at=sent + latency, done_at=sent + latency, code=code)


def test_summary_counts_refusals_errors_and_goodput_over_offered() -> None:
    rs = [_ok(0, 0.1), _ok(1, 0.2), _ok(2, 3.0), _refused(3), _refused(4, status=503, code="backend_unavailable")]
    err = Result(scheduled=5, sent=5, status=500, done_at=5.1, error="HTTP 500")
    rs.append(err)
    s = summarize(rs, ttft_target_s=1.0)
    assert (s["offered"], s["ok"], s["refused"], s["errors"]) == (6, 3, 2, 1)
    assert s["refusal_rate"] == pytest.approx(2 / 6)
    assert s["refusal_codes"] == {"ttft_budget_exceeded": 1, "backend_unavailable": 1}
    # 2 of 6 OFFERED met TTFT <= 1 s: refusals and errors are misses
    assert s["goodput"] == pytest.approx(2 / 6)
    assert s["ttft"]["p50"] == pytest.approx(0.2)
    assert s["tpot"]["p50"] == pytest.approx(0.01)
    assert s["refusal_latency"]["p99"] == pytest.approx(0.001)
    assert goodput(rs, 1.0, tpot_target_s=0.005) == 0.0


def test_a_refusal_after_the_first_token_is_not_a_refusal() -> None:
    r = _ok(0, 0.1)
    r.status = 429
    assert not r.refused


def test_markdown_table() -> None:
    t = markdown_table(["a", "b"], [[1, None], ["x|y", 0.5]])
    assert t.splitlines() == ["| a | b |", "|---|---|", "| 1 | — |", "| x\\|y | 0.5 |"]


def test_fixed_rate_is_seeded_and_roughly_at_rate() -> None:
    a = fixed_rate(100, 20, seed=3)
    assert a == fixed_rate(100, 20, seed=3)
    assert 1800 < len(a) < 2200
    u = fixed_rate(10, 1, uniform=True)
    assert [round(x.at, 6) for x in u] == [round(i / 10, 6) for i in range(10)]


def test_trace_replay_is_compressed_to_the_target_rate_and_scaled() -> None:
    rows = [(float(i) * 2.0, 1000 + i, 200) for i in range(1000)]  # 0.5 req/s
    arr, speedup = trace_arrivals(rows, duration_s=10, rate=5.0, output_scale=0.1, prompt_scale=0.5, start_s=20)
    assert speedup == pytest.approx(10.0)
    assert len(arr) == 50  # 5 req/s for 10 s
    assert arr[0] == Arrival(0.0, round(1010 * 0.5), 20)
    assert all(0 <= x.at < 10 for x in arr)
    capped, _ = trace_arrivals(rows, duration_s=10, speedup=1.0, max_output=7)
    assert {x.output_tokens for x in capped} == {7}


def test_request_body_carries_the_mock_directive_and_prompt_size() -> None:
    import orjson

    from narwhal.mock.timing import prompt_size

    shape = RequestShape(mock={"tpot_ms": 5})
    body = orjson.loads(shape.body(Arrival(0, 500, 12)))
    assert body["max_tokens"] == 12 and body["stream"] is True
    text = body["messages"][0]["content"]
    assert text.startswith('[[mock {"tokens":12,"tpot_ms":5}]]')
    n, _ = prompt_size("chat", body, 4.0)
    assert abs(n - 500) <= 1
