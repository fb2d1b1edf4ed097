"""The router's threat model, tenant books (issue 40 item 5): an attacker who can mint
tenant names (JWT subjects, keys of many tenants) must not be able to refill a tenant's
spent budget by pushing its book out of the bounded books.

The attack as found: a tenant spent its tokens_per_min, then 4,200 other tenants arrived
within 6 s, and the spent tenant was served again on a full bucket. Driven through the
same Quotas the authority's door uses (core/quota.py; the HTTP path is
tests/tenants/test_quota_http.py)."""

from __future__ import annotations

import pytest

from narwhal.core.quota import DEFAULT, MAX_TENANTS, Limits, Quotas


@pytest.mark.parametrize("victim", ["acme", "sub-victim"], ids=["configured", "not configured"])
def test_4200_new_tenants_do_not_refill_a_spent_budget(victim: str) -> None:
    q = Quotas({"acme": Limits(tokens_per_min=6000), DEFAULT: Limits(tokens_per_min=6000)})
    assert q.arrive(victim, 0.0) is None
    assert q.charge_prompt(victim, 6000, 0.0) == 0.0
    q.end(victim, 0.5, charged_prompt=6000, output_tokens=3000)
    for i in range(4200):  # 700 a second for 6 s
        t = 1.0 + i / 700
        if q.arrive(f"sub-{i}", t) is None:
            q.end(f"sub-{i}", t)
    wait = q.charge_prompt(victim, 100, 7.0)
    assert wait > 20  # still overdrawn (24 s to go), not a full bucket
    assert len(q.books) <= MAX_TENANTS + 1
