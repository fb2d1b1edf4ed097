"""An engine's lifecycle (spec/tables/lifecycle.yaml), sans-IO.

`Lifecycle.on(event, now)` applies the row TRANSITIONS[(state, event)] (a missing pair
is a bug: KeyError) and returns it; the authority (narwhal/authority/membership.py)
carries out its `action`. Nothing here reads a clock, sleeps or talks to an engine.

Invariants
  * Placement-eligible needs state `active` (R09 note): `placeable` is the one bit the
    scheduler's hot loop reads (`EngineState.draining` mirrors it).
  * `gone` is final for this object: a name that comes back is a new engine (M39, M40).
  * `identity` decides update against replace (M07 note): url, role, dialect, model and
    kv_events are who the engine is; the rest are settings changed in place.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from narwhal_generated import lifecycle as M

__all__ = ["Lifecycle", "STATES", "EVENTS", "ACTIONS", "CHANGES", "identity", "HISTORY"]

STATES = M.STATES
EVENTS = M.EVENTS
ACTIONS = M.ACTIONS
HISTORY = 16  # state changes remembered per engine, for /v1/engines
# what the fleet counts (/metrics narwhal_fleet_changes_total{change}; authority/membership.py)
CHANGES = ("join", "ready", "update", "leave", "cut", "gone", "drain_on", "drain_off")


def identity(spec: Any) -> tuple[Any, ...]:
    """Who an engine is (M07 note): a change of any of these is a replace, not an update."""
    return (spec.url, spec.role, spec.dialect, spec.model, spec.kv_events)


class Lifecycle:
    __slots__ = ("state", "since", "history")

    def __init__(self, state: str, now: float) -> None:
        if state not in STATES:
            raise ValueError(state)
        self.state = state
        self.since = now
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    @property
    def placeable(self) -> bool:
        return self.state == "active"

    def on(self, event: str, now: float) -> M.Transition:
        row = M.TRANSITIONS[(self.state, event)]
        if row.next != self.state:
            self.history.append({"at": round(now, 3), "from": self.state, "to": row.next, "event": event, "row": row.id})
            self.state = row.next
            self.since = now
        return row

    def snapshot(self, now: float) -> dict[str, Any]:
        return {"state": self.state, "since_s": round(now - self.since, 3), "history": list(self.history)}
