"""Router states (spec/tables/router_states.yaml).

The state is derived, never stored as one value: an operator setting (active/standby),
an authority flag (fenced: set by a future leader election through `Authority`), the set
of waves in maintenance, and the age of engine health data. `reason(now)` returns the
first not-ready state in the table's order, or None when active.
"""

from __future__ import annotations

from typing import Protocol

from narwhal_generated import router_states as _s

__all__ = ["RouterState", "Authority", "StaticAuthority"]

_ORDER: tuple[str, ...] = _s.NOT_READY_PRECEDENCE


class Authority(Protocol):
    """Whether this router may admit. Leader election implements this later."""

    def fenced(self) -> bool: ...


class StaticAuthority:
    __slots__ = ("is_fenced",)

    def __init__(self) -> None:
        self.is_fenced = False

    def fenced(self) -> bool:
        return self.is_fenced


class RouterState:
    __slots__ = ("operator", "authority", "wave", "maintenance_waves", "stale_after", "_oldest_health")

    def __init__(self, *, wave: str | None, stale_after_s: float, authority: Authority | None = None) -> None:
        self.operator = "active"  # "active" | "standby" (S03)
        self.authority: Authority = authority or StaticAuthority()
        self.wave = wave
        self.maintenance_waves: set[str] = set()
        self.stale_after = stale_after_s
        self._oldest_health: float | None = None  # None: no engines to watch

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
            "fenced": self.authority.fenced(),
            "standby": self.operator == "standby",
            "maintenance": self.wave is not None and self.wave in self.maintenance_waves,
            "monitoring_degraded": self._oldest_health is not None and now - self._oldest_health > self.stale_after,
        }
        return [s for s in _ORDER if held[s]]

    def reason(self, now: float) -> str | None:
        """R01: the first not-ready reason in precedence order, or None when active."""
        r = self.reasons(now)
        return r[0] if r else None
