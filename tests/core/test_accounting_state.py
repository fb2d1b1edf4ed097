"""The books (C01, C02, K01-K08) and router states (S01-S05)."""

from __future__ import annotations

import pytest

from narwhal.core.accounting import TERMINAL_CLASSES, Books
from narwhal.core.state import RouterState


def test_C01_C02_K01_to_K08_books_balance_over_every_class_and_count_unsized() -> None:
    b = Books()
    es = [b.offer() for _ in range(len(TERMINAL_CLASSES))]
    for e, cls in zip(es, TERMINAL_CLASSES, strict=True):
        if cls not in ("invalid_requests",):
            b.sized(e)
        b.end(e, cls)
    assert b.balanced()
    assert b.unsized_offered == 1
    assert b.offered == len(TERMINAL_CLASSES)


def test_K01_K07_a_request_ends_in_exactly_one_class() -> None:
    b = Books()
    e = b.offer()
    b.end(e, "completed")
    b.end(e, "failed")
    assert b.terminal["completed"] == 1 and b.terminal["failed"] == 0 and b.double_ends == 1
    assert not b.balanced()


def test_books_reject_unknown_class() -> None:
    with pytest.raises(ValueError):
        Books().end(Books().offer(), "lost")


def test_S01_active_by_default() -> None:
    s = RouterState(wave="a", stale_after_s=3.0)
    assert s.reason(0.0) is None


class _Fenced:
    def fenced(self, now: float) -> bool:
        return True

    def standby(self, now: float) -> bool:
        return False


def test_S02_S03_S04_S05_states_and_their_precedence() -> None:
    s = RouterState(wave="a", stale_after_s=3.0)
    s.health_observed(0.0)
    assert s.reason(5.0) == "monitoring_degraded"  # S05
    s.set_wave_maintenance("a", True)
    assert s.reason(5.0) == "maintenance"  # S04
    s.set_operator("standby")
    assert s.reason(5.0) == "standby"  # S03
    s.election = _Fenced()
    assert s.reason(5.0) == "fenced"  # S02
    assert s.reasons(5.0) == ["fenced", "standby", "maintenance", "monitoring_degraded"]


def test_S04_other_waves_do_not_stop_the_router() -> None:
    s = RouterState(wave="a", stale_after_s=3.0)
    s.set_wave_maintenance("b", True)
    assert s.reason(0.0) is None
    assert RouterState(wave=None, stale_after_s=1).reason(0.0) is None
