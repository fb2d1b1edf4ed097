"""The scheduler's vocabulary: what admission knows of a request (`Work`), its place in
the scheduler (`Ticket`), and the scheduler's answers (`Dispatch`, `Enqueued`, `Refuse`).

A leaf module: it imports nothing of the fleet or the scheduler, so `fleet.py` (whose
engines hold queues of tickets) and `admission.py` both import it and neither imports the
other back (this cut the one import circle of the core).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from narwhal_generated import errors as E

__all__ = ["Work", "Ticket", "Dispatch", "Enqueued", "Refuse"]


@dataclass(frozen=True, slots=True)
class Work:
    """What admission knows of a request once sized."""

    route: str
    prompt_tokens: int
    max_tokens: int | None
    budget_ms: float
    arrival: float
    max_wait_s: float
    deadline_s: float | None  # relative to arrival
    # the prompt's prefix blocks (core/prefix.py) and the tokens one block stands for;
    # () when the prefix cache is not modelled
    prefix: tuple[int, ...] = ()
    block_tokens: float = 0.0
    token_prefix: tuple[int, ...] = ()  # the same over the prompt's token IDs (engines with KV events)
    tenant: str | None = None  # who it is for (auth; None: no identity): fair queueing, tenant rows
    only: frozenset[str] | None = None  # the engines it may be placed on (a gateway's subset hint); None: any


@dataclass(frozen=True, slots=True)
class Dispatch:
    ticket: Ticket
    engine: str
    phase: str  # "prefill" | "unified" | "decode"


@dataclass(frozen=True, slots=True)
class Enqueued:
    ticket: Ticket
    engine: str | None  # None: the shared decode queue


@dataclass(frozen=True, slots=True)
class Refuse:
    row: E.ErrorRow
    overrun_s: float | None = None
    fields: dict[str, object] = field(default_factory=dict)
    param: str | None = None  # a body row's param (R04, R06, R07: the check that fired names it)


_NONE: frozenset[str] = frozenset()  # no engine excluded (shared: a set per ticket is 216 bytes)


class Ticket:
    """One admitted request's place in the scheduler (mutable, owned by it)."""

    __slots__ = (
        "id", "work", "state", "engine", "decode_engine", "excluded", "enqueued_at", "waited",
        "pred_prefill_ms", "projected_ttft_ms", "depth", "prefill_dispatched_at",
        "decode_dispatched_at", "holds_prefill", "holds_decode", "pd_pending",
        "expected_cached", "prefill_sample", "decode_mark", "movable", "preempted",
    )

    def __init__(self, tid: int, work: Work) -> None:
        self.id = tid
        self.work = work
        # queued | prefill | unified | decode_queued | decode | done
        self.state = "new"
        self.engine: str | None = None
        self.decode_engine: str | None = None
        self.excluded: frozenset[str] | set[str] = _NONE  # engines this ticket may not go to again (exclude())
        self.enqueued_at: float | None = None
        self.waited = 0.0  # seconds spent in the admission queue so far
        self.pred_prefill_ms = 0.0
        self.projected_ttft_ms: float | None = None
        self.depth = 0
        self.prefill_dispatched_at: float | None = None
        self.decode_dispatched_at: float | None = None
        self.holds_prefill: str | None = None
        self.holds_decode: str | None = None
        self.pd_pending = False  # counted in Scheduler.pd_pending (P/D backpressure)
        self.expected_cached = 0.0  # prompt tokens its phase-1 engine is expected to hold cached
        self.prefill_sample: tuple[str, float] | None = None  # (engine, service ms), learned at close
        # (the decode engine's EngineState, its decode_area_at, the time) at the first token:
        # the start of the span its TPOT is measured over (EngineState.mean_decode_batch)
        self.decode_mark: tuple[object, float, float] | None = None
        # fair preemption (core/preempt.py): past its first token, its decode leg can be
        # carried on (the data plane said so); and the engine it was asked to leave for a
        # lighter tenant's request (set once: a request is preempted at most once)
        self.movable = False
        self.preempted: str | None = None

    def exclude(self, engine: str) -> None:
        """`engine` failed this ticket: it may not place it again."""
        if type(self.excluded) is frozenset:
            self.excluded = set(self.excluded)
        self.excluded.add(engine)  # type: ignore[union-attr]

    @property
    def waiting(self) -> bool:
        return self.state in ("queued", "decode_queued")
