"""The one door between the data plane and the admission authority (issue 13, step 0).

The data plane (narwhal/worker: one request's bytes) sees admission only through two
objects per request, and these are their whole vocabulary:

  * `Door.arrive(at, denied)` -> `Entry | Refuse`: the request is offered (C01, the
    books) and the refusal table is walked (core/refusals.py) over the head-stage rows,
    in its order, until a row of a later stage: R01 (router not ready), `denied` (the
    data plane's own verdict on the request head, R15/R16: identity is checked in the
    data plane, narwhal/tenants), the tenant's rows (R17 in flight, R18 request rate:
    `tenant`, when tenants are configured), R02 (retention full). A refused arrival's
    books are closed in its class and it took nothing.
  * `Entry.arrived()` -> `Refuse | None`: the arrival's decision when `arrive` returned
    before it was known (over IPC the worker sends Arrive and reads the body meanwhile):
    R01, `denied` or R02 with the books already closed, or None (offered and held). The data plane
    awaits it before it answers anything else, so the rows keep their precedence.
  * `Entry.admit(order, body)` -> `Lease | Refuse`: the walk goes on from where the
    arrival's stopped, over the body rows that hold (`body`: the data plane's checks,
    R03-R07; `order` None when the body could not be parsed) and the admission rows over
    the sized request (R19, R08-R11, R20, R14), then places it on a phase-1 engine
    (granted or queued); an arrival refused meanwhile comes back as its Refuse. `Entry.end(cls)` closes the books (exactly one terminal class per
    offered request) and anything still held.
  * `Lease`: one admitted request's place in the fleet:
      granted()            the phase-1 grant (at once, or after a queue wait: R12/R13 expiry
                           comes back as a `Refuse` with its fields),
      prefill_done(ok)     a P/D request's prefill leg ended (frees the prefill slot),
      decode_slot()        a P/D request's decode slot (may wait, R12/R13 as above),
      first_token(at)      the client's first token (learning; frees a unified prefill slot),
      retry(engine, row)   a decode attempt failed before response headers (T05): the
                           failure is the engine's, and another engine, if any, is granted,
      close(outcome)       the request ended: free its slots and learn from the outcome.

A gateway's picker (narwhal/gateway) also uses `Rerouting`, the in-process lease's
fallback list and its move to the engine the gateway served (core/reroute.py); an
`Order.only` restricts a request's placement to a gateway's subset hint.

Implementations: `narwhal.authority.door` in one process (the authority's objects, called
directly) and `narwhal.worker.remote` over the IPC channel (narwhal/ipc.py) to the
authority process, with the same semantics: one code path.

Timestamps (`at`) are the data plane's clock; over IPC every process reads the same
system-wide monotonic clock, so the authority learns from the worker's instants, not from
when a message reached it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from narwhal_generated import errors as E

from .tickets import Refuse

__all__ = ["Grant", "Order", "Outcome", "Lease", "Rerouting", "Entry", "Door", "Controls"]


@dataclass(frozen=True, slots=True)
class Grant:
    """A slot on an engine: where the data plane sends this leg."""

    engine: str
    phase: str  # "prefill" | "unified" | "decode"


@dataclass(frozen=True, slots=True)
class Order:
    """What the data plane knows of a parsed request, for sizing and admission."""

    route: str
    prompt_bytes: int
    exact_prompt_tokens: int | None  # token-ID prompt or serving.tokenizer: exact; else estimated by the authority
    max_tokens: int | None
    budget_ms: float  # the TTFT budget (x-narwhal-ttft-target-ms or admission.ttft_budget_ms)
    arrival: float
    deadline_s: float | None  # x-narwhal-deadline-ms, relative to arrival
    prefix: tuple[int, ...] = ()  # the prompt's prefix-cache blocks (core/prefix.py), () when not modelled
    token_prefix: tuple[int, ...] = ()  # the same over its token IDs, for engines with KV events
    tenant: str | None = None  # auth: the tenant the request acts for (narwhal/tenants); None without auth
    key_id: str | None = None  # auth: the id of its key (never the key)
    # the engines it may be placed on (a gateway's subset hint, x-gateway-destination-endpoint-subset);
    # None: any
    only: frozenset[str] | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """How an admitted request ended, for the engine's breaker and the learners."""

    at: float
    ok_engine: str | None = None  # the engine that completed it (breaker success)
    failed_engine: str | None = None  # the engine whose failure ended it (E04, E06, E07 count for the breaker)
    failed_row: E.ErrorRow | None = None
    tpot_s: float | None = None  # measured from token arrivals (decode model)
    tpot_engine: str | None = None
    output_tokens: int | None = None  # None: the relay never finished (nothing to learn)
    finish_reason: str | None = None
    reported_prompt_tokens: int | None = None  # an engine's (or its tokenizer's) count: the sizer learns from it
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens of the phase-1 engine, when reported


class Lease(Protocol):
    prompt_tokens: int  # as sized by the authority (exact or estimated)
    projected_ttft_ms: float | None  # predictive mode: the projection admission used
    expected_cached: float  # prompt tokens its phase-1 engine is expected to hold in its prefix cache

    async def granted(self) -> Grant | Refuse: ...

    def prefill_done(self, at: float, *, ok: bool) -> None: ...

    async def decode_slot(self) -> Grant | Refuse: ...

    @property
    def key(self) -> int:  # what a preemption's fact names (core/preempt.py): unique in its data plane
        ...

    def first_token(self, at: float, movable: bool = False) -> None: ...

    async def retry(self, engine: str, row: E.ErrorRow, phase: str, at: float) -> Grant | Refuse | None: ...

    def close(self, outcome: Outcome) -> None: ...


@runtime_checkable
class Rerouting(Protocol):
    """A lease a gateway can route with fallbacks (core/reroute.py): the authority's own,
    in process (the endpoint picker needs serving.workers: 1)."""

    def fallbacks(self, n: int) -> tuple[str, ...]: ...

    def served(self, engine: str, at: float) -> bool: ...


class Entry(Protocol):
    async def arrived(self) -> Refuse | None: ...

    async def admit(self, order: Order | None, body: tuple[Refuse, ...] = ()) -> Lease | Refuse: ...

    def end(self, cls: str) -> None: ...


class Door(Protocol):
    async def arrive(self, at: float, denied: Refuse | None = None, tenant: str | None = None) -> Entry | Refuse: ...


class Controls(Protocol):
    """The authority's operations (the admin API) and read models (/ready, /v1/engines,
    /metrics), as every data plane reaches them: the same answers from any worker."""

    async def ready(self) -> tuple[int, dict[str, object]]: ...

    async def engines(self, sizing: dict[str, object]) -> dict[str, object]: ...

    async def metrics(self) -> bytes: ...

    async def set_state(self, state: str) -> str: ...

    async def set_wave(self, wave: str, on: bool) -> None: ...

    async def drain(self, engine: str, on: bool) -> None: ...

    async def profile(self, engine: str) -> str: ...

    async def put_engine(self, entry: dict[str, object]) -> dict[str, object]: ...

    async def delete_engine(self, name: str) -> dict[str, object]: ...

    async def reload(self) -> dict[str, object]: ...
