"""Fair preemption (core/preempt.py, issue 40 item 6), sans-IO: a lighter tenant's request
waiting for a unified engine whose slots are all taken has the heaviest tenant's newest
request there past its first token cut and carried on after it; each fact of the rule is
one row below, the request's way back (`resume`) frees its slot without a failure and
queues it first among its tenant's, and a preempted request never yields its place."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from narwhal.core.admission import Scheduler
from narwhal.core.clock import ManualClock
from narwhal.core.fairness import FairQueue
from narwhal.core.prediction import Margin
from narwhal.core.preempt import Preempt, resume
from narwhal.core.tickets import Dispatch, Enqueued, Ticket
from tests.core.test_admission import engine
from tests.core.test_fair_reserve import admit, ran


def sched(n: int = 2, *, reserve: float = 0.25, preempt: bool = True, tenants: bool = True) -> tuple[Scheduler, ManualClock]:
    e = engine("u0", prefill=n, decode=n)
    s = Scheduler([e], mode="open", queue_limit=64, margin=Margin(initial=1.0, adaptive=False), weights=lambda t: 1.0,
                  fair_reserve=reserve if tenants else None, fair_preempt=preempt)
    return s, ManualClock()


def running(s: Scheduler, clk: ManualClock, tenant: str, *, first_token: bool = True, movable: bool = True) -> Ticket:
    """A request of `tenant` dispatched at once, past its first token and movable as asked
    (the data plane says movable at the first token: door.py LocalLease.first_token)."""
    got = admit(s, clk, tenant)
    assert isinstance(got, Dispatch), got
    t = got.ticket
    if first_token:
        t.movable = movable
        s.first_token(t, clk.now())
    clk.advance(0.001)
    return t


@dataclass
class Case:
    name: str
    preempt: bool = True  # admission.fair_preempt (with migration on)
    reserve: float = 0.25
    tenants: bool = True
    slots: int = 2
    noisy_first_token: bool = True
    noisy_movable: bool = True
    waiter: str = "quiet"
    preempted_before: bool = False
    asked: list[str] = field(default_factory=lambda: ["noisy"])  # whose request is asked to leave, by tenant


CASES = [
    Case("lighter tenant waits, heaviest holds a movable request past its first token: preempted"),
    Case("rule 1: admission.fair_preempt off (or migration off)", preempt=False, asked=[]),
    Case("rule 1: fair_reserve 0", reserve=0.0, asked=[]),
    Case("rule 1: no tenants configured", tenants=False, asked=[]),
    Case("rule 2: a slot is free (three slots)", slots=3, asked=[]),
    Case("rule 3: the waiter is the heaviest tenant itself", waiter="noisy", asked=[]),
    Case("rule 4: the heaviest's request is still in prefill", noisy_first_token=False, asked=[]),
    Case("rule 4: its leg cannot be carried on (not streaming, structured, ...)", noisy_movable=False, asked=[]),
    Case("rule 4: preempted once already", preempted_before=True, asked=[]),
]


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_the_rule_fact_by_fact(c: Case) -> None:
    s, clk = sched(c.slots, reserve=c.reserve, preempt=c.preempt, tenants=c.tenants)
    ran(s, clk, ["noisy", "noisy", "noisy", "quiet"])  # noisy heaviest lately, quiet active
    noisy = running(s, clk, "noisy", first_token=c.noisy_first_token, movable=c.noisy_movable)
    if c.preempted_before:
        noisy.preempted = "elsewhere"
    quiet = running(s, clk, "quiet", first_token=False)
    got = admit(s, clk, c.waiter)
    if c.slots > 2:
        assert isinstance(got, Dispatch)
    else:
        assert isinstance(got, Enqueued), got
    assert [p.ticket.work.tenant for p in s.preempts] == c.asked
    if c.asked:
        assert s.preempts == [Preempt(noisy, "u0")] and noisy.preempted == "u0"
        assert s.fair is not None and s.fair.pending == {"u0": noisy.id}
    for t in (noisy, quiet):
        s.first_token(t, clk.now()) if t.holds_prefill else None
        s.finish(t, clk.now())


def test_a_request_in_prefill_is_asked_at_its_first_token() -> None:
    s, clk = sched()
    ran(s, clk, ["noisy", "noisy", "noisy", "quiet"])
    noisy = running(s, clk, "noisy", first_token=False)
    running(s, clk, "quiet", first_token=False)
    assert isinstance(admit(s, clk, "quiet"), Enqueued) and not s.preempts
    noisy.movable = True
    s.first_token(noisy, clk.now())  # the grant pass it runs finds the waiter
    assert s.preempts == [Preempt(noisy, "u0")]


def test_the_newest_of_the_heaviest_is_asked_and_one_at_a_time() -> None:
    s, clk = sched(3, reserve=0.34)  # k = 1 of 3
    ran(s, clk, ["noisy"] * 6 + ["quiet"])
    n1 = running(s, clk, "noisy")
    n2 = running(s, clk, "noisy")
    running(s, clk, "quiet", first_token=False)
    assert isinstance(admit(s, clk, "quiet"), Enqueued)
    assert s.preempts == [Preempt(n2, "u0")]  # the newest: the least to recompute
    s.preempts.clear()
    assert isinstance(admit(s, clk, "quiet"), Enqueued)
    assert not s.preempts  # n2 still holds its slot: one preemption at a time per engine
    grants, again = resume(s, n2, clk.now())
    assert [g.ticket.work.tenant for g in grants] == ["quiet"]
    assert isinstance(again, Enqueued)
    # n2 left: the next waiter may ask for n1
    assert s.preempts == [Preempt(n1, "u0")]


def test_resume_frees_the_slot_for_the_waiter_without_a_failure_and_queues_it_first() -> None:
    s, clk = sched()
    ran(s, clk, ["noisy", "noisy", "noisy", "quiet"])
    noisy = running(s, clk, "noisy")
    quiet1 = running(s, clk, "quiet", first_token=False)
    waiting_noisy = admit(s, clk, "noisy")
    quiet2 = admit(s, clk, "quiet")
    assert isinstance(waiting_noisy, Enqueued) and isinstance(quiet2, Enqueued)
    assert s.preempts == [Preempt(noisy, "u0")]
    e = s.engines["u0"]
    grants, again = resume(s, noisy, clk.now())
    assert [g.ticket for g in grants] == [quiet2.ticket]  # the lighter tenant takes the slot
    assert isinstance(again, Enqueued) and again.engine == "u0"
    assert "u0" not in noisy.excluded and e.breaker.failures == 0  # not a failure of the engine
    assert list(e.queue) == [noisy, waiting_noisy.ticket]  # first among its tenant's
    assert e.queue.newest("noisy") is waiting_noisy.ticket  # R02/R11 take the newest that may yield
    assert s.fair is not None and "u0" not in s.fair.pending
    for t in (quiet1, quiet2.ticket):
        s.first_token(t, clk.now())
        s.finish(t, clk.now())
    # both quiet requests ended: the carried-on request is first of its tenant again
    assert noisy.holds_decode == "u0" and noisy.state == "unified"
    s.first_token(noisy, clk.now())
    s.finish(noisy, clk.now())
    waiting = waiting_noisy.ticket
    if waiting.holds_prefill:
        s.first_token(waiting, clk.now())
    s.finish(waiting, clk.now())


def test_a_preempted_request_never_yields_its_place() -> None:
    """R02 and R11 with tenants take a tenant's newest queued request: never one whose
    answer has started (a preempted request waiting to be carried on)."""

    class T:
        def __init__(self, tenant: str, preempted: str | None = None) -> None:
            self.work = type("W", (), {"tenant": tenant})()
            self.pred_prefill_ms = 1.0
            self.preempted = preempted

    q = FairQueue()
    p = T("noisy", preempted="u0")
    q.push_front(p)
    assert q.newest("noisy") is None and q.over_share() is None
    n = T("noisy")
    q.append(n)
    q.push_front(T("noisy", preempted="u0"))
    assert q.newest("noisy") is n
    assert q.over_share() == ("noisy", n)
    assert list(q)[-1] is n and len(q) == 3
