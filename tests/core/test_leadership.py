"""The leader-election state machine (spec/tables/leadership.yaml, core/leadership.py):
total over states x events, each row's effect, and the fencing invariant as a property."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.core.leadership import EVENTS, ROUTER_STATE, STATES, Leadership
from narwhal.core.state import RouterState
from narwhal_generated import leadership as L

TTL, MARGIN = 3.0, 0.5


def _in(state: str, now: float = 100.0) -> Leadership:
    le = Leadership(margin_s=MARGIN)
    if state in ("leader", "fenced"):
        le.on("won", now, token=7, lease=11, sent_at=now, ttl_s=TTL)
        le.took_over()
    if state == "fenced":
        le.on("deadline", now + TTL)
    if state == "paused":
        le.on("operator_off", now)
    assert le.state == state
    return le


def test_the_table_is_total_and_every_state_and_event_is_named() -> None:
    assert set(STATES) == {"candidate", "leader", "fenced", "paused"}
    assert len(L.ROWS) == len(STATES) * len(EVENTS)
    for s in STATES:
        for e in EVENTS:
            assert (s, e) in L.TRANSITIONS, (s, e)
    assert set(ROUTER_STATE) == set(STATES)


@pytest.mark.parametrize("row", L.ROWS, ids=lambda r: f"{r.id}-{r.state}-{r.event}")
def test_each_row_moves_the_machine_to_its_next_state(row: L.Transition) -> None:
    le = _in(row.state)
    kw = {"token": 9, "lease": 12, "sent_at": 101.0, "ttl_s": TTL} if row.event in ("won", "renewed") else {}
    got = le.on(row.event, 101.0, **kw)  # type: ignore[arg-type]
    assert got is row and le.state == row.next


def test_an_unknown_pair_is_a_bug() -> None:
    with pytest.raises(KeyError):
        Leadership(margin_s=MARGIN).on("no_such_event", 0.0)


def test_the_leader_is_fenced_from_its_deadline_on_even_before_the_event() -> None:
    le = _in("leader", now=100.0)  # confirmed at 100 with TTL 3: fence at 102.5
    assert le.admitting(102.49) and not le.fenced(102.49)
    assert le.fenced(102.5) and not le.admitting(102.5)  # the timer has not fired yet: no admission anyway
    s = RouterState(wave=None, stale_after_s=60.0, election=le)
    assert s.reason(102.5) == "fenced"


def test_a_renewal_extends_from_its_send_time_never_backwards() -> None:
    le = _in("leader", now=100.0)
    le.on("renewed", 101.0, sent_at=101.0, ttl_s=TTL)
    assert le.fence_at == pytest.approx(103.5)
    le.on("renewed", 101.2, sent_at=100.5, ttl_s=TTL)  # an older renewal's answer arriving late
    assert le.fence_at == pytest.approx(103.5)


def test_a_renewal_confirmed_after_fencing_does_not_unfence() -> None:
    le = _in("fenced")
    le.on("renewed", 200.0, sent_at=199.0, ttl_s=TTL)  # L23
    assert le.fenced(200.0) and not le.admitting(200.0)


def test_taking_over_is_standby_until_done() -> None:
    le = Leadership(margin_s=MARGIN)
    le.on("won", 0.0, token=3, lease=1, sent_at=0.0, ttl_s=TTL)
    assert le.standby(0.1) and not le.admitting(0.1)
    le.took_over()
    assert le.admitting(0.1) and not le.standby(0.1)


_EVENT = st.sampled_from(EVENTS)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_EVENT, st.floats(0.0, 2.0), st.floats(0.0, 1.0)), max_size=40))
def test_admitting_only_inside_a_confirmed_lease(steps: list[tuple[str, float, float]]) -> None:
    """Whatever the events and their timing: this router admits at `now` only if a grant
    or renewal sent at t with TTL ttl was confirmed and now < t + ttl - margin (so before
    etcd can expire that lease and elect another)."""
    le = Leadership(margin_s=MARGIN)
    now = 0.0
    confirmed: float | None = None  # the latest sent_at + ttl confirmed while leader
    for event, dt, lag in steps:
        now += dt
        sent = now - lag  # the call was sent `lag` before its answer
        kw = {"token": 1, "lease": 1, "sent_at": sent, "ttl_s": TTL} if event in ("won", "renewed") else {}
        before = le.state
        row = le.on(event, now, **kw)  # type: ignore[arg-type]
        if row.next != "leader":
            confirmed = None
        elif event == "won" and before != "leader":
            confirmed = sent + TTL
            le.took_over()
        elif event == "renewed" and before == "leader":
            confirmed = max(confirmed or 0.0, sent + TTL)
        for probe in (now, now + 0.25, now + 1.0, now + 3.0):
            if le.admitting(probe):
                assert confirmed is not None and probe < confirmed - MARGIN
