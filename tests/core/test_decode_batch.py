"""The batch a measured TPOT is scored at (docs/prediction.md section 8: "r_k = log(TPOT_measured
/ TPOT_profile(B_k))"): the mean decode batch over the span the TPOT was measured, from the
request's first token to its close, not the batch left on the engine at its close. Sans-IO
with a manual clock (the authority's door scoring a close: tests/authority/test_channel.py)."""

from __future__ import annotations

import pytest

from narwhal.core.admission import Scheduler
from narwhal.core.clock import ManualClock
from narwhal.core.fleet import EngineState
from narwhal.core.prediction import Margin
from narwhal.core.tickets import Dispatch, Ticket, Work


def _engine(name: str, role: str) -> EngineState:
    return EngineState(name, f"http://{name}", role=role, dialect="vllm", prefill_slots=8, decode_slots=8)


def _work(clk: ManualClock) -> Work:
    return Work(route="chat", prompt_tokens=100, max_tokens=16, budget_ms=1e9, arrival=clk.now(), max_wait_s=10.0, deadline_s=None)


class _Fleet:
    """One unified engine u0, or P/D p0 -> d0; requests by name."""

    def __init__(self, pd: bool) -> None:
        self.clk = ManualClock()
        self.d = _engine("d0", "decode") if pd else _engine("u0", "unified")
        engines = [_engine("p0", "prefill"), self.d] if pd else [self.d]
        self.s = Scheduler(engines, mode="open", queue_limit=8, margin=Margin(initial=1.0, adaptive=False))
        self.pd = pd
        self.t: dict[str, Ticket] = {}

    def start(self, name: str) -> None:
        """Admitted, placed for decode and its first token, all now."""
        now = self.clk.now()
        g = self.s.admit(_work(self.clk), now)
        assert isinstance(g, Dispatch)
        if self.pd:
            self.s.prefill_done(g.ticket, now, ok=True)
            assert isinstance(self.s.want_decode(g.ticket, now), Dispatch)
        self.s.first_token(g.ticket, now)
        self.t[name] = g.ticket

    def end(self, name: str) -> float:
        """Closed now: the mean batch its TPOT is scored at (as the door reads it)."""
        now = self.clk.now()
        b = self.d.mean_decode_batch(self.t[name].decode_mark, now)
        self.s.finish(self.t[name], now)
        return b


# (steps: "+x" starts x, "-x" ends x, a number advances the clock in seconds; the request
# measured; its mean batch; the batch left at its close, which the old estimate used)
SCENARIOS = [
    ("alone the whole time", ["+a", 1.0, "-a"], "a", 1.0, 1),
    ("three join just before its close", ["+a", 0.95, "+b", "+c", "+d", 0.05, "-a"], "a", 1.15, 4),
    ("three leave half-way", ["+a", "+b", "+c", "+d", 0.5, "-b", "-c", "-d", 0.5, "-a"], "a", 2.5, 1),
    ("streams released together: the last to close", ["+a", "+b", 1.0, "-a", "-b"], "b", 2.0, 1),
    ("one joins and leaves mid-way", ["+a", 1.0, "+b", 1.0, "-b", 1.0, "-a"], "a", 4.0 / 3.0, 1),
    ("it joins a batch of two", ["+a", "+b", 1.0, "+c", 1.0, "-c"], "c", 3.0, 3),
]


@pytest.mark.parametrize("pd", [False, True], ids=["unified", "pd"])
@pytest.mark.parametrize(("steps", "who", "mean", "at_close"), [s[1:] for s in SCENARIOS], ids=[s[0] for s in SCENARIOS])
def test_a_tpot_is_scored_at_the_mean_batch_of_its_decode(pd: bool, steps: list[object], who: str, mean: float, at_close: int) -> None:
    f = _Fleet(pd)
    got: dict[str, float] = {}
    close_batch: dict[str, int] = {}
    for st in steps:
        if isinstance(st, float):
            f.clk.advance(st)
        elif isinstance(st, str) and st[0] == "+":
            f.start(st[1:])
        else:
            assert isinstance(st, str)
            close_batch[st[1:]] = f.d.decode_in_use
            got[st[1:]] = f.end(st[1:])
    assert got[who] == pytest.approx(mean)
    assert close_batch[who] == at_close
    for name in set(f.t) - set(got):
        f.end(name)
    assert f.d.decode_in_use == 0


def test_without_a_mark_of_this_engine_or_any_time_the_batch_now_counts() -> None:
    f = _Fleet(False)
    f.start("a")
    f.start("b")
    e, other = f.d, _engine("u1", "unified")
    assert e.mean_decode_batch(None, f.clk.now() + 1.0) == 2.0  # no first token seen
    mark = f.t["a"].decode_mark
    assert mark is not None and mark[0] is e
    assert e.mean_decode_batch(mark, mark[2]) == 2.0  # no time has passed
    assert e.mean_decode_batch((other, mark[1], mark[2]), mark[2] + 1.0) == 2.0  # another engine's mark
    f.end("a")
    f.end("b")
    assert e.mean_decode_batch(None, f.clk.now()) == 1.0  # never below one


def test_a_clock_reading_from_before_the_last_change_never_runs_the_integral_backwards() -> None:
    e = _engine("u0", "unified")
    e.decode_moved(10.0, 2)
    e.decode_moved(12.0, 1)  # 2 for 2 s
    e.decode_moved(11.5, -1)  # an earlier reading (another process's clock): nothing added
    assert e.decode_area == pytest.approx(4.0) and e.decode_seen_at == 12.0 and e.decode_in_use == 2
    assert e.decode_area_at(13.0) == pytest.approx(6.0)
    assert e.decode_area_at(11.0) == pytest.approx(4.0)
