"""The router's view of each engine: eligibility, slots, queues and what it has learned.

Eligible (R09 note) = healthy, lifecycle active (spec/tables/lifecycle.yaml: not joining,
not drained by the operator, not leaving), its wave not in maintenance, circuit breaker
closed, role fits the phase. `ineligible_reasons` names every reason that holds, for
/v1/engines: `joining`, `draining` (the operator's drain, or leaving the fleet).

Circuit breaker: `breaker_failures` consecutive failures (health polls or requests) open
it; it stays open for `breaker_cooldown` seconds and closes on the first successful health
poll after that (half-open in between). A success before the threshold resets the count.
"""

from __future__ import annotations

from typing import Any

from .fairness import FairQueue
from .lifecycle import Lifecycle
from .prediction import DecodeModel, LinearModel, PrefillModel

__all__ = ["EngineState", "Breaker", "PHASE1_ROLES"]

PHASE1_ROLES = ("prefill", "unified")


class Breaker:
    __slots__ = ("threshold", "cooldown", "failures", "opened_at", "opens")

    def __init__(self, threshold: int = 3, cooldown_s: float = 5.0) -> None:
        self.threshold, self.cooldown = threshold, cooldown_s
        self.failures = 0
        self.opened_at: float | None = None
        self.opens = 0

    @property
    def open(self) -> bool:
        return self.opened_at is not None

    def failure(self, now: float) -> bool:
        """Record a failure; True when this one opened the breaker."""
        self.failures += 1
        if self.opened_at is None and self.failures >= self.threshold:
            self.opened_at = now
            self.opens += 1
            return True
        return False

    def success(self, now: float, *, probe: bool) -> bool:
        """Record a success; a health probe after the cooldown closes an open breaker.
        True when the breaker closed."""
        self.failures = 0
        if self.opened_at is not None and probe and now - self.opened_at >= self.cooldown:
            self.opened_at = None
            return True
        return False

    def snapshot(self) -> dict[str, Any]:
        return {"open": self.open, "consecutive_failures": self.failures, "opens": self.opens}


class EngineState:
    """One engine. Mutated only by the scheduler, the health monitor and the profiler."""

    def __init__(
        self,
        name: str,
        url: str,
        *,
        role: str,
        dialect: str,
        wave: str | None = None,
        model: str | None = None,
        prefill_slots: int = 4,
        decode_slots: int = 64,
        breaker: Breaker | None = None,
        max_concurrency: int | None = None,
        lifecycle: str = "active",
        now: float = 0.0,
        source: str = "config",
    ) -> None:
        self.name, self.url, self.role, self.dialect = name, url, role, dialect
        self.wave, self.model = wave, model
        # health
        self.healthy = True
        self.last_observed: float | None = None
        self.last_error: str | None = None
        # spec/tables/lifecycle.yaml; `draining` mirrors "not placeable" for the
        # scheduler's hot loop (membership.py keeps the two in step)
        self.lifecycle = Lifecycle(lifecycle, now)
        self.draining = not self.lifecycle.placeable
        self.source = source  # who named it: config, admin, file, etcd
        self.pending: object | None = None  # M31: the spec that joins once this one is gone
        self.leave_by: float | None = None  # M12: the drain timer's deadline
        self.breaker = breaker or Breaker()
        # slots and queues
        self.prefill_slots, self.decode_slots = prefill_slots, decode_slots
        self.max_concurrency = max_concurrency  # engines[].max_concurrency (slots are capped by it)
        self.prefill_in_use = 0
        self.decode_in_use = 0  # changed only through decode_moved (it keeps decode_area)
        # the integral of decode_in_use over time up to decode_seen_at (sequence-seconds):
        # a request's TPOT is measured over its whole decode, so the batch its residual is
        # scored at is this integral's mean over that span (docs/prediction.md section 8, B_k),
        # not the batch left at its close (mean_decode_batch)
        self.decode_area = 0.0
        self.decode_seen_at = 0.0
        # requests the engine itself reports running or waiting that this router did not
        # place (after a take-over: the previous leader's; authority/load.py): they hold
        # the engine's slots as surely as our own until the engine reports them gone
        self.external = 0
        # phase-1 waiters placed on this engine, served by tenant weight (core/fairness.py;
        # FIFO when one tenant queues)
        self.queue: FairQueue = FairQueue()
        self.queued_work_ms = 0.0
        self.busy_until = 0.0  # projected end of the dispatched prefill backlog
        self.inflight_prefill: dict[int, float] = {}  # ticket id -> predicted ms
        self.last_prefill_done = 0.0
        # learned
        self.prefill = PrefillModel()
        self.decode = DecodeModel()
        # transfer + the decode engine's first token, by prompt length (P/D only)
        self.start_model = LinearModel([10.0, 1.0])
        self.profile_status = "pending"
        self.profile_attempted: float | None = None  # when profiling last started
        self.profile_error: str | None = None
        self.profile_failures = 0  # consecutive failed profiles (the retry backs off)
        self.profile_reported: str | None = None  # the last outcome logged: "ok" | "failed"
        self.profile_samples: dict[str, Any] = {}
        self.completed = 0
        self.failed = 0

    # -- eligibility -------------------------------------------------------------------

    def ineligible_reasons(self, maintenance_waves: set[str]) -> list[str]:
        out = []
        if not self.healthy:
            out.append("unhealthy")
        if self.draining:
            out.append("joining" if self.lifecycle.state == "joining" else "draining")
        if self.wave is not None and self.wave in maintenance_waves:
            out.append("wave_maintenance")
        if self.breaker.open:
            out.append("circuit_open")
        return out

    def eligible(self, maintenance_waves: set[str]) -> bool:
        return (
            self.healthy
            and not self.draining
            and not self.breaker.open
            and (self.wave is None or self.wave not in maintenance_waves)
        )

    # -- capacity ------------------------------------------------------------------------

    def holds_nothing(self) -> bool:
        """No request holds a slot or waits in a queue here (lifecycle idle, M29)."""
        return not (self.prefill_in_use or self.decode_in_use or self.queue or self.inflight_prefill)

    def phase1_free(self) -> bool:
        """A phase-1 slot: prefill for a prefill engine; prefill and decode for a unified one."""
        if self.prefill_in_use + (self.external if self.role == "prefill" else 0) >= self.prefill_slots:
            return False
        return self.role != "unified" or self.decode_in_use + self.external < self.decode_slots

    def decode_moved(self, now: float, delta: int) -> None:
        """decode_in_use += delta at `now`, the batch integral kept up to date (a `now`
        earlier than the last change adds nothing: the integral never runs backwards)."""
        if now > self.decode_seen_at:
            self.decode_area += self.decode_in_use * (now - self.decode_seen_at)
            self.decode_seen_at = now
        self.decode_in_use += delta

    def decode_area_at(self, now: float) -> float:
        """The batch integral up to `now` (sequence-seconds)."""
        return self.decode_area + self.decode_in_use * max(0.0, now - self.decode_seen_at)

    def mean_decode_batch(self, mark: tuple[object, float, float] | None, now: float) -> float:
        """The mean decode batch here from `mark` (this engine, its decode_area_at, the
        time; taken at a request's first token) to `now`: the batch its measured TPOT ran
        at. Without a mark of this engine's, or over no time, the batch now; at least 1."""
        if mark is not None and mark[0] is self and now > mark[2]:
            return max(1.0, (self.decode_area_at(now) - mark[1]) / (now - mark[2]))
        return float(max(1, self.decode_in_use))

    def decode_free(self) -> bool:
        return self.decode_in_use + self.external < self.decode_slots

    def backlog_ms(self, now: float) -> float:
        """Predicted prefill work ahead of a new request here (docs/prediction.md section 3)."""
        return max(0.0, (self.busy_until - now) * 1000.0) + self.queued_work_ms

    def depth(self) -> int:
        return len(self.inflight_prefill) + len(self.queue)

    def joining_batch(self) -> int:
        """Unified engine: the decode batch a request placed here now would join (the
        running sequences, those queued ahead of it, and itself; docs/prediction.md section 6)."""
        return self.decode_in_use + self.external + len(self.queue) + 1

    def decode_start_ms(self, n: float) -> float:
        return self.start_model.predict([1.0, n / 1000.0])

    def load_snapshot(self, now: float) -> dict[str, Any]:
        return {
            "prefill_in_use": self.prefill_in_use,
            "prefill_slots": self.prefill_slots,
            "decode_in_use": self.decode_in_use,
            "external": self.external,
            "decode_slots": self.decode_slots,
            "queued": len(self.queue),
            "backlog_ms": round(self.backlog_ms(now), 3),
            "completed": self.completed,
            "failed": self.failed,
        }
