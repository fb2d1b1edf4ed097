"""R02 with tenants (issue 40 item 6), at the door: the place a yielded request held in
the HTTP retention is handed to the arrival at once, so `held` never exceeds
admission.http_retention_limit (it was one over until the yielded request ended)."""

from __future__ import annotations

import pytest

from narwhal.authority.authority import Authority
from narwhal.authority.door import LocalDoor, LocalEntry, LocalLease
from narwhal.config import parse_config
from narwhal.core.clock import ManualClock
from narwhal.core.lease import Order
from narwhal.core.tickets import Refuse
from narwhal.upstream.engines import EngineSpec

LIMIT = 3


def authority() -> Authority:
    cfg = parse_config({
        "admission": {"mode": "open", "http_retention_limit": LIMIT, "queue_limit": 64,
                      "prediction": {"profile_on_start": False}},
        "tenants": {"noisy": {"weight": 1}, "quiet": {"weight": 1}},
    })
    return Authority(cfg, [EngineSpec("u0", "http://127.0.0.1:9", "unified", "vllm", None, None, max_concurrency=1)], clock=ManualClock(0.0))


def offer(a: Authority, tenant: str) -> tuple[LocalEntry, LocalLease | Refuse]:
    e = LocalDoor(a).arrive_now(a.clock.now(), None, tenant)
    assert isinstance(e, LocalEntry), e
    return e, e.admit_now(Order("chat", 400, None, 8, 1e9, a.clock.now(), None, tenant=tenant))


@pytest.mark.parametrize("quiet_ends_first", [True, False])
def test_a_yielded_place_is_handed_on_at_once_held_never_over_the_limit(quiet_ends_first: bool) -> None:
    a = authority()
    noisy = [offer(a, "noisy") for _ in range(LIMIT)]  # one runs, two wait: the retention is full
    assert a.held == LIMIT and a.scheduler.queued == LIMIT - 1
    assert isinstance(LocalDoor(a).arrive_now(0.0, None, "noisy"), Refuse)  # noisy at its share: R02 stands
    quiet, lease = offer(a, "quiet")  # under its share: noisy's newest queued request yields
    assert isinstance(lease, LocalLease)
    assert a.held == LIMIT  # the fix: was LIMIT + 1 until the yielded request ended
    yielded_entry, yielded_lease = noisy[-1]
    assert isinstance(yielded_lease, LocalLease) and yielded_lease.t.state == "done" and not yielded_entry.held
    order = [quiet, yielded_entry] if quiet_ends_first else [yielded_entry, quiet]
    order[0].end("completed" if order[0] is quiet else "rejected")
    assert a.held == LIMIT - 1 if quiet_ends_first else a.held == LIMIT
    order[1].end("completed" if order[1] is quiet else "rejected")
    for e, _ in noisy[:-1]:
        e.end("completed")
    assert a.held == 0 and not a.retained
    b = a.books.snapshot()
    assert b["terminal"]["rejected"] == 2  # the noisy arrival refused R02, and the one that yielded


def test_held_stays_within_the_limit_over_a_long_interleaving() -> None:
    """Arrivals of both tenants, ends in between: `held` is at most the limit after every step."""
    a = authority()
    live: list[LocalEntry] = []
    for i in range(60):
        tenant = "quiet" if i % 3 == 0 else "noisy"
        e = LocalDoor(a).arrive_now(a.clock.now(), None, tenant)
        if isinstance(e, LocalEntry):
            e.admit_now(Order("chat", 400, None, 8, 1e9, a.clock.now(), None, tenant=tenant))
            live.append(e)
        assert a.held <= LIMIT
        if i % 4 == 3 and live:  # the oldest ends (a running one, or one that yielded)
            live.pop(0).end("completed")
            assert a.held <= LIMIT
    for e in live:
        e.end("completed")
    assert a.held == 0 and not a.retained
