"""narwhal bench paired: a router's events in a window, counted from its own streams."""

from __future__ import annotations

import pytest

from narwhal_bench.paired import in_window
from narwhal_bench.stats import Result


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
