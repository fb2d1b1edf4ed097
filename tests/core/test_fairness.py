"""core/fairness.py: the per-engine queue serves tenants by weight (start-time fair
queueing), FIFO within a tenant and for a tenant alone, and projects the work ahead of a
newcomer as that order would serve it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.fairness import FairQueue


@dataclass
class W:
    tenant: str | None


class T:
    def __init__(self, i: int, tenant: str | None, ms: float = 10.0) -> None:
        self.id, self.work, self.pred_prefill_ms = i, W(tenant), ms

    def __repr__(self) -> str:
        return f"{self.work.tenant}{self.id}"


def drain(q: FairQueue) -> list[Any]:
    out = []
    while q:
        out.append(q.popleft())
    return out


def test_one_tenant_is_fifo_like_the_deque_it_replaces() -> None:
    q = FairQueue()
    ts = [T(i, None) for i in range(5)]
    for t in ts:
        q.append(t)
    assert len(q) == 5 and q[0] is ts[0] and list(q) == ts
    assert drain(q) == ts
    with pytest.raises(IndexError):
        q.popleft()


def test_equal_weights_alternate_whatever_the_backlog() -> None:
    q = FairQueue()
    noisy = [T(i, "noisy") for i in range(10)]
    quiet = [T(i, "quiet") for i in range(2)]
    for t in noisy + quiet:
        q.append(t)
    got = drain(q)
    assert got[:4] == [noisy[0], quiet[0], noisy[1], quiet[1]]
    assert got[4:] == noisy[2:]


@pytest.mark.parametrize(("wa", "wb", "first8_a"), [(1, 1, 4), (3, 1, 6), (1, 3, 2)])
def test_weights_share_the_service(wa: float, wb: float, first8_a: int) -> None:
    q = FairQueue(lambda t: {"a": wa, "b": wb}[t])  # type: ignore[index]
    for i in range(20):
        q.append(T(i, "a"))
        q.append(T(i, "b"))
    first = [q.popleft().work.tenant for _ in range(8)]
    assert first.count("a") == first8_a


def test_an_idle_tenant_earns_no_credit() -> None:
    q = FairQueue()
    for i in range(4):
        q.append(T(i, "a"))
    assert [q.popleft().id for _ in range(3)] == [0, 1, 2]
    q.append(T(9, "b"))  # b arrives after a was served three times: it does not get three in a row
    q.append(T(10, "b"))
    q.append(T(11, "b"))
    got = [(t.work.tenant, t.id) for t in drain(q)]
    assert got[:2] in ([("a", 3), ("b", 9)], [("b", 9), ("a", 3)])


def test_a_tenant_that_becomes_backlogged_goes_before_the_backlogged_ones_next() -> None:
    # start tags: a quiet tenant's one request waits for no noisy request still queued
    q = FairQueue()
    noisy = [T(i, "noisy") for i in range(6)]
    for t in noisy:
        q.append(t)
    assert q.popleft() is noisy[0]  # in service: the quiet one arrives now
    quiet = T(0, "quiet")
    assert q.ahead_ms("quiet", 1.0, 50.0) == 0.0
    q.append(quiet)
    assert q.popleft() is quiet
    assert q.popleft() is noisy[1]


def test_a_tenant_coming_straight_back_does_not_cut_in_again() -> None:
    # the finish tag it left with is kept: one request each, turn about, not quiet every time
    q = FairQueue()
    for i in range(10):
        q.append(T(i, "noisy"))
    got = []
    for i in range(4):
        q.append(T(100 + i, "quiet"))
        got.append(q.popleft().work.tenant)
        got.append(q.popleft().work.tenant)
    assert got.count("quiet") == 4 and got.count("noisy") == 4
    assert all(got[k] != got[k + 1] for k in range(1, len(got) - 1, 2))  # never two quiet in a row
    drain(q)
    assert len(q._left) <= 1  # finish tags behind the virtual time are dropped


def test_remove_and_work_and_ahead() -> None:
    q = FairQueue()
    a = [T(i, "a", 100.0) for i in range(9)]
    for t in a:
        q.append(t)
    q.append(T(50, "b", 10.0))
    q.remove(a[3])
    with pytest.raises(ValueError):
        q.remove(a[3])
    with pytest.raises(ValueError):
        q.remove(T(99, "c"))
    assert len(q) == 9 and q.tenants == 2 and q.queued("a") == 8
    total = 8 * 100.0 + 10.0
    # a newcomer of a waits behind all of a's and b's one; of b, behind its own and the two of a's that start first
    assert q.ahead_ms("a", 1.0, total) == pytest.approx(total)
    assert q.ahead_ms("b", 1.0, total) == pytest.approx(10.0 + 2 * 100.0)
    assert q.ahead_ms("c", 1.0, total) == pytest.approx(100.0 + 10.0)
    assert q.over_share() == ("a", a[8])
    q.clear()
    assert not q and q.ahead_ms("a", 1.0, 0.0) == 0.0 and q.over_share() is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "b", "c"]), min_size=1, max_size=60), st.integers(min_value=0, max_value=60))
def test_fifo_within_a_tenant_and_nothing_lost(tenants: list[str], pops: int) -> None:
    q = FairQueue(lambda t: {"a": 1.0, "b": 2.0, "c": 0.5}[t])  # type: ignore[index]
    ts = [T(i, t) for i, t in enumerate(tenants)]
    for t in ts:
        q.append(t)
    got = [q.popleft() for _ in range(min(pops, len(ts)))] + drain(q)
    assert sorted(t.id for t in got) == list(range(len(ts)))
    for name in "abc":
        ids = [t.id for t in got if t.work.tenant == name]
        assert ids == sorted(ids)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.booleans()), min_size=1, max_size=40), st.sampled_from(["a", "b", "c", "d"]))
def test_ahead_is_the_work_served_before_a_newcomer(ops: list[tuple[str, bool]], who: str) -> None:
    # what R10 projects is what the order then serves (ahead_ms counts other tenants' work pro rata)
    w = {"a": 1.0, "b": 2.0, "c": 0.5, "d": 1.0}
    q = FairQueue(lambda t: w[t])  # type: ignore[index]
    for i, (tenant, pop) in enumerate(ops):
        q.append(T(i, tenant, {"a": 3.0, "b": 5.0, "c": 7.0}[tenant]))  # one size per tenant: the mean is exact
        if pop and q:
            q.popleft()
    total = sum(t.pred_prefill_ms for t in q)
    ahead = q.ahead_ms(who, w[who], total)
    newcomer = T(999, who, 0.0)
    q.append(newcomer)
    served = 0.0
    while (t := q.popleft()) is not newcomer:
        served += t.pred_prefill_ms
    assert ahead == pytest.approx(served)


# -- R02 with tenants: fair retention (issue 40 item 6) ----------------------------------------

from narwhal.core.fairness import retention_victim  # noqa: E402

RETENTION = [
    # (held, including the arrival; weights; arriving tenant; who yields)
    ({"noisy": 9, "quiet": 1}, {}, "quiet", "noisy"),
    ({"noisy": 5, "quiet": 5}, {}, "quiet", None),  # at its share: R02 stands
    ({"noisy": 6, "quiet": 5}, {}, "quiet", "noisy"),
    ({"noisy": 10}, {}, "noisy", None),  # alone: nobody else to yield
    ({"a": 6, "b": 3, "q": 1}, {}, "q", "a"),  # the furthest over its share
    ({"a": 6, "b": 3, "q": 1}, {"a": 4.0}, "q", "b"),  # per weight: a holds 1.5 per unit, b 3
    ({"noisy": 4, "quiet": 3}, {"quiet": 0.5}, "quiet", None),  # 6 per unit of weight: over noisy's 4
    ({"noisy": 0, "quiet": 1}, {}, "quiet", None),
]


@pytest.mark.parametrize(("held", "weights", "tenant", "want"), RETENTION)
def test_retention_victim(held: dict[str, int], weights: dict[str, float], tenant: str, want: str | None) -> None:
    assert retention_victim(held, lambda u: weights.get(u, 1.0), tenant) == want
