"""Fair queueing across tenants (issue 22: "the one admission queue serves tenants by
weight"), sans-IO.

`FairQueue` is a drop-in for the `deque[Ticket]` each engine's phase-1 queue was: the
same operations (append, popleft, remove, len, iteration, clear), but `popleft` serves
the tenants with queued requests by weight, start-time fair queueing (SFQ, Goyal et al.
1996) over requests:

  * a tenant's next request carries a start tag `vt`; serving it advances the tenant's
    tag by 1 / weight (its finish tag, the start of its next request);
  * `popleft` takes the oldest request of the tenant with the smallest start tag; ties go
    to the tenant queued first (FIFO between equals);
  * the queue's virtual time `_v` is the start tag of the request served last; a tenant
    that becomes backlogged starts at max(_v, the finish tag it left with): idling earns
    no credit, and a tenant that empties its queue and comes straight back cannot cut in
    again before the others' turns. A tenant alone is served FIFO: work-conserving, and
    exactly the old deque's order when one tenant queues.
  * Start tags, not finish tags: a tenant that was idle and sends one request is served
    before the next request of a tenant that has been backlogged all along (SFQ's
    delay bound: one request of each other backlogged tenant at most, and none when the
    newcomer's start is below theirs). Ordering by finish tags with _v = the last finish
    tied the two and let the backlogged tenant go first: the quiet tenant then waited a
    whole noisy prefill more (docs/performance.md, "Tenants: one tenant's overload").

Invariants
  * Within a tenant, FIFO. Across tenants, over any stretch in which tenants u and v both
    stay backlogged, the requests served differ from the weight ratio by at most one each.
  * `_v` never decreases; every backlogged tenant's tag is >= `_v`. Finish tags of
    tenants that left the queue are kept only while they are ahead of `_v` (`_left`,
    pruned as `_v` passes them), so memory is bounded by the tenants seen recently.
  * `work_ms` is the sum of the queued tickets' predicted prefill (`pred_prefill_ms`):
    the scheduler keeps `EngineState.queued_work_ms` equal to it.
  * `ahead_ms(tenant, weight)`: the predicted work served before a new request of that
    tenant, under this order (its own queue, and of every other tenant the requests whose
    start tags come before the newcomer's): what the projection of R10 counts instead of
    the whole queue, so one tenant's backlog is not another's TTFT.
  * `pop_eligible(may)`: `popleft` among the tenants `may` lets take the slot (the fair
    reserve below): the smallest start tag of those, ties to the tenant queued first. A
    tenant passed over keeps its tag, so it is served first once it may; `_v` moves only
    to the smallest start tag still backlogged or served, so it never passes a tenant's
    tag (every backlogged tag stays >= `_v`) and a tenant passed over is never charged.

A ticket's tenant is `ticket.work.tenant` (None: the default tenant); weights come from a
function of the tenant name (`tenants.NAME.weight`, else `tenants.default`, else 1).

`FairReserve` (rows R02 and R11, issue 40 item 6): fair queueing orders the queue, but a
request first in it still waits for a slot that another tenant's running request holds
(no preemption). With tenants configured, the heaviest tenant on an engine may not take
that engine's last k free phase-1 slots: they are kept for the other tenants (the
borrowing limit of Kubernetes API Priority and Fairness, in miniature).
k = max(1, floor(slots x admission.fair_reserve)) for an engine of 2 slots or more, 0 when
the knob is 0.
  * Heaviest: the most phase-1 dispatches on this engine lately per weight (a count
    decaying with time constant `USAGE_TAU_S`), ties counting as heaviest, among the
    tenants active there: holding one of its slots, or admitted within `RECENT_S`.
    Usage, not the slots held this instant: a quiet tenant whose two requests overlap
    holds as many slots as the noisy one for a moment, and by slots held it would then
    wait for its own request while the noisy one took the slot kept for it.
  * A tenant alone (no other active tenant) may take every slot: a tenant idle for
    RECENT_S is not waited for, so a tenant by itself is served work-conserving.
  * A tenant holding no slot of the engine may take a free one unless a tenant lighter
    than it waits for that engine (the kept slots go to the lighter tenants first: a
    noisy tenant whose running request just ended, or was preempted, holds none for a
    moment and would otherwise take the slot kept for the quiet one). The lightest
    waiting tenant always may, so a slot held by requests another router placed
    (`external`) never stalls a queue.

Invariants
  * `held(engine)[tenant]` is exactly the tenant's tickets dispatched to a phase-1 slot
    of that engine (`took`, at phase-1 dispatch) that still hold a slot there: the prefill
    slot, or, on a unified engine, the decode slot taken with it (`settle` after every
    release: first token, prefill done, a failed attempt, the end, a migration's retry).
    Summed over tenants it equals the engine's `prefill_in_use` (prefill role) or
    `decode_in_use` (unified role); zero when the engine holds nothing.
  * After every grant pass no waiter may take a free slot of its engine (so a newcomer
    who may takes one though others wait: `Placement.free`). Usage decays by the same
    factor for every tenant, so who is heaviest changes only at a dispatch (a dispatch
    past waiters, a newcomer's or a retry's, runs a grant pass: `Scheduler.granted`);
    only RECENT_S passing, or a tenant becoming active, can let a waiter take a slot
    with no grant pass, and then:
  * Progress: a tenant refused a reserved slot holds one there, so a release comes, and
    every release runs a grant pass over the queue.
  * Memory: `_seen` and each engine's `_usage` are pruned past 64 tenants (entries idle
    past RECENT_S, usage below 1e-3); `_held` and `_tickets` hold only what holds a slot.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FairQueue", "FairReserve", "Weights", "retention_victim", "RECENT_S", "USAGE_TAU_S"]

Weights = Callable[[str | None], float]

# FairReserve (module docstring): slots are kept for a tenant holding one or admitted this
# recently; usage decays with this time constant
RECENT_S = 10.0
USAGE_TAU_S = 5.0


def _one(_: str | None) -> float:
    return 1.0


class _Flow:
    __slots__ = ("q", "vt", "work")

    def __init__(self) -> None:
        self.q: deque[Any] = deque()
        self.vt = 0.0  # start tag of this tenant's next request (= finish tag of its last served)
        self.work = 0.0  # predicted prefill ms queued


class FairQueue:
    __slots__ = ("weights", "_flows", "_len", "_v", "_left")

    def __init__(self, weights: Weights | None = None) -> None:
        self.weights = weights or _one
        self._flows: dict[str | None, _Flow] = {}  # backlogged tenants, in the order they queued
        self._len = 0
        self._v = 0.0  # the queue's virtual time: the start tag of the last request served
        self._left: dict[str | None, float] = {}  # finish tags (> _v) of tenants no longer queued

    # -- the deque's surface ----------------------------------------------------------

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __iter__(self) -> Iterator[Any]:
        for f in self._flows.values():
            yield from f.q

    def append(self, t: Any) -> None:
        tenant = t.work.tenant
        f = self._flows.get(tenant)
        if f is None:
            f = self._flows[tenant] = _Flow()
            left = self._left.pop(tenant, None)
            f.vt = left if left is not None and left > self._v else self._v  # idle time earns no credit
        f.q.append(t)
        f.work += t.pred_prefill_ms
        self._len += 1

    def popleft(self) -> Any:
        if not self._len:
            raise IndexError("pop from an empty FairQueue")
        best: _Flow | None = None
        best_key = 0.0
        best_tenant: str | None = None
        for tenant, f in self._flows.items():
            if best is None or f.vt < best_key:
                best, best_key, best_tenant = f, f.vt, tenant
        assert best is not None
        return self._serve(best, best_tenant, best_key, best_key)

    def pop_eligible(self, may: Callable[[str | None], bool]) -> Any:
        """The next request of the tenants `may` admits, in SFQ order (module docstring);
        None when no queued tenant may take the slot."""
        best: _Flow | None = None
        best_key = passed = math.inf
        best_tenant: str | None = None
        for tenant, f in self._flows.items():
            if f.vt >= best_key:
                continue  # ties go to the tenant queued first
            if may(tenant):
                best, best_key, best_tenant = f, f.vt, tenant
            elif f.vt < passed:
                passed = f.vt
        if best is None:
            return None
        # _v: SFQ's virtual time, never past a tag still backlogged (a tenant passed over)
        return self._serve(best, best_tenant, best_key, min(best_key, passed))

    def _serve(self, best: _Flow, best_tenant: str | None, best_key: float, v: float) -> Any:
        t = best.q.popleft()
        self._v = v
        best.vt = best_key + 1.0 / self.weights(best_tenant)
        best.work -= t.pred_prefill_ms
        self._len -= 1
        if self._left:
            for u in [u for u, ft in self._left.items() if ft <= v]:
                del self._left[u]
        if not best.q:
            del self._flows[best_tenant]
            self._left[best_tenant] = best.vt
        return t

    def remove(self, t: Any) -> None:
        tenant = t.work.tenant
        f = self._flows.get(tenant)
        if f is None:
            raise ValueError("ticket not queued")
        f.q.remove(t)  # ValueError when absent, as deque.remove
        f.work -= t.pred_prefill_ms
        self._len -= 1
        if not f.q:
            del self._flows[tenant]
            if f.vt > self._v:
                self._left[tenant] = f.vt

    def clear(self) -> None:
        self._flows.clear()
        self._left.clear()
        self._len = 0

    def __getitem__(self, i: int) -> Any:
        """The oldest queued ticket (`queue[0]`), as with a deque."""
        if i != 0 or not self._len:
            raise IndexError(i)
        return next(iter(self))

    # -- what fairness adds ---------------------------------------------------------------

    @property
    def tenants(self) -> int:
        """Tenants with queued requests."""
        return len(self._flows)

    def queued_tenants(self) -> Any:
        """The tenants with queued requests (a view)."""
        return self._flows.keys()

    def queued(self, tenant: str | None) -> int:
        f = self._flows.get(tenant)
        return len(f.q) if f is not None else 0

    def ahead_ms(self, tenant: str | None, weight: float, total_ms: float) -> float:
        """Predicted work served before a new request of `tenant` (module docstring);
        `total_ms` is the whole queue's (the answer when one tenant queues).

        The newcomer's start tag is its tenant's tag plus 1/weight per request of its
        own already queued (a tenant not queued: max(_v, the finish tag it left with)).
        Of every other tenant u, the queued requests whose start tags come first are
        served before it: those with tag < the newcomer's, and == when u queued first
        (ties go to the tenant queued first; a tenant not queued now would queue last)."""
        if not self._flows or (len(self._flows) == 1 and tenant in self._flows):
            return total_ms
        own = self._flows.get(tenant)
        if own is not None:
            start = own.vt + len(own.q) / weight
            out = own.work
        else:
            left = self._left.get(tenant)
            start = left if left is not None and left > self._v else self._v
            out = 0.0
        before = True  # u queued before the newcomer's tenant
        for u, f in self._flows.items():
            if u == tenant:
                before = False
                continue
            k = len(f.q)
            if start < f.vt or (start == f.vt and not before):
                continue
            # u's queued requests start at f.vt, f.vt + 1/w_u, ...: those up to `start`
            j = math.floor((start - f.vt) * self.weights(u) + 1e-9)
            if start == f.vt + j / self.weights(u) and not before:
                j -= 1  # the tie at the last one goes to the newcomer
            n = min(k, j + 1)
            if n > 0:
                out += f.work if n >= k else f.work * n / k
        return out

    def over_share(self) -> tuple[str | None, Any] | None:
        """(tenant, its newest ticket) of the tenant furthest over its share of this queue
        (queued requests per weight), or None when empty: who yields when the queue is
        full and a tenant under its share arrives."""
        best: tuple[str | None, Any] | None = None
        best_load = -1.0
        for tenant, f in self._flows.items():
            load = len(f.q) / self.weights(tenant)
            if load > best_load and (t := self.newest(tenant)) is not None:
                best, best_load = (tenant, t), load
        return best

    def newest(self, tenant: str | None) -> Any:
        """`tenant`'s newest queued ticket that may yield its place, or None: a preempted
        request waiting to be carried on (core/preempt.py; its answer has started) never
        does."""
        f = self._flows.get(tenant)
        if f is None:
            return None
        for t in reversed(f.q):
            if getattr(t, "preempted", None) is None:
                return t
        return None

    def push_front(self, t: Any) -> None:
        """Queue `t` first among its tenant's requests (a preempted request carried on,
        core/preempt.py: it was served already; its tenant's start tag is unchanged, so it
        is served at that tenant's next turn)."""
        self.append(t)
        q = self._flows[t.work.tenant].q
        q.pop()
        q.appendleft(t)

    def share_load(self, tenant: str | None, extra: int = 0) -> float:
        """`tenant`'s queued requests (plus `extra`) per unit of weight."""
        return (self.queued(tenant) + extra) / self.weights(tenant)


def retention_victim(held: dict[str, int], weight: Weights, tenant: str) -> str | None:
    """R02 with tenants (issue 40 item 6; R11's rule applied to the HTTP retention): the
    retention is full and `tenant` arrives (`held` counts every tenant's requests held,
    the arrival included). When the arrival leaves `tenant` holding less per weight than
    the tenant furthest over its share, that tenant yields (its newest request not yet
    granted is refused in the arrival's place): who, else None (R02 stands). Ties stay:
    a tenant at its share is refused as before, so two tenants never trade places."""
    over: str | None = None
    over_load = -1.0
    for u, n in held.items():
        if u != tenant and n > 0 and n / weight(u) > over_load:
            over, over_load = u, n / weight(u)
    if over is None or held.get(tenant, 0) / weight(tenant) >= over_load:
        return None
    return over


class FairReserve:
    """The fair reserve of an engine's phase-1 slots (module docstring; rows R02/R11
    fairness, issue 40 item 6). Engines are read, never written: `role`, the slots and
    what is in use (core/fleet.py EngineState)."""

    __slots__ = ("weights", "fraction", "preempt", "_held", "_tickets", "_on", "_seen", "_usage", "pending")

    def __init__(self, weights: Weights, fraction: float, preempt: bool = False) -> None:
        self.weights = weights
        self.fraction = fraction  # admission.fair_reserve; 0: counted, nothing reserved
        # admission.fair_preempt, with stream migration on (core/preempt.py)
        self.preempt = preempt
        self._held: dict[str, dict[str | None, int]] = {}  # engine -> tenant -> phase-1 slots held
        self._tickets: dict[int, tuple[str, str | None]] = {}  # ticket id -> (engine, tenant), while it holds
        self._on: dict[str, dict[int, Any]] = {}  # engine -> ticket id -> ticket, the same tickets
        self.pending: dict[str, int] = {}  # engine -> the ticket asked to leave it (core/preempt.py), until it holds no slot there
        self._seen: dict[str | None, float] = {}  # tenant -> when it was last admitted
        # engine -> tenant -> (dispatches decayed to `at`, at): pruned once negligible
        self._usage: dict[str, dict[str | None, tuple[float, float]]] = {}

    def seen(self, tenant: str | None, now: float) -> None:
        """A request of `tenant` was admitted at `now` (bounded: entries past RECENT_S
        are pruned once there are many)."""
        self._seen[tenant] = now
        if len(self._seen) > 64:
            for u in [u for u, at in self._seen.items() if now - at > RECENT_S]:
                del self._seen[u]

    def took(self, t: Any, engine: str, now: float) -> None:
        """`t` was dispatched to a phase-1 slot of `engine` at `now`."""
        if t.id in self._tickets:
            raise ValueError(f"ticket {t.id} already holds a phase-1 slot")
        tenant = t.work.tenant
        self._tickets[t.id] = (engine, tenant)
        self._on.setdefault(engine, {})[t.id] = t
        h = self._held.setdefault(engine, {})
        h[tenant] = h.get(tenant, 0) + 1
        u = self._usage.setdefault(engine, {})
        u[tenant] = (self.usage(engine, tenant, now) + 1.0, now)
        if len(u) > 64:
            for v in [v for v in u if self.usage(engine, v, now) < 1e-3]:
                del u[v]

    def usage(self, engine: str, tenant: str | None, now: float) -> float:
        """`tenant`'s phase-1 dispatches on `engine`, each decayed by exp(-age / USAGE_TAU_S)."""
        got = self._usage.get(engine, {}).get(tenant)
        if got is None:
            return 0.0
        n, at = got
        return n * math.exp(-max(0.0, now - at) / USAGE_TAU_S)

    def settle(self, t: Any) -> None:
        """After one of `t`'s slots was released: it leaves the count once it holds no slot
        of the engine it was dispatched to (a unified engine's decode slot counts)."""
        got = self._tickets.get(t.id)
        if got is None or t.holds_prefill == got[0] or t.holds_decode == got[0]:
            return
        del self._tickets[t.id]
        engine, tenant = got
        on = self._on[engine]
        del on[t.id]
        if not on:
            del self._on[engine]
        if self.pending.get(engine) == t.id:
            del self.pending[engine]
        h = self._held[engine]
        n = h[tenant] - 1
        if n:
            h[tenant] = n
        else:
            del h[tenant]
            if not h:
                del self._held[engine]

    def forget(self, engine: str) -> None:
        """`engine` left the scheduler (holding nothing): its recent use goes with it, so
        a fleet whose engines come and go keeps no entry for one that left."""
        self._usage.pop(engine, None)
        self.pending.pop(engine, None)

    def held(self, engine: str) -> dict[str | None, int]:
        """Phase-1 slots held on `engine`, by tenant (a copy; tenants holding none absent)."""
        return dict(self._held.get(engine, ()))

    def on(self, engine: str) -> list[Any]:
        """The tickets holding a phase-1 slot of `engine` (core/preempt.py chooses among them)."""
        return list(self._on.get(engine, {}).values())

    def heavier(self, engine: str, u: str | None, v: str | None, now: float) -> bool:
        """`u` has had more of `engine` lately than `v`, per weight (the reserve's order)."""
        w = self.weights
        return self.usage(engine, u, now) / w(u) > self.usage(engine, v, now) / w(v)

    def holding(self) -> int:
        """Tickets counted, over all engines."""
        return len(self._tickets)

    def reserved(self, slots: int) -> int:
        """k: the last free slots kept for a tenant holding fewer per weight."""
        if slots < 2 or self.fraction <= 0:
            return 0
        return max(1, math.floor(slots * self.fraction))

    def may_take(self, e: Any, tenant: str | None, now: float) -> bool:
        """Whether a request of `tenant` may take a free phase-1 slot of engine `e` at
        `now` (free slots are the caller's to check first)."""
        if self.fraction <= 0:
            return True
        if e.role == "unified":
            slots = min(e.prefill_slots, e.decode_slots)
            free = min(e.prefill_slots - e.prefill_in_use, e.decode_slots - e.decode_in_use - e.external)
        else:
            slots = e.prefill_slots
            free = e.prefill_slots - e.prefill_in_use - (e.external if e.role == "prefill" else 0)
        if free > self.reserved(slots):
            return True
        h = self._held.get(e.name)
        if not h or not h.get(tenant):
            # holding none there: it may, unless a tenant lighter than it waits for the
            # engine (the kept slots are theirs first; the lightest waiting always may)
            return not any(u != tenant and self.heavier(e.name, tenant, u, now) for u in e.queue.queued_tenants())
        others = {u for u in h if u != tenant} | {u for u, at in self._seen.items() if u != tenant and now - at <= RECENT_S}
        if not others:
            return True  # alone: work-conserving
        w = self.weights
        mine = self.usage(e.name, tenant, now) / w(tenant)
        return any(self.usage(e.name, u, now) / w(u) > mine for u in others)  # ties count as heaviest
