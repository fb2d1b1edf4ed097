"""The admission authority: the one owner of what must be single in a router.

It owns the fleet's truth (engine health, breakers, profiles: `EngineState`), the
scheduler (admission queue and its precedence, placement, phase slots, prediction and
learning), the router state (R01), the retention count (R02) and the books. It is the
only writer of all of these: the data plane reaches it only through the `Door`/`Lease`
seam (narwhal/core/lease.py; `door.py` here implements it in process, narwhal/ipc.py
carries it to worker processes), the admin API only through the operations below.

It owns one future per waiting ticket and resolves it when the scheduler grants a slot or
refuses the ticket (`reconcile`). Health polling is health.py; profiling profiler.py; the
read models of /v1/engines, /ready and /metrics views.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from narwhal_generated import errors as E
from narwhal_generated.models.config import NarwhalConfig

from ..core.accounting import Books
from ..core.admission import Scheduler
from ..core.clock import Clock, MonotonicClock
from ..core.fairness import retention_victim
from ..core.fleet import PHASE1_ROLES, Breaker, EngineState
from ..core.prediction import Margin, OutputLengthLearner
from ..core.preempt import configured as preempt_configured
from ..core.prefix import APPROX_BLOCK_TOKENS, MAX_BLOCKS, PrefixIndex
from ..core.quota import DEFAULT, Limits, Quotas
from ..core.sizing import PromptSizer
from ..core.state import RouterState
from ..core.tickets import Dispatch, Refuse, Ticket
from ..telemetry.logs import event as log_event
from ..upstream.engines import EngineSpec, engine_client
from ..upstream.usage import PromptCounter

__all__ = ["Authority"]

log = logging.getLogger("narwhal")


def _prefix_indexes(mode: str, tokens: int, engines: list[EngineSpec], *, share: int = 0) -> dict[str, PrefixIndex]:
    """admission.prediction.prefix_cache: one index per phase-1 engine it covers, each
    MAX_BLOCKS over the engines covered (`share`: that many, for one joining engine)."""
    if mode == "off":
        return {}
    covered = [s for s in engines if s.role in PHASE1_ROLES and (mode != "events" or s.kv_events)]
    per = MAX_BLOCKS // max(1, share or len(covered))
    out = {}
    for s in covered:
        if s.kv_events and mode in ("auto", "events"):  # exact: the engine's own events (kvevents.py)
            out[s.name] = PrefixIndex(per, trusted=True, token=True, block_tokens=float(s.kv_block_size))
        else:
            out[s.name] = PrefixIndex(max(64, min(tokens // APPROX_BLOCK_TOKENS, per)), trusted=mode == "approximate")
    return out



def quotas_of(config: NarwhalConfig) -> Quotas | None:
    """tenants: in the configuration, as core/quota.py's limits."""
    if not config.tenants:
        return None
    return Quotas({name: Limits(weight=float(t.weight), max_in_flight=t.max_in_flight, queue_limit=t.queue_limit,
                                requests_per_s=t.requests_per_s, tokens_per_min=t.tokens_per_min,
                                ttft_budget_ms=t.ttft_budget_ms) for name, t in config.tenants.items()})


def _cap(slots: int, limit: int | None) -> int:
    return slots if limit is None else min(slots, limit)


class Authority:
    def __init__(self, config: NarwhalConfig, engines: list[EngineSpec], *, clock: Clock | None = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.books = Books()
        a, m = config.admission, config.monitoring
        self.state = RouterState(wave=config.serving.wave, stale_after_s=m.stale_after_ms / 1000.0)
        # tenants: (core/quota.py; rows R17-R20, weights for fair queueing); None when
        # the configuration names no tenants: then nothing per tenant is counted
        self.quotas: Quotas | None = quotas_of(config)
        self.specs = {s.name: s for s in engines}
        self.engines: dict[str, EngineState] = {}
        for s in engines:  # engines[] at start begin active (lifecycle.yaml M01 note)
            self.engines[s.name] = self.engine_state(s, lifecycle="active", source="config")
        self.leaving: set[str] = set()  # engines in lifecycle draining (membership.py)
        p = a.prediction
        self.scheduler = Scheduler(
            self.engines.values(),
            mode=a.mode,
            queue_limit=a.queue_limit,
            maintenance_waves=self.state.maintenance_waves,
            margin=Margin(p.initial_margin, p.margin_quantile, p.margin_min_samples, p.adaptive_margin),
            output_lengths=OutputLengthLearner(),
            tpot_budget_ms=p.tpot_budget_ms,
            prefix=_prefix_indexes(p.prefix_cache, p.prefix_cache_tokens, engines),
            weights=self.weight_of,
            tenant_queue_limit=self.tenant_queue_limit,
            fair_reserve=a.fair_reserve if self.quotas is not None else None,  # R02/R11 fairness
            fair_preempt=preempt_configured(config),  # core/preempt.py
        )
        self._prefix_covered = len(self.scheduler.prefix)
        # the learned bytes-per-token estimate (an exact count, when the data plane has
        # one, comes with the request: Order.exact_prompt_tokens)
        self.sizer = PromptSizer()
        self.client = engine_client(config, engines)  # health polls and profiling only
        self.held = 0  # R02: client requests held
        self.retained: dict[int, Any] = {}  # R02: an admitted request's ticket id -> its entry holding a place (door.py)
        self.waiters: dict[int, asyncio.Future[Dispatch | Refuse]] = {}
        # fair preemption (core/preempt.py): a ticket id past its first token whose leg can
        # be carried on -> how its data plane is told to cut it (door.py LocalLease.tell);
        # bounded by the requests holding slots, each removed when its lease closes or retries
        self.preempting: dict[int, Callable[[], None]] = {}
        self.preemptions = 0  # requests asked to leave (narwhal_fair_preemptions_total)
        self.profiling: dict[str, asyncio.Task[Any]] = {}
        # engines whose streams carry no usage but which can count prompts exactly
        # (upstream/usage.py), found at profile time; data planes are told (`on_facts`)
        self.prompt_counters: dict[str, PromptCounter] = {}
        self._fact_listeners: list[Any] = []
        self.kv_block_sizes: dict[str, int] = {}  # learned from the engines' KV events
        self.first_poll = asyncio.Event()
        self.started_at = self.clock.now()
        self.took_over_at: float | None = None  # the last take-over as elected leader (load.py)
        self.health_observed()

    def weight_of(self, tenant: str | None) -> float:
        return self.quotas.weight(tenant) if self.quotas is not None else 1.0

    def tenant_queue_limit(self, tenant: str | None) -> int | None:
        return self.quotas.limits_of(tenant).queue_limit if self.quotas is not None else None

    def engine_state(self, s: EngineSpec, *, lifecycle: str, source: str) -> EngineState:
        """The router's state of one engine as it registers (at start, or joining)."""
        a, m = self.config.admission, self.config.monitoring
        return EngineState(
            s.name, s.url, role=s.role, dialect=s.dialect, wave=s.wave, model=s.model,
            # engines[].max_concurrency caps both phases' slots: a unified request holds
            # its decode slot from dispatch to its end, so decode slots in use are
            # exactly the requests in flight at that engine
            prefill_slots=_cap(a.phase_concurrency.prefill, s.max_concurrency),
            decode_slots=_cap(a.phase_concurrency.decode, s.max_concurrency),
            max_concurrency=s.max_concurrency,
            breaker=Breaker(m.breaker_failures, m.breaker_cooldown_ms / 1000.0),
            lifecycle=lifecycle, now=self.clock.now(), source=source,
        )

    def prefix_index(self, s: EngineSpec) -> PrefixIndex | None:
        """A joining engine's prefix index (admission.prediction.prefix_cache), sized as
        one more engine's share of the fleet's bound at its join."""
        p = self.config.admission.prediction
        self._prefix_covered += 1
        return _prefix_indexes(p.prefix_cache, p.prefix_cache_tokens, [s], share=self._prefix_covered).get(s.name)

    # -- hooks the control plane fills (membership.py) ---------------------------------

    def observed(self, e: EngineState) -> None:
        """A health poll or a profile's outcome about `e` (lifecycle M01)."""

    def released(self) -> None:
        """A lease closed while an engine is leaving (lifecycle M29)."""

    def health_observed(self) -> None:
        """Tell the router state the age of the oldest engine's newest observation."""
        if not self.engines:
            self.state.health_observed(None)
            return
        obs = [e.last_observed if e.last_observed is not None else self.started_at for e in self.engines.values()]
        self.state.health_observed(min(obs))

    # -- facts the data plane needs ------------------------------------------------------

    def all_facts(self) -> list[tuple[str, list[Any]]]:
        """What the data planes must know of each engine, as (engine, facts):
        ["prompt_counter", kind, path, template] (upstream/usage.py) and
        ["kv_block_size", tokens] (the block size the engine's KV events use)."""
        out = [(name, ["prompt_counter", *pc.facts()]) for name, pc in self.prompt_counters.items()]
        out += [(name, ["kv_block_size", b]) for name, b in self.kv_block_sizes.items()]
        return out

    def on_facts(self, listener: Any) -> None:
        """`listener(engine, facts)` for every fact, now and later."""
        self._fact_listeners.append(listener)
        for name, facts in self.all_facts():
            listener(name, facts)

    def _tell(self, name: str, facts: list[Any]) -> None:
        for listener in self._fact_listeners:
            listener(name, facts)

    def add_prompt_counter(self, name: str, pc: PromptCounter) -> None:
        self.prompt_counters[name] = pc
        self._tell(name, ["prompt_counter", *pc.facts()])

    def set_kv_block_size(self, name: str, tokens: int) -> None:
        """The engine's KV events use blocks of `tokens` (kvevents.py): its index counts
        them so, and the data planes key prompts so."""
        self.kv_block_sizes[name] = tokens
        idx = self.scheduler.prefix.get(name)
        if idx is not None:
            idx.block_tokens = float(tokens)
        self._tell(name, ["kv_block_size", tokens])

    # -- grants ----------------------------------------------------------------------

    def wake(self, grants: list[Dispatch]) -> None:
        for g in grants:
            f = self.waiters.pop(g.ticket.id, None)
            if f is not None and not f.done():
                f.set_result(g)
        if self.scheduler.preempts:
            self.preempt()

    def preempt(self) -> None:
        """Tell each data plane whose request core/preempt.py asked to leave its engine
        (in the next turn of the loop: never inside the step that decided it)."""
        asked, self.scheduler.preempts = self.scheduler.preempts, []
        for p in asked:
            tell = self.preempting.pop(p.ticket.id, None)
            if tell is not None:
                self.preemptions += 1
                asyncio.get_running_loop().call_soon(tell)

    def register(self, t: Ticket) -> asyncio.Future[Dispatch | Refuse]:
        """The future a queued ticket's grant (or refusal) resolves, registered at once:
        a grant made before the waiter exists would be lost (wake finds no waiter). Call
        it in the same turn of the loop as the decision that queued the ticket."""
        f: asyncio.Future[Dispatch | Refuse] = asyncio.get_running_loop().create_future()
        self.waiters[t.id] = f
        if self.scheduler.preempts:  # queued behind a slot another tenant's request holds
            self.preempt()
        return f

    async def wait_grant(self, t: Ticket, f: asyncio.Future[Dispatch | Refuse] | None = None) -> Dispatch | Refuse | None:
        """Wait for a slot. None: R12/R13 expired first (the scheduler says which)."""
        if f is None:
            f = self.register(t)
        try:
            while True:
                left = self.scheduler.time_left(t, self.clock.now())
                if left <= 0:
                    return None
                try:
                    return await asyncio.wait_for(asyncio.shield(f), timeout=left)
                except TimeoutError:
                    if f.done():  # granted in the same instant the timer fired
                        return f.result()
                    # an asyncio timer may fire a little early; wait until a row has
                    # expired, so that the scheduler names the right one (R12 or R13)
        finally:
            self.waiters.pop(t.id, None)

    def refuse_waiting(self) -> None:
        """This router stopped admitting (fenced, or resigned): every waiting request is
        refused with R01 and its reason; requests already on an engine run on."""
        reason = self.state.reason(self.clock.now()) or "fenced"
        for t, r in self.scheduler.refuse_waiting(Refuse(E.R01, fields={"reason": reason})):
            f = self.waiters.pop(t.id, None)
            if f is not None and not f.done():
                f.set_result(r)

    def yield_retention(self, tenant: str, *, act: bool = True, arriving: int = 0) -> Ticket | None:
        """R02 with tenants (core/fairness.py retention_victim): the tenant furthest over
        its share of the retention yields its newest request not yet granted (queued),
        refused R02 (Retry-After) in its books, and `tenant`'s arrival is held in its
        place. False when nobody is over `tenant`'s share or the one over it has nothing
        queued (then R02 stands). The ticket that yields (door.py hands its place in the
        retention to the arrival at once: `held` never exceeds the limit), or None. With
        `act` false it only looks (R02's fact): which would yield, nothing taken.
        `arriving`: the arrival, when its tenant's book does not count it yet (R02's fact is
        asked before R17 takes its place: the fact and the take must agree)."""
        q = self.quotas
        if q is None:
            return None
        held = {n: b.in_flight for n, b in q.books.items()}
        held[tenant] = held.get(tenant, 0) + arriving
        victim = retention_victim(held, q.weight, tenant)
        if victim is None:
            return None
        keys = (None, DEFAULT) if victim == DEFAULT else (victim,)  # a request without identity queues as None
        best: tuple[float, EngineState, Ticket] | None = None
        for e in self.engines.values():
            for k in keys:
                t = e.queue.newest(k)
                if t is not None and (best is None or (t.enqueued_at or 0.0) >= best[0]):
                    best = (t.enqueued_at or 0.0, e, t)
        if best is None or not act:
            return None if best is None else best[2]
        _, e, t = best
        e.queue.remove(t)
        e.queued_work_ms = max(0.0, e.queued_work_ms - t.pred_prefill_ms)
        self.scheduler.queued -= 1
        t.state = "done"
        self.scheduler.evicted.append((t, Refuse(E.R02, fields={"limit": self.config.admission.http_retention_limit})))
        self.settle_evicted()
        return t

    def settle_evicted(self) -> None:
        """Queued tickets that yielded their place (admission.py `_yield_to`): their
        waiters get the refusal (R11), as a reconcile's refusals do."""
        ev, self.scheduler.evicted = self.scheduler.evicted, []
        for t, r in ev:
            f = self.waiters.pop(t.id, None)
            if f is not None and not f.done():
                f.set_result(r)

    def reconcile(self) -> None:
        grants, refused = self.scheduler.reconcile(self.clock.now())
        self.wake(grants)
        for t, r in refused:
            f = self.waiters.pop(t.id, None)
            if f is not None and not f.done():
                f.set_result(r)

    # -- engine feedback from requests -------------------------------------------------

    def engine_failed(self, name: str, row: E.ErrorRow) -> None:
        """A request-level failure that says something about the engine (E04, E06, E07)."""
        e = self.engines[name]
        e.failed += 1
        if row in (E.E04, E.E06, E.E07) and e.breaker.failure(self.clock.now()):
            log.warning("engine %s: circuit breaker opened after %s", e.name, row.id, extra=log_event("breaker_open", engine=e.name, row=row.id))
            self.reconcile()

    def engine_ok(self, name: str) -> None:
        e = self.engines[name]
        e.completed += 1
        e.breaker.success(self.clock.now(), probe=False)

    # -- operations (the admin API; each answers what it did) ------------------------------

    def set_operator(self, state: str) -> str:
        self.state.set_operator(state)
        self.operator_changed()
        return self.state.reason(self.clock.now()) or "active"

    def operator_changed(self) -> None:
        """Leader election hears of it at once (ha.py); nothing without ha."""

    def known_waves(self) -> set[str | None]:
        return {e.wave for e in self.engines.values()} | {self.config.serving.wave}

    def set_wave_maintenance(self, wave: str, on: bool) -> None:
        self.state.set_wave_maintenance(wave, on)
        self.operator_changed()
        self.reconcile()

    def set_draining(self, name: str, on: bool) -> None:
        """POST /admin/engines/{name}/drain (the control plane runs it through the
        lifecycle table: membership.py)."""
        self.engines[name].draining = on
        self.reconcile()
