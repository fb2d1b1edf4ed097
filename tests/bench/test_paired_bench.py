"""narwhal bench paired: a router's events in a window, counted from its own streams."""

from __future__ import annotations

import pytest

from narwhal_bench.harness.stats import Result
from narwhal_bench.paired import in_window, ttft_report, ttft_round


def _stream(first: float, last: float, tokens: int) -> Result:
    return Result(scheduled=0.0, first_token_at=first, last_token_at=last, tokens=tokens)


@pytest.mark.parametrize(
    ("streams", "window", "want"),
    [
        ([_stream(0.0, 10.0, 100)], (0.0, 10.0), 100.0),  # the whole stream inside
        ([_stream(0.0, 10.0, 100)], (5.0, 15.0), 50.0),  # its second half
        ([_stream(0.0, 10.0, 100)], (10.0, 20.0), 0.0),  # after it
        ([_stream(2.0, 4.0, 10), _stream(3.0, 5.0, 10)], (0.0, 4.0), 15.0),  # one whole, one half
        ([_stream(1.0, 1.0, 3)], (0.0, 2.0), 3.0),  # one event: in or out
        ([_stream(1.0, 1.0, 3)], (1.5, 2.0), 0.0),
        ([Result(scheduled=0.0)], (0.0, 9.0), 0.0),  # no token
    ],
)
def test_events_in_a_window(streams: list[Result], window: tuple[float, float], want: float) -> None:
    assert in_window(streams, *window) == pytest.approx(want)


def _answered(ttft_ms: list[float]) -> list[Result]:
    """Completed requests sent at 0 whose first token came ttft_ms later."""
    return [Result(scheduled=0.0, sent=0.0, status=200, first_token_at=t / 1e3, last_token_at=t / 1e3, done_at=t / 1e3 + 0.01, tokens=1) for t in ttft_ms]


def test_a_ttft_round_is_routed_minus_direct_per_tree() -> None:
    """--part ttft: each tree's added first-token time is its own arm's percentile minus the
    direct arm's of the same round; CPU per request over its completed requests; B - A in µs."""
    direct = _answered([1.0] * 100)
    a = _answered([1.3] * 100)
    b = _answered([1.25] * 99) + [Result(scheduled=0.0, sent=0.0, status=500, error="bad status")]
    row = ttft_round(direct, [a, b], [0.1, 0.099])
    assert row["added_p50_ms"] == pytest.approx([0.3, 0.25])
    assert row["added_p99_ms"] == pytest.approx([0.3, 0.25])
    assert row["cpu_us_per_request"] == pytest.approx([1000.0, 1000.0])  # b: 99 completed
    assert (row["ok"], row["offered"]) == ([100, 99], [100, 100])
    assert row["b_minus_a_us"] == pytest.approx(-50.0)
    lines = ttft_report([row, {**row, "b_minus_a_us": 10.0}])
    assert lines[2].startswith("| 1 | 100/100 | 0.300 / 0.300 | 1000 | 99/100 | 0.250 / 0.250 | 1000 | **-50** |")
    assert lines[-1] == "B − A added p50 per round: median **-20 µs** (rounds -50, +10)"
