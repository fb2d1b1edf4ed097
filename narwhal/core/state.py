"""Router states (spec/tables/router_states.yaml).

The state is derived, never stored as one value: an operator setting (active/standby),
the leader election (`Election`: fenced, or standby while another router leads;
narwhal/core/leadership.py), the set of waves in maintenance, and the age of engine
health data. `reason(now)` returns the
first not-ready state in the table's order, or None when active.
"""

from __future__ import annotations

from typing import Protocol

from narwhal_generated import router_states as _s

__all__ = ["RouterState", "Election", "NoElection"]

_ORDER: tuple[str, ...] = _s.NOT_READY_PRECEDENCE


class Election(Protocol):
    """Whether this router may admit, as leader election says (core/leadership.py)."""

    def fenced(self, now: float) -> bool: ...

    def standby(self, now: float) -> bool: ...


class NoElection:
    """ha off: this router is its fleet's only authority."""

    __slots__ = ()

    def fenced(self, now: float) -> bool:
        return False

    def standby(self, now: float) -> bool:
        return False


class RouterState:
    __slots__ = ("operator", "election", "wave", "maintenance_waves", "stale_after", "_oldest_health", "draining")

    def __init__(self, *, wave: str | None, stale_after_s: float, election: Election | None = None) -> None:
        self.operator = "active"  # "active" | "standby" (S03)
        self.election: Election = election or NoElection()
        self.wave = wave
        self.maintenance_waves: set[str] = set()
        self.stale_after = stale_after_s
        self._oldest_health: float | None = None  # None: no engines to watch
        self.draining = False  # S06: SIGTERM received; never cleared (the process is stopping)

    def set_operator(self, state: str) -> None:
        if state not in ("active", "standby"):
            raise ValueError(state)
        self.operator = state

    def set_wave_maintenance(self, wave: str, on: bool) -> None:
        if on:
            self.maintenance_waves.add(wave)
        else:
            self.maintenance_waves.discard(wave)

    def health_observed(self, oldest_observation: float | None) -> None:
        """The time of the oldest engine's newest health observation."""
        self._oldest_health = oldest_observation

    def reasons(self, now: float) -> list[str]:
        held = {
            "draining": self.draining,
            "fenced": self.election.fenced(now),
            "standby": self.operator == "standby" or self.election.standby(now),
            "maintenance": self.wave is not None and self.wave in self.maintenance_waves,
            "monitoring_degraded": self._oldest_health is not None and now - self._oldest_health > self.stale_after,
        }
        return [s for s in _ORDER if held[s]]

    def operator_ready(self) -> bool:
        """No operator state holds this router (manual standby, its own wave in
        maintenance): it may campaign (spec/tables/leadership.yaml L09, L19, L40)."""
        return self.operator == "active" and not (self.wave is not None and self.wave in self.maintenance_waves)

    def reason(self, now: float) -> str | None:
        """R01: the first not-ready reason in precedence order, or None when active."""
        r = self.reasons(now)
        return r[0] if r else None
