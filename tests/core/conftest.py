"""Every scheduler a core test builds keeps the fair reserve's counts (admission.fair_reserve
0: counted, nothing reserved, the behaviour unchanged), and after the test they must agree
with the slots (core/fairness.py FairReserve invariants): per engine, the phase-1 slots
counted equal the requests holding one (a prefill engine's prefill slots, a unified
engine's decode slots), so every path these tests drive — dispatch, first token, prefill
done, failed attempts and their retry, migration, the end, reconcile, engine removal —
gives back exactly what it took."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.core.admission import Scheduler

_init = Scheduler.__init__


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "load_by_hand: the test sets an engine's slots in use itself (no ticket holds them): "
                            "the fair reserve's counts are checked to be at most the slots in use")


def held_agrees_with_slots(s: Scheduler, by_hand: bool = False) -> None:
    fair = s.fair
    assert fair is not None
    total = 0
    for e in s.engines.values():
        held = fair.held(e.name)
        assert all(n > 0 for n in held.values()), held
        total += sum(held.values())
        if e.role in ("unified", "prefill"):
            in_use = e.decode_in_use if e.role == "unified" else e.prefill_in_use
            assert sum(held.values()) <= in_use if by_hand else sum(held.values()) == in_use, (e.name, held, in_use)
        else:
            assert not held, (e.name, held)
    assert total == fair.holding()


@pytest.fixture(autouse=True)
def fair_counts_checked(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[Scheduler]]:
    made: list[Scheduler] = []

    def init(self: Scheduler, *args: Any, fair_reserve: float | None = None, **kw: Any) -> None:
        _init(self, *args, fair_reserve=0.0 if fair_reserve is None else fair_reserve, **kw)
        made.append(self)

    monkeypatch.setattr(Scheduler, "__init__", init)
    yield made
    by_hand = request.node.get_closest_marker("load_by_hand") is not None
    for s in made:
        if s.fair is not None:  # None: a test that turned counting off (no tenants), as the router does
            held_agrees_with_slots(s, by_hand)
