"""core/quota.py: per-tenant limits as token buckets and counts (rows R17-R19), with the
wait a refused request is told (Retry-After from the bucket)."""

from __future__ import annotations

import pytest

from narwhal.core.quota import DEFAULT, MAX_TENANTS, Bucket, Limits, Quotas, retry_after
from narwhal_generated import errors as E


def test_a_bucket_fills_at_its_rate_up_to_its_capacity() -> None:
    b = Bucket(2.0, 4.0, 0.0)
    assert b.wait_s(4, 0.0) == 0.0
    b.take(4, 0.0)
    assert b.wait_s(1, 0.0) == pytest.approx(0.5)
    assert b.wait_s(1, 0.5) == 0.0
    assert b.wait_s(100, 10.0) == 0.0  # more than a full bucket: a full one will do
    b.take(100, 10.0)
    assert b.level == -4.0  # overdrawn once, bounded
    assert b.wait_s(1, 10.0) == pytest.approx(2.5)
    b.refund(100)
    assert b.level == 4.0


@pytest.mark.parametrize(("s", "ra"), [(0.01, 1), (1.0, 1), (1.2, 2), (59.5, 60)])
def test_retry_after_rounds_up_and_is_at_least_one(s: float, ra: int) -> None:
    assert retry_after(s) == ra


def test_in_flight_and_rate_rows() -> None:
    q = Quotas({"a": Limits(max_in_flight=2, requests_per_s=10.0), DEFAULT: Limits(requests_per_s=1.0)})
    assert q.arrive("a", 0.0) is None and q.arrive("a", 0.0) is None
    assert q.arrive("a", 0.0) == (E.R17, 0.0)
    q.end("a", 0.0)
    assert q.arrive("a", 0.0) is None
    # an unconfigured tenant gets default's limits, in its own book
    assert q.arrive("zed", 0.0) is None
    row, wait = q.arrive("zed", 0.0)  # type: ignore[misc]
    assert row is E.R18 and wait == pytest.approx(1.0)
    assert q.arrive("zed", 1.0) is None
    assert q.arrive("other", 0.0) is None  # another unknown tenant: its own bucket
    assert q.weight("a") == 1.0 and q.limits_of(None) == q.default


def test_tokens_charge_the_prompt_then_the_output_and_refund_what_was_not_used() -> None:
    q = Quotas({"a": Limits(tokens_per_min=600)})  # 10 tokens/s, 600 in the bucket
    assert q.arrive("a", 0.0) is None
    assert q.charge_prompt("a", 500, 0.0) == 0.0
    assert q.charge_prompt("a", 200, 0.0) == pytest.approx(10.0)  # 100 left: 10 s until 200
    q.end("a", 0.0, charged_prompt=500, output_tokens=None)  # refused or failed: refunded
    assert q.charge_prompt("a", 200, 0.0) == 0.0
    q.end("a", 0.0, charged_prompt=200, output_tokens=450)  # output charged as counted
    assert q.books["a"].tokens.level == pytest.approx(-50.0)  # type: ignore[union-attr]
    assert q.charge_prompt("a", 10, 0.0) == pytest.approx(6.0)


def test_tenant_books_are_bounded() -> None:
    q = Quotas({})
    for i in range(MAX_TENANTS + 10):
        q.book(f"t{i}", 0.0)
    assert len(q.books) == MAX_TENANTS and "t0" not in q.books


# -- issue 40 item 5: no eviction gives anyone a fresh budget ---------------------------------

def _spend(q: Quotas, tenant: str, now: float) -> None:
    assert q.arrive(tenant, now) is None
    assert q.charge_prompt(tenant, 1000, now) == 0.0
    q.end(tenant, now, charged_prompt=1000, output_tokens=1000)  # 2,000 of 1,000: overdrawn


def test_a_configured_tenants_spent_budget_outlives_any_number_of_others() -> None:
    q = Quotas({"acme": Limits(tokens_per_min=1000), DEFAULT: Limits(tokens_per_min=1000)})
    _spend(q, "acme", 0.0)
    for i in range(MAX_TENANTS + 200):  # JWT subjects, within seconds
        q.book(f"sub{i}", 1.0 + i * 1e-3)
    assert q.charge_prompt("acme", 10, 6.0) > 0  # still spent: not a full bucket


def test_an_unconfigured_tenants_spent_budget_is_not_evicted_with_its_book() -> None:
    q = Quotas({DEFAULT: Limits(tokens_per_min=1000)})
    _spend(q, "t-spent", 0.0)
    for i in range(MAX_TENANTS + 200):
        q.book(f"sub{i}", 1.0)
    assert len(q.books) <= MAX_TENANTS
    assert q.charge_prompt("t-spent", 10, 6.0) > 0


def test_eviction_looks_past_a_book_with_requests_in_flight() -> None:
    q = Quotas({})
    assert q.arrive("busy", 0.0) is None  # the least recently seen, in flight
    for i in range(MAX_TENANTS * 2):
        q.book(f"t{i}", 0.0)
    assert len(q.books) <= MAX_TENANTS and "busy" in q.books
    q.end("busy", 1.0)
    assert q.books["busy"].in_flight == 0


def test_past_the_bound_new_tenants_share_one_budget_and_their_books_balance() -> None:
    q = Quotas({DEFAULT: Limits(tokens_per_min=600, max_in_flight=3)})
    for i in range(MAX_TENANTS):  # every book spent: none can go
        _spend(q, f"t{i}", 0.0)
    assert q.arrive("new-a", 0.0) is None and q.arrive("new-b", 0.0) is None
    assert "new-a" not in q.books and q.overflow is not None and q.overflow.in_flight == 2
    assert q.charge_prompt("new-a", 500, 0.0) == 0.0
    assert q.charge_prompt("new-b", 500, 0.0) > 0  # one budget for both: nobody got a fresh one
    assert q.arrive("new-c", 0.0) is None and q.arrive("new-d", 0.0) == (E.R17, 0.0)  # default's max_in_flight, shared
    for t in ("new-a", "new-b", "new-c"):
        q.end(t, 1.0)
    assert q.overflow.in_flight == 0 and q.in_overflow == {}
