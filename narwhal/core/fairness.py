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

A ticket's tenant is `ticket.work.tenant` (None: the default tenant); weights come from a
function of the tenant name (`tenants.NAME.weight`, else `tenants.default`, else 1).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FairQueue", "Weights", "retention_victim"]

Weights = Callable[[str | None], float]


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
        t = best.q.popleft()
        self._v = best_key
        best.vt = best_key + 1.0 / self.weights(best_tenant)
        best.work -= t.pred_prefill_ms
        self._len -= 1
        if self._left:
            v = self._v
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
            if load > best_load:
                best, best_load = (tenant, f.q[-1]), load
        return best

    def newest(self, tenant: str | None) -> Any:
        """`tenant`'s newest queued ticket, or None."""
        f = self._flows.get(tenant)
        return f.q[-1] if f is not None and f.q else None

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
