"""core/quota_state.py: the tenants' bucket levels a leader hands on to the next one."""

from __future__ import annotations

import json

import pytest

from narwhal.core import quota_state
from narwhal.core.quota import Limits, Quotas
from narwhal_generated import errors as E

LIMITS = {"a": Limits(requests_per_s=2.0, tokens_per_min=600), "b": Limits(requests_per_s=1.0), "default": Limits(tokens_per_min=60)}


def spent() -> Quotas:
    q = Quotas(LIMITS)
    for _ in range(2):
        assert q.arrive("a", 0.0) is None
    assert q.charge_prompt("a", 300, 0.0) == 0.0
    assert q.arrive("b", 0.0) is None
    assert q.arrive("stranger", 0.0) is None  # default's limits: a token bucket only, full
    return q


def test_only_buckets_that_are_not_full_are_carried_configured_first() -> None:
    q = spent()
    assert quota_state.levels(q, 0.0) == {"a": [0.0, 300.0], "b": [0.0, None]}
    assert quota_state.levels(q, 10.0) == {"a": [None, 400.0]}
    assert quota_state.levels(q, 30.0) == {}  # everything refilled: nothing to carry


def test_a_new_leader_restores_the_levels_filled_for_the_gap() -> None:
    data = quota_state.export(spent(), 0.0, wall=1000.0)
    new = Quotas(LIMITS)
    assert quota_state.restore(new, data, now=50.0, wall=1000.25) == 2
    # a: requests bucket 0 + 0.25 s x 2/s; tokens 300 + 0.25 s x 10/s
    assert new.arrive("a", 50.0) == (E.R18, pytest.approx(0.25))
    assert new.charge_prompt("a", 400, 50.0) == pytest.approx((400 - 302.5) / 10.0)
    assert new.arrive("b", 50.0) == (E.R18, pytest.approx(0.75))
    assert new.arrive("c", 50.0) is None  # not carried: a fresh, full bucket


def test_without_the_hand_on_a_take_over_would_grant_a_second_burst() -> None:
    new = Quotas(LIMITS)
    assert new.arrive("a", 50.0) is None and new.arrive("a", 50.0) is None  # the burst the carry prevents


def test_a_tenant_not_carried_gets_full_buckets_even_in_a_router_that_led_before() -> None:
    q = spent()  # this router's own books from an earlier term: a and b spent
    data = quota_state.export(Quotas(LIMITS), 0.0, wall=5.0)  # the last leader had them full
    assert quota_state.restore(q, data, now=0.0, wall=5.0) == 0
    assert q.arrive("a", 0.0) is None and q.arrive("b", 0.0) is None


@pytest.mark.parametrize("data", [b"", b"not json", b"[]", b'{"v": 2, "tenants": {}}', b'{"v": 1}', b"x" * (quota_state.MAX_BYTES + 1)])
def test_bytes_that_do_not_parse_restore_nothing(data: bytes) -> None:
    q = spent()
    assert quota_state.restore(q, data, now=0.0, wall=0.0) == -1
    assert q.arrive("a", 0.0) == (E.R18, pytest.approx(0.5))  # unchanged


@pytest.mark.parametrize("level", [1e12, -1e12, "9", None, True, float("nan")])
def test_a_restored_level_stays_within_the_bucket_whatever_the_bytes_hold(level: object) -> None:
    q = Quotas(LIMITS)
    body = json.dumps({"v": 1, "at": 0, "tenants": {"a": [level, level], "junk": "x", "b": [1, 2, 3]}}).encode()
    assert quota_state.restore(q, body, now=0.0, wall=0.0) == 1
    b = q.books["a"]
    assert b.requests is not None and b.tokens is not None
    assert -b.requests.capacity <= b.requests.level <= b.requests.capacity
    assert -b.tokens.capacity <= b.tokens.level <= b.tokens.capacity


def test_the_encoding_is_bounded() -> None:
    q = Quotas({"default": Limits(requests_per_s=1.0)})
    for i in range(quota_state.MAX_CARRIED + 50):
        q.arrive(f"t{i}", 0.0)
    carried = quota_state.levels(q, 0.0)
    assert len(carried) == quota_state.MAX_CARRIED
    assert f"t{quota_state.MAX_CARRIED + 49}" in carried and "t0" not in carried  # the most recently seen
    assert len(quota_state.export(q, 0.0, 0.0)) < quota_state.MAX_BYTES
