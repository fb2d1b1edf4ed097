"""Fair queueing across tenants (issue 22: "the one admission queue serves tenants by
weight"), sans-IO.

`FairQueue` is a drop-in for the `deque[Ticket]` each engine's phase-1 queue was: the
same operations (append, popleft, remove, len, iteration, clear), but `popleft` serves
the tenants with queued requests by weight, start-time fair queueing over requests:

  * every tenant has a virtual finish time `vt`; serving one of its requests advances it
    by 1 / weight;
  * `popleft` takes the oldest request of the tenant whose next finish (vt + 1/weight) is
    smallest; ties go to the tenant queued first (FIFO between equals);
  * a tenant that was idle starts at the queue's virtual time (the finish time of the
    request served last), so idling earns no credit, and a tenant alone is served FIFO:
    work-conserving, and exactly the old deque's order when one tenant queues.

Invariants
  * Within a tenant, FIFO. Across tenants, over any stretch in which tenants u and v both
    stay backlogged, the requests served differ from the weight ratio by at most one each.
  * `work_ms` is the sum of the queued tickets' predicted prefill (`pred_prefill_ms`):
    the scheduler keeps `EngineState.queued_work_ms` equal to it.
  * `ahead_ms(tenant, weight)`: the predicted work served before a new request of that
    tenant, under this order (its own queue, and of every other tenant at most as much
    as its weight earns while the newcomer waits): what the projection of R10 counts
    instead of the whole queue, so one tenant's backlog is not another's TTFT.

A ticket's tenant is `ticket.work.tenant` (None: the default tenant); weights come from a
function of the tenant name (`tenants.NAME.weight`, else `tenants.default`, else 1).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["FairQueue", "Weights"]

Weights = Callable[[str | None], float]


def _one(_: str | None) -> float:
    return 1.0


class _Flow:
    __slots__ = ("q", "vt", "work")

    def __init__(self) -> None:
        self.q: deque[Any] = deque()
        self.vt = 0.0  # virtual finish time of this tenant's last served request
        self.work = 0.0  # predicted prefill ms queued


class FairQueue:
    __slots__ = ("weights", "_flows", "_len", "_v", "_order")

    def __init__(self, weights: Weights | None = None) -> None:
        self.weights = weights or _one
        self._flows: dict[str | None, _Flow] = {}  # backlogged tenants, in the order they queued
        self._len = 0
        self._v = 0.0  # the queue's virtual time: the finish time of the last request served
        self._order = 0

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
            f.vt = self._v  # idle time earns no credit
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
            key = f.vt + 1.0 / self.weights(tenant)
            if best is None or key < best_key:
                best, best_key, best_tenant = f, key, tenant
        assert best is not None
        t = best.q.popleft()
        best.vt = best_key
        self._v = best_key
        best.work -= t.pred_prefill_ms
        self._len -= 1
        if not best.q:
            del self._flows[best_tenant]
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

    def clear(self) -> None:
        self._flows.clear()
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
        `total_ms` is the whole queue's (the answer when one tenant queues)."""
        if not self._flows or (len(self._flows) == 1 and tenant in self._flows):
            return total_ms
        own = self._flows.get(tenant)
        n = (len(own.q) if own is not None else 0) + 1  # its requests up to the new one
        out = own.work if own is not None else 0.0
        for u, f in self._flows.items():
            if u == tenant:
                continue
            # while the newcomer's n requests are served, u is served about n * w_u / w
            share = n * self.weights(u) / weight
            k = len(f.q)
            out += f.work if share >= k else f.work * share / k
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

    def share_load(self, tenant: str | None, extra: int = 0) -> float:
        """`tenant`'s queued requests (plus `extra`) per unit of weight."""
        return (self.queued(tenant) + extra) / self.weights(tenant)
