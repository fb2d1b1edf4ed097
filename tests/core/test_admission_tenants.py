"""Admission with tenants (issue 22 item 3), sans-IO: one engine's queue serves tenants by
weight, the projection of R10 counts only the work fair queueing serves before a
newcomer, and a full queue (R11) makes the tenant furthest over its share yield."""

from __future__ import annotations

from dataclasses import replace

from narwhal.core.clock import ManualClock
from narwhal.core.tickets import Dispatch, Enqueued, Refuse, Work
from narwhal_generated import errors as E
from tests.core.test_admission import engine, sched, work


def of(w: Work, tenant: str) -> Work:
    return replace(w, tenant=tenant)


def test_a_quiet_tenant_is_projected_behind_its_share_not_behind_the_noisy_backlog() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1, decode=64, b0=100, b1=0.0), queue_limit=100)
    assert isinstance(s.admit(of(work(clk), "noisy"), clk.now()), Dispatch)
    for _ in range(20):  # 20 x 100 ms queued behind the running prefill
        assert isinstance(s.admit(of(work(clk, budget=1e9), "noisy"), clk.now()), Enqueued)
    # the noisy tenant's next request waits behind its whole backlog: R10
    r = s.admit(of(work(clk, budget=1500), "noisy"), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R10
    # the quiet one waits behind one noisy request (its share) and the running prefill: fits
    q = s.admit(of(work(clk, budget=1500), "quiet"), clk.now())
    assert isinstance(q, Enqueued), q
    assert q.ticket.projected_ttft_ms is not None and q.ticket.projected_ttft_ms < 400
    # and it is served second, not twenty-first
    e = s.engines["u0"]
    order = []
    while e.queue:
        order.append(e.queue.popleft().work.tenant)
    assert order[:2] in (["noisy", "quiet"], ["quiet", "noisy"])


def test_one_tenant_alone_sees_the_whole_queue_as_before() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1, b0=100, b1=0.0), queue_limit=100)
    for _ in range(5):
        s.admit(of(work(clk, budget=1e9), "solo"), clk.now())
    t = s.admit(of(work(clk, budget=1e9), "solo"), clk.now())
    assert isinstance(t, Enqueued) and t.ticket.projected_ttft_ms == 600.0


def test_a_full_queue_makes_the_tenant_furthest_over_its_share_yield() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1, b0=100, b1=0.0), queue_limit=4)
    s.admit(of(work(clk, budget=1e9), "noisy"), clk.now())  # running
    queued = [s.admit(of(work(clk, budget=1e9), "noisy"), clk.now()) for _ in range(4)]
    assert all(isinstance(q, Enqueued) for q in queued)
    # noisy again: the queue is full and it holds all of it: R11
    r = s.admit(of(work(clk, budget=1e9), "noisy"), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R11 and not s.evicted
    # quiet: under its share, so noisy's newest queued request yields its place
    q = s.admit(of(work(clk, budget=1e9), "quiet"), clk.now())
    assert isinstance(q, Enqueued)
    assert [(t.id, ref.row.id) for t, ref in s.evicted] == [(queued[-1].ticket.id, "R11")]  # type: ignore[union-attr]
    assert s.queued == 4 and queued[-1].ticket.state == "done"  # type: ignore[union-attr]
    s.evicted.clear()
    # a second quiet: 2 per weight against noisy's 3: noisy yields again; a third (3 vs 2) does not
    assert isinstance(s.admit(of(work(clk, budget=1e9), "quiet"), clk.now()), Enqueued) and len(s.evicted) == 1
    s.evicted.clear()
    r = s.admit(of(work(clk, budget=1e9), "quiet"), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R11 and not s.evicted


def test_weights_decide_the_share() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1, b0=100, b1=0.0), queue_limit=100)
    s.weights = lambda t: {"gold": 3.0}.get(t or "", 1.0)  # type: ignore[method-assign]
    s._roles()
    s.admit(of(work(clk, budget=1e9), "x"), clk.now())
    for i in range(8):
        s.admit(of(work(clk, budget=1e9), "gold" if i % 2 else "bronze"), clk.now())
    e = s.engines["u0"]
    first4 = [e.queue.popleft().work.tenant for _ in range(4)]
    assert first4.count("gold") == 3
