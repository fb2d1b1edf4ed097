"""The fair reserve of engine slots (core/fairness.py FairReserve; rows R02/R11 fairness,
issue 40 item 6), sans-IO: with tenants configured, the tenant holding the most phase-1
slots per weight on an engine may not take its last k free ones; the counts behind it
follow every path a slot is taken and given back; with no tenants nothing changes."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.admission import Scheduler
from narwhal.core.clock import ManualClock
from narwhal.core.fairness import RECENT_S, FairQueue, FairReserve
from narwhal.core.fleet import EngineState
from narwhal.core.prediction import Margin
from narwhal.core.tickets import Dispatch, Enqueued, Ticket, Work
from tests.core.conftest import held_agrees_with_slots
from tests.core.test_admission import engine, work

# -- helpers -----------------------------------------------------------------------------------


def sched(*engines: EngineState, reserve: float | None = 0.25, weights: dict[str, float] | None = None) -> Scheduler:
    w = weights or {}
    return Scheduler(engines, mode="open", queue_limit=64, margin=Margin(initial=1.0, adaptive=False),
                     weights=lambda t: w.get(t or "", 1.0), fair_reserve=reserve)


def of(clk: ManualClock, tenant: str | None) -> Work:
    w = work(clk, budget=1e9)
    return Work(route=w.route, prompt_tokens=w.prompt_tokens, max_tokens=w.max_tokens, budget_ms=w.budget_ms, arrival=w.arrival,
                max_wait_s=w.max_wait_s, deadline_s=w.deadline_s, tenant=tenant)


def slots(n: int, name: str = "u0") -> EngineState:
    """A unified engine of n phase-1 slots (engines[].max_concurrency n caps both phases)."""
    return engine(name, prefill=n, decode=n)


def admit(s: Scheduler, clk: ManualClock, tenant: str | None) -> Dispatch | Enqueued:
    got = s.admit(of(clk, tenant), clk.now())
    assert isinstance(got, Dispatch | Enqueued), got
    return got


def end(s: Scheduler, t: Ticket, clk: ManualClock) -> list[Dispatch]:
    if t.holds_prefill is not None:
        s.first_token(t, clk.now())
    return s.finish(t, clk.now())


# -- k ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("n", "fraction", "k"), [
    (1, 0.25, 0),  # one slot: nothing to keep
    (2, 0.25, 1), (3, 0.25, 1), (4, 0.25, 1), (7, 0.25, 1), (8, 0.25, 2), (16, 0.25, 4),
    (8, 0.5, 4), (2, 0.5, 1), (16, 0.1, 1),  # at least one
    (8, 0.0, 0), (2, 0.0, 0),  # the knob at 0: none kept
])
def test_k_is_max_1_floor_slots_times_the_fraction(n: int, fraction: float, k: int) -> None:
    assert FairReserve(lambda t: 1.0, fraction).reserved(n) == k


# -- who may take a reserved slot ------------------------------------------------------------------


def ran(s: Scheduler, clk: ManualClock, tenants: list[str]) -> None:
    """Requests of `tenants` admitted, run and ended (each marks its tenant active, and used)."""
    for u in tenants:
        end(s, admit(s, clk, u).ticket, clk)


@pytest.mark.parametrize(("n", "before", "running", "external", "weights", "asks", "may"), [
    # one noisy request runs on two slots, quiet active lately: the last slot is kept for quiet
    (2, ["quiet"], ["noisy"], 0, {}, "noisy", False),
    (2, ["quiet"], ["noisy"], 0, {}, "quiet", True),
    (2, ["quiet"], ["noisy"], 0, {}, None, True),  # a tenant holding no slot may
    # a tenant alone (nobody else active): work-conserving
    (2, [], ["noisy"], 0, {}, "noisy", True),
    # free slots above k: anyone
    (4, ["quiet"], ["noisy"], 0, {}, "noisy", True),
    (4, ["quiet"], ["noisy", "noisy"], 0, {}, "noisy", True),
    # the last one of four: the heavier lately may not, the lighter may
    (4, [], ["noisy", "noisy", "quiet"], 0, {}, "noisy", False),
    (4, [], ["noisy", "noisy", "quiet"], 0, {}, "quiet", True),
    # heaviest by use lately, not by slots held now: quiet's two requests overlap, noisy used more
    (2, ["noisy", "noisy", "noisy"], ["quiet"], 0, {}, "quiet", True),
    (4, ["noisy", "noisy", "noisy"], ["quiet", "quiet", "noisy"], 0, {}, "quiet", True),
    (4, ["noisy", "noisy", "noisy"], ["quiet", "quiet", "noisy"], 0, {}, "noisy", False),
    # ties count as heaviest: neither of two equal tenants takes the last
    (4, [], ["noisy", "quiet"], 1, {}, "noisy", False),
    (4, [], ["noisy", "quiet"], 1, {}, "quiet", False),
    # per weight: noisy of weight 3 with two dispatches is lighter than quiet with one
    (4, [], ["noisy", "noisy", "quiet"], 0, {"noisy": 3.0}, "noisy", True),
    (4, [], ["noisy", "noisy", "quiet"], 0, {"noisy": 3.0}, "quiet", False),
    # a slot held by requests this router did not place (external): a tenant holding none may
    (2, ["quiet"], [], 1, {}, "noisy", True),
])
def test_who_may_take_the_last_free_slots(n: int, before: list[str], running: list[str], external: int, weights: dict[str, float], asks: str | None,
                                          may: bool) -> None:
    clk = ManualClock()
    e = slots(n)
    s = sched(e, weights=weights)
    ran(s, clk, before)
    for tenant in running:
        assert isinstance(admit(s, clk, tenant), Dispatch)
    e.external = external
    assert e.phase1_free()
    assert s.may_take(e, asks, clk.now()) is may
    got = admit(s, clk, asks)
    assert isinstance(got, Dispatch if may else Enqueued)


def test_a_tenant_idle_longer_than_recent_s_is_not_waited_for() -> None:
    clk = ManualClock()
    e = slots(2)
    s = sched(e)
    ran(s, clk, ["quiet"])
    assert isinstance(admit(s, clk, "noisy"), Dispatch)
    assert not s.may_take(e, "noisy", clk.now())
    clk.advance(RECENT_S + 0.1)
    assert s.may_take(e, "noisy", clk.now())
    assert isinstance(admit(s, clk, "noisy"), Dispatch)


# -- the case in miniature -----------------------------------------------------------------


@pytest.mark.parametrize(("reserve", "noisy_second", "quiet"), [
    (0.25, Enqueued, Dispatch),  # the reserve: quiet is not behind a whole noisy request
    (0.0, Dispatch, Enqueued),  # the knob at 0: work-conserving, as before
    (None, Dispatch, Enqueued),  # no tenants configured: nothing counted, nothing kept
])
def test_two_slots_a_noisy_backlog_and_a_quiet_arrival(reserve: float | None, noisy_second: type, quiet: type) -> None:
    clk = ManualClock()
    e = slots(2)
    s = sched(e, reserve=reserve if reserve is not None else 0.0)
    if reserve is None:
        s.fair = None  # the scheduler the router builds without tenants (the test fixture counts by default)
    ran(s, clk, ["quiet"])  # the quiet tenant has been here lately
    clk.advance(1.0)
    assert isinstance(admit(s, clk, "noisy"), Dispatch)
    assert isinstance(admit(s, clk, "noisy"), noisy_second)
    for _ in range(3):
        assert isinstance(admit(s, clk, "noisy"), Enqueued)
    q = admit(s, clk, "quiet")
    assert isinstance(q, quiet)  # first in the fair queue either way, but with the reserve on a slot at once


def test_a_reserved_slot_waits_idle_for_the_lighter_tenant_then_goes_to_the_queue() -> None:
    clk = ManualClock()
    e = slots(2)
    s = sched(e)
    ran(s, clk, ["noisy", "noisy", "quiet"])
    a = admit(s, clk, "noisy")
    b = admit(s, clk, "noisy")
    assert isinstance(a, Dispatch) and isinstance(b, Enqueued)
    q = admit(s, clk, "quiet")
    assert isinstance(q, Dispatch)
    # quiet's request ends: its slot is the last free one, noisy is the heavier: it stays free
    assert end(s, q.ticket, clk) == []
    assert len(e.queue) == 1 and e.phase1_free()
    # noisy's running request ends: noisy holds none, its queued request takes a slot
    grants = end(s, a.ticket, clk)
    assert [g.ticket for g in grants] == [b.ticket]
    assert s.fair is not None and s.fair.held("u0") == {"noisy": 1}


def test_the_grant_pass_serves_the_eligible_tenant_first_and_the_passed_over_keeps_its_turn() -> None:
    clk = ManualClock()
    e = slots(4)
    s = sched(e)
    run = [admit(s, clk, "noisy") for _ in range(3)]  # noisy 3 of 4, nobody else yet: it may
    q0 = admit(s, clk, "quiet")
    assert all(isinstance(r, Dispatch) for r in run) and isinstance(q0, Dispatch)
    n1 = admit(s, clk, "noisy")  # queued first: the smaller start tag
    q1 = admit(s, clk, "quiet")
    assert isinstance(n1, Enqueued) and isinstance(q1, Enqueued)
    # one noisy request ends: one slot free, the last: noisy (3 dispatched) is the heavier
    grants = end(s, run[0].ticket, clk)
    assert [g.ticket for g in grants] == [q1.ticket]
    # again: noisy still the heavier (3 to 2) and holding two: the slot is kept
    assert end(s, run[1].ticket, clk) == []
    # noisy's last running request ends: holding none it may; its request passed over goes first
    grants = end(s, run[2].ticket, clk)
    assert [g.ticket for g in grants] == [n1.ticket]


def test_a_newcomer_taking_a_slot_past_waiters_grants_the_one_it_made_lighter() -> None:
    """The grant invariant after a placement: the newcomer's use can make a waiter no
    longer the heaviest with a slot still free; that waiter is granted at once, in
    `Scheduler.granted` for the caller to wake (authority/door.py)."""
    clk = ManualClock()
    e = slots(4)  # fair_reserve 0.5: k = 2
    s = sched(e, reserve=0.5, weights={"c": 0.4})
    ran(s, clk, ["c", "b", "b"])  # c: 1 / 0.4 = 2.5 per weight; b: 2
    assert [type(admit(s, clk, "b")) for _ in range(3)] == [Dispatch, Dispatch, Enqueued]  # b: 4 > 2.5, two free: kept
    waiting = e.queue[0]
    got = admit(s, clk, "c")  # c holds none: it may; then 2 / 0.4 = 5 > b's 4
    assert isinstance(got, Dispatch) and [g.ticket for g in s.granted] == [waiting]
    assert not e.queue


def test_with_weights_the_heavier_weight_takes_more_slots() -> None:
    clk = ManualClock()
    e = slots(4)
    s = sched(e, weights={"big": 3.0})
    assert isinstance(admit(s, clk, "small"), Dispatch)
    got = [admit(s, clk, "big") for _ in range(3)]
    assert [type(g) for g in got] == [Dispatch, Dispatch, Dispatch]  # 2/3 per weight before its third: lighter than small's 1


# -- FairQueue.pop_eligible keeps SFQ's invariants -------------------------------------------------


class _W:
    def __init__(self, tenant: str) -> None:
        self.tenant = tenant


class _T:
    def __init__(self, i: int, tenant: str) -> None:
        self.id, self.work, self.pred_prefill_ms = i, _W(tenant), 10.0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["push", "pop"]), st.sampled_from("abc"), st.frozensets(st.sampled_from("abc"))), max_size=60))
def test_pop_eligible_keeps_fifo_per_tenant_v_monotone_and_every_tag_at_or_above_v(ops: list[tuple[str, str, frozenset[str]]]) -> None:
    q = FairQueue(lambda t: {"a": 1.0, "b": 2.0, "c": 0.5}[t or "a"])
    sent: dict[str, list[int]] = {}
    got: dict[str, list[int]] = {}
    i = 0
    for op, tenant, allowed in ops:
        v = q._v
        if op == "push":
            q.append(_T(i, tenant))
            sent.setdefault(tenant, []).append(i)
            i += 1
        else:
            # the smallest start tag among the eligible, ties to the tenant queued first
            best = min(((f.vt, k, u) for k, (u, f) in enumerate(q._flows.items()) if u in allowed), default=None)
            t = q.pop_eligible(lambda u: u in allowed)  # noqa: B023
            if best is None:
                assert t is None
            else:
                assert t is not None and t.work.tenant == best[2]
                got.setdefault(t.work.tenant, []).append(t.id)
        assert q._v >= v
        assert all(f.vt >= q._v for f in q._flows.values())
    for u, ids in got.items():
        assert ids == sent[u][: len(ids)]  # FIFO within a tenant


def test_pop_eligible_with_everyone_allowed_is_popleft() -> None:
    a, b = FairQueue(), FairQueue()
    for i, tenant in enumerate("aababcaab"):
        a.append(_T(i, tenant))
        b.append(_T(i, tenant))
    assert [a.popleft().id for _ in range(9)] == [b.pop_eligible(lambda u: True).id for _ in range(9)]


# -- the counts follow every path ------------------------------------------------------------------


def _unified_first_token_finish(s: Scheduler, clk: ManualClock) -> None:
    d = admit(s, clk, "noisy")
    s.first_token(d.ticket, clk.now())
    held_agrees_with_slots(s)
    s.finish(d.ticket, clk.now())


def _cancelled_before_first_token(s: Scheduler, clk: ManualClock) -> None:
    s.finish(admit(s, clk, "quiet").ticket, clk.now())


def _cancelled_while_queued(s: Scheduler, clk: ManualClock) -> None:
    live = [admit(s, clk, "noisy") for _ in range(6)]
    assert any(isinstance(x, Enqueued) for x in live)
    for x in reversed(live):
        s.finish(x.ticket, clk.now())
        held_agrees_with_slots(s)


def _failed_then_retried_elsewhere(s: Scheduler, clk: ManualClock) -> None:
    d = admit(s, clk, "noisy")
    s.decode_failed(d.ticket, clk.now())  # T05: the attempt failed before its headers
    held_agrees_with_slots(s)
    r = s.retry_unified(d.ticket, clk.now())
    assert isinstance(r, Dispatch) and r.engine != d.engine
    held_agrees_with_slots(s)
    s.first_token(d.ticket, clk.now())
    s.finish(d.ticket, clk.now())


def _migrated_after_first_token(s: Scheduler, clk: ManualClock) -> None:
    d = admit(s, clk, "quiet")
    s.first_token(d.ticket, clk.now())
    s.decode_failed(d.ticket, clk.now())  # a broken stream carried on by another engine
    held_agrees_with_slots(s)
    assert isinstance(s.retry_unified(d.ticket, clk.now()), Dispatch)
    held_agrees_with_slots(s)
    s.finish(d.ticket, clk.now())


def _retry_queued_then_granted(s: Scheduler, clk: ManualClock) -> None:
    busy = [admit(s, clk, "noisy") for _ in range(4)]
    d = busy[0]
    assert isinstance(d, Dispatch)
    s.decode_failed(d.ticket, clk.now())
    s.retry_unified(d.ticket, clk.now())
    held_agrees_with_slots(s)
    for x in busy:
        end(s, x.ticket, clk)
        held_agrees_with_slots(s)


def _reconciled_off_a_drained_engine(s: Scheduler, clk: ManualClock) -> None:
    live = [admit(s, clk, "noisy") for _ in range(3)] + [admit(s, clk, "quiet") for _ in range(3)]
    s.engines["u0"].draining = True
    grants, refused = s.reconcile(clk.now())
    assert not refused
    held_agrees_with_slots(s)
    for x in live:
        end(s, x.ticket, clk)
        held_agrees_with_slots(s)
    s.engines["u0"].draining = False


def _refused_while_waiting(s: Scheduler, clk: ManualClock) -> None:
    live = [admit(s, clk, t) for t in ("noisy", "noisy", "noisy", "quiet", "noisy", "quiet")]
    refused = {t.id for t, _ in s.refuse_waiting(object())}  # type: ignore[arg-type]
    held_agrees_with_slots(s)
    for x in live:
        if x.ticket.id not in refused:
            end(s, x.ticket, clk)


def _pd_prefill_then_decode(s: Scheduler, clk: ManualClock) -> None:
    d = s.admit(of(clk, "noisy"), clk.now())
    assert isinstance(d, Dispatch) and d.engine == "p0"
    s.prefill_done(d.ticket, clk.now(), ok=True)
    held_agrees_with_slots(s)
    assert isinstance(s.want_decode(d.ticket, clk.now()), Dispatch)
    s.first_token(d.ticket, clk.now())
    s.finish(d.ticket, clk.now())


def _pd_prefill_refused(s: Scheduler, clk: ManualClock) -> None:
    d = s.admit(of(clk, "quiet"), clk.now())
    assert isinstance(d, Dispatch)
    s.prefill_done(d.ticket, clk.now(), ok=False)
    held_agrees_with_slots(s)
    s.finish(d.ticket, clk.now())


UNIFIED = lambda: [slots(2, "u0"), slots(2, "u1")]  # noqa: E731
PD = lambda: [engine("p0", "prefill", prefill=2), engine("d0", "decode", decode=2)]  # noqa: E731


PATHS = [(UNIFIED, p) for p in (_unified_first_token_finish, _cancelled_before_first_token, _cancelled_while_queued, _failed_then_retried_elsewhere,
                                 _migrated_after_first_token, _retry_queued_then_granted, _reconciled_off_a_drained_engine, _refused_while_waiting)]
PATHS += [(PD, p) for p in (_pd_prefill_then_decode, _pd_prefill_refused)]


@pytest.mark.parametrize(("fleet", "path"), [pytest.param(f, p, id=p.__name__.strip("_")) for f, p in PATHS])
@pytest.mark.parametrize("reserve", [0.25, 0.0])
def test_the_counts_return_to_zero_after_every_path(fleet: Callable[[], list[EngineState]], path: Callable[[Scheduler, ManualClock], None], reserve: float) -> None:
    clk = ManualClock()
    s = sched(*fleet(), reserve=reserve)
    path(s, clk)
    held_agrees_with_slots(s)
    assert s.fair is not None and s.fair.holding() == 0
    for name in list(s.engines):  # and every engine leaves (M29: it holds nothing)
        s.remove(name)
    assert s.fair._usage == {}  # nothing kept of an engine that left (a fleet that churns)


# -- a random walk: the counts agree with the slots and no waiter may take a free slot ----------------


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["noisy", "quiet", "first", "end", "fail"]), st.integers(0, 50)), max_size=80),
       st.sampled_from([0.25, 0.5]))
def test_a_random_walk_keeps_the_counts_and_the_grant_invariant(ops: list[tuple[str, int]], reserve: float) -> None:
    clk = ManualClock()
    s = sched(slots(2, "u0"), slots(4, "u1"), reserve=reserve)
    live: list[Ticket] = []
    for op, k in ops:
        clk.advance(0.01)
        if op in ("noisy", "quiet"):
            live.append(admit(s, clk, op).ticket)
        elif live:
            t = live[k % len(live)]
            if op == "first" and t.holds_prefill is not None:
                s.first_token(t, clk.now())
            elif op == "fail" and t.holds_decode is not None:
                s.decode_failed(t, clk.now())
                s.retry_unified(t, clk.now())
            elif op == "end":
                s.finish(t, clk.now())
                live.remove(t)
        held_agrees_with_slots(s)
        for e in s.engines.values():  # every grant pass leaves no waiter that may take a free slot
            if e.queue and e.phase1_free():
                assert not any(s.may_take(e, u, clk.now()) for u in {t.work.tenant for t in e.queue}), (e.name, s.fair.held(e.name) if s.fair else None)
    for t in live:
        s.finish(t, clk.now())
    held_agrees_with_slots(s)
    assert s.fair is not None and s.fair.holding() == 0


def test_a_tenant_holding_none_does_not_take_the_kept_slot_while_a_lighter_one_waits() -> None:
    """Issue 40 item 6: the noisy tenant's running request ends and it holds no slot for a
    moment; its queued request (first in fair queueing's order: queued first) may not
    take the slot kept for the quiet tenant, whose request waits: the lighter tenant is
    served first, and the noisy one once no lighter tenant waits."""
    clk = ManualClock()
    e = slots(2)
    s = sched(e)
    ran(s, clk, ["noisy", "noisy", "noisy", "quiet"])
    noisy = admit(s, clk, "noisy").ticket
    quiet = admit(s, clk, "quiet").ticket
    n2, q2 = admit(s, clk, "noisy"), admit(s, clk, "quiet")
    assert isinstance(n2, Enqueued) and isinstance(q2, Enqueued)
    assert [g.ticket for g in end(s, noisy, clk)] == [q2.ticket]  # not n2, queued before it
    assert [g.ticket for g in end(s, quiet, clk)] == [n2.ticket]  # no lighter tenant waits now
    for t in (q2.ticket, n2.ticket):
        end(s, t, clk)
