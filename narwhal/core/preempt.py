"""Fair preemption (issue 40 item 6), sans-IO: a lighter tenant's request waiting for a
slot that the heaviest tenant's running request holds takes it, and that request is
carried on after it by stream migration (spec/tables/migration.yaml).

The fair reserve (core/fairness.py) keeps the last free slots of an engine from the
heaviest tenant, but a slot it already holds stays held until its request ends: a quiet
tenant whose own two requests overlap (or whose request comes while the kept slot is
its own) waits a whole noisy request. Engines preempt for priority themselves (vLLM
recomputes a preempted sequence); a router can do the same with what it already has: a
decode leg cut after its first token and carried on from its validated token IDs
continues the same generation (core/migration.py).

The rule (`check`, after every grant pass and every request queued on an engine; one
decision, in this order of facts):
  1. tenants are configured, admission.fair_reserve > 0, admission.fair_preempt is on
     and upstream.migration.max_attempts > 0 (`FairReserve.preempt`);
  2. the engine is unified, every phase-1 slot of it is taken, and no request on it has
     been asked to leave and still holds its slot (one preemption at a time per engine);
  3. a tenant queued there is lighter than the heaviest tenant holding a slot of it
     (fewer dispatches there lately per weight, the reserve's order);
  4. that heaviest tenant holds a request there past its first token whose decode leg
     the data plane said can be carried on (`Ticket.movable`: streaming, G01-G12 hold
     none) and that was never preempted (`Ticket.preempted`: at most once per request);
  then its newest such request (the least generated: the least recomputed) is asked to
  leave (`Preempt`). The data plane cuts that leg (if it still can be carried on), and its
  retry is `resume`: the slot is freed without counting a failure against the engine
  (no breaker, the engine not excluded) and the waiters are granted as after any
  release (the reserve gives the slot to a lighter tenant's waiter first, though the
  preempted tenant holds none there for that moment), and the request waits first among its
  tenant's queued requests for its continuation's slot, never yielding its place (R02,
  R11: `FairQueue.newest`).

Invariants
  * Nothing changes without tenants, with fair_reserve 0, fair_preempt off or migration
    off: `check` returns at its first test.
  * `FairReserve.pending[engine]` names at most one request, until it holds no slot of
    the engine (cut, ended, however): a request the data plane did not cut (it ended, or
    could no longer be carried on) holds the engine's turn for its own remaining time.
  * A preempted request's slot is handed to a waiter in the same step as it is freed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fleet import EngineState
from .placement import retry_place
from .tickets import Dispatch, Enqueued, Ticket

__all__ = ["Preempt", "configured", "check", "resume"]

# core/admission.py's Scheduler, whose slots and queues these steps read and commit to
# (it calls `check`: typed by name only, no import circle)
Scheduler = Any


def configured(config: Any) -> bool:
    """Rule 1, as far as the configuration says (a NarwhalConfig): tenants configured,
    admission.fair_reserve > 0, admission.fair_preempt on, and a preempted request can
    be carried on (upstream.migration.max_attempts > 0)."""
    a = config.admission
    return bool(config.tenants) and a.fair_reserve > 0 and bool(a.fair_preempt) and config.upstream.migration.max_attempts > 0


@dataclass(frozen=True, slots=True)
class Preempt:
    """Ask the data plane to cut `ticket`'s decode leg on `engine` and carry it on."""

    ticket: Ticket
    engine: str


def check(s: Scheduler, e: EngineState, now: float) -> None:
    """The rule (module docstring) on `e`: a decision appended to `s.preempts`, or none."""
    fair = s.fair
    if fair is None or not fair.preempt or fair.fraction <= 0:
        return
    if e.role != "unified" or not e.queue or e.phase1_free() or e.name in fair.pending:
        return
    holders = fair.held(e.name)
    if not holders:
        return
    heaviest = next(iter(holders))
    for u in holders:
        if fair.heavier(e.name, u, heaviest, now):
            heaviest = u
    if not any(fair.heavier(e.name, heaviest, u, now) for u in e.queue.queued_tenants()):
        return
    best: Ticket | None = None
    for t in fair.on(e.name):
        if (t.work.tenant == heaviest and t.movable and t.preempted is None and t.holds_decode == e.name
                and t.holds_prefill is None and (best is None or (t.prefill_dispatched_at or 0.0) > (best.prefill_dispatched_at or 0.0))):
            best = t
    if best is None:
        return
    best.preempted = e.name
    fair.pending[e.name] = best.id
    s.preempts.append(Preempt(best, e.name))


def resume(s: Scheduler, t: Ticket, now: float) -> tuple[list[Dispatch], Dispatch | Enqueued | None]:
    """`t`'s leg on the engine it was asked to leave was cut: free its slot (no failure
    counted, the engine not excluded) and grant the waiters, then place it again: first
    among its tenant's requests in that engine's queue, or (the engine no longer
    eligible) as T05 places a retry. Returns (the waiters' grants, its own place)."""
    name = t.preempted
    assert name is not None and t.holds_decode == name
    e = s.engines[name]
    t.movable = False
    e.decode_moved(now, -1)
    t.holds_decode = None
    s._let_go(t)
    grants = s._grant_phase1(e, now)  # the lighter waiter first: the reserve keeps the slot for it
    if not s.eligible(e):
        return grants, retry_place(s, t, now)
    if not e.queue and e.phase1_free() and s.may_take(e, t.work.tenant, now):
        return grants, s._dispatch1(t, e, now)
    return grants, s._enqueue(t, e, now, first=True)
