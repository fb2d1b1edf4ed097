"""The router's runtime: engines, scheduler, books, state, client, and the tasks that keep
them fresh (health polling with a circuit breaker, profiling).

This is the composition root below the HTTP layer. It owns one future per waiting ticket
and resolves it when the scheduler grants a slot or refuses the ticket (reconcile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any
from urllib.parse import urlsplit

from narwhal_generated import dialects as D
from narwhal_generated.models.config import NarwhalConfig

from ..core.accounting import Books
from ..core.admission import Dispatch, Refuse, Scheduler, Ticket
from ..core.clock import Clock, MonotonicClock
from ..core.fleet import Breaker, EngineState
from ..core.prediction import Margin, OutputLengthLearner
from ..core.sizing import PromptSizer
from ..core.state import RouterState
from .client import EngineClient, UpstreamError, split_userinfo
from .telemetry import Telemetry

__all__ = ["Router", "EngineSpec", "ENGINE_REQUEST_IDS"]

log = logging.getLogger("narwhal")

# Router-only, like core.requests.ROUTER_ONLY: the engine-side request ID of vLLM
# (`request_id`) and SGLang (`rid`). A client that sets it chooses the ID the engine files
# the request under: it can collide with another request's (the engine refuses or mixes
# them up) or name one in a KV transfer. Removed from every client body on every leg.
ENGINE_REQUEST_IDS = frozenset(("request_id", "rid"))


class EngineSpec:
    """An engine to register: config entry plus the resolved URL.

    `url` never carries userinfo: credentials in the configured URL move to
    `authorization` (HTTP Basic), which only the engine client sees."""

    __slots__ = ("name", "url", "role", "dialect", "wave", "model", "authorization", "max_concurrency")

    def __init__(self, name: str, url: str, role: str, dialect: str, wave: str | None, model: str | None, *, max_concurrency: int | None = None) -> None:
        public, self.authorization = split_userinfo(url)
        self.name, self.url, self.role, self.dialect, self.wave, self.model = name, public.rstrip("/"), role, dialect, wave, model
        self.max_concurrency = max_concurrency  # engines[].max_concurrency

    def __repr__(self) -> str:
        return f"EngineSpec({self.name!r}, {self.url!r}, {self.role!r}, {self.dialect!r})"


def _cap(slots: int, limit: int | None) -> int:
    return slots if limit is None else min(slots, limit)


class Router:
    def __init__(self, config: NarwhalConfig, engines: list[EngineSpec], *, clock: Clock | None = None, count_tokens: Any = None) -> None:
        self.config = config
        self.clock = clock or MonotonicClock()
        self.books = Books()
        a, m = config.admission, config.monitoring
        self.state = RouterState(wave=config.serving.wave, stale_after_s=m.stale_after_ms / 1000.0)
        self.engines: dict[str, EngineState] = {}
        for s in engines:
            self.engines[s.name] = EngineState(
                s.name, s.url, role=s.role, dialect=s.dialect, wave=s.wave, model=s.model,
                # engines[].max_concurrency caps both phases' slots: a unified request holds
                # its decode slot from dispatch to its end, so decode slots in use are
                # exactly the requests in flight at that engine
                prefill_slots=_cap(a.phase_concurrency.prefill, s.max_concurrency),
                decode_slots=_cap(a.phase_concurrency.decode, s.max_concurrency),
                max_concurrency=s.max_concurrency,
                breaker=Breaker(m.breaker_failures, m.breaker_cooldown_ms / 1000.0),
            )
        p = a.prediction
        self.scheduler = Scheduler(
            self.engines.values(),
            mode=a.mode,
            queue_limit=a.queue_limit,
            maintenance_waves=self.state.maintenance_waves,
            margin=Margin(p.initial_margin, p.margin_quantile, p.margin_min_samples, p.adaptive_margin),
            output_lengths=OutputLengthLearner(),
            tpot_budget_ms=p.tpot_budget_ms,
        )
        self.sizer = PromptSizer(count_tokens=count_tokens)
        self.client = EngineClient(
            connect_timeout_s=config.upstream.connect_timeout_ms / 1000.0,
            idle_timeout_s=config.upstream.idle_timeout_ms / 1000.0,
            max_connections=config.upstream.max_connections,
            max_body_bytes=config.upstream.max_event_bytes,
        )
        for s in engines:
            if s.authorization is not None:
                self.client.authorize(s.url, s.authorization)
        # the pass-through policy (docs/passthrough.md): fields removed from client bodies
        # before each engine request: the engine-side request IDs, always, and the
        # operator's deny-list (the other router-only fields go in parse_request)
        self.deny_fields = frozenset(config.upstream.deny_fields)
        self.strip_fields = ENGINE_REQUEST_IDS | self.deny_fields
        # host names of the fleet: an engine's own error message passed on to a client
        # names none of them (narwhal/core/relay.py, engine_message)
        self.engine_hosts = tuple(sorted({h for s in engines if (h := urlsplit(s.url).hostname)}))
        self.telemetry = Telemetry(self.snapshot_for_metrics)
        self.held = 0  # R02: client requests held
        self.waiters: dict[int, asyncio.Future[Dispatch | Refuse]] = {}
        self._tasks: list[asyncio.Task[Any]] = []
        self._profiling: dict[str, asyncio.Task[Any]] = {}
        # engines whose streams carry no usage but which can count prompts exactly
        # (usage.py), found at profile time
        self.prompt_counters: dict[str, Any] = {}
        self._first_poll = asyncio.Event()
        self._started_at = self.clock.now()
        self._refresh_health_state()

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        self._started_at = self.clock.now()
        self._first_poll = asyncio.Event()
        self._tasks.append(asyncio.create_task(self._monitor(), name="narwhal-health"))
        if self.config.admission.prediction.profile_on_start:
            # profile once the first health poll says which engines answer; an engine that
            # is down now is profiled when a later poll finds it up (see _maybe_reprofile)
            async def after_first_poll() -> None:
                await self._first_poll.wait()
                await self.profile_all(only_healthy=True)

            self._profiling["*start"] = asyncio.create_task(after_first_poll(), name="narwhal-profile-start")

    async def stop(self) -> None:
        for t in [*self._tasks, *self._profiling.values()]:
            t.cancel()
        for t in [*self._tasks, *self._profiling.values()]:
            with contextlib.suppress(BaseException):
                await t
        self._tasks.clear()
        self._profiling.clear()
        await self.client.aclose()

    # -- grants ----------------------------------------------------------------------

    def wake(self, grants: list[Dispatch]) -> None:
        for g in grants:
            f = self.waiters.pop(g.ticket.id, None)
            if f is not None and not f.done():
                f.set_result(g)

    async def wait_grant(self, t: Ticket) -> Dispatch | Refuse | None:
        """Wait for a slot. None: R12/R13 expired first (the scheduler says which)."""
        f: asyncio.Future[Dispatch | Refuse] = asyncio.get_running_loop().create_future()
        self.waiters[t.id] = f
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

    def reconcile(self) -> None:
        grants, refused = self.scheduler.reconcile(self.clock.now())
        self.wake(grants)
        for t, r in refused:
            f = self.waiters.pop(t.id, None)
            if f is not None and not f.done():
                f.set_result(r)

    # -- engine health ---------------------------------------------------------------

    def engine_failed(self, e: EngineState, row: str) -> None:
        """A request-level failure that says something about the engine (E04, E06, E07)."""
        e.failed += 1
        if row in ("E04", "E06", "E07") and e.breaker.failure(self.clock.now()):
            log.warning("engine %s: circuit breaker opened after %s", e.name, row)
            self.reconcile()

    def engine_ok(self, e: EngineState) -> None:
        e.completed += 1
        e.breaker.success(self.clock.now(), probe=False)

    async def _poll(self, e: EngineState) -> None:
        if e.max_concurrency is not None and (e.prefill_in_use or e.decode_in_use):
            # a poll is a request too: an engine limited by engines[].max_concurrency may
            # serialise it behind, or cut a running generation for it (llama-cpp-python's
            # server does so for /v1/models); while it has requests in flight their own
            # progress and failures (E06/E07, the breaker) stand for the poll
            e.last_observed = self.clock.now()
            return
        path = D.BY_NAME[e.dialect].health_path
        timeout = self.config.monitoring.poll_timeout_ms / 1000.0
        try:
            status = await self.client.get(e.url + path, timeout_s=timeout)
            ok, err = status == 200, (None if status == 200 else f"health answered {status}")
        except UpstreamError as x:
            ok, err = False, str(x)
            if e.healthy:  # once per transition: the detail (address included) is for the log
                log.warning("engine %s: health poll failed: %s: %s", e.name, x.row, x.log_detail or x.detail)
        now = self.clock.now()
        was = e.eligible(self.state.maintenance_waves)
        e.healthy = ok
        e.last_error = err
        e.last_observed = now
        if ok:
            e.breaker.success(now, probe=True)
            self._maybe_reprofile(e, now)
        else:
            e.breaker.failure(now)
        if was != e.eligible(self.state.maintenance_waves):
            self.reconcile()

    def _refresh_health_state(self) -> None:
        if not self.engines:
            self.state.health_observed(None)
            return
        obs = [e.last_observed if e.last_observed is not None else self._started_at for e in self.engines.values()]
        self.state.health_observed(min(obs))

    async def poll_once(self) -> None:
        await asyncio.gather(*(self._poll(e) for e in self.engines.values()))
        self._refresh_health_state()
        self._first_poll.set()

    async def _monitor(self) -> None:
        interval = self.config.monitoring.poll_interval_ms / 1000.0
        while True:
            try:
                await self.poll_once()
            except Exception:  # a bug must not stop monitoring; staleness would show it
                log.exception("health poll failed")
            await asyncio.sleep(interval)

    # -- profiling -------------------------------------------------------------------

    async def profile_all(self, *, only_healthy: bool = False) -> None:
        """Profile the fleet: prefill and unified engines together, then decode engines one
        at a time (their measurements send prefill legs, which must not queue behind one
        another's or behind a prefill engine's own profiling)."""
        from .profiler import profile_engine

        todo = [e for e in self.engines.values() if e.healthy or not only_healthy]
        for e in todo:
            e.profile_status = "running"
        await asyncio.gather(*(profile_engine(self, e) for e in todo if e.role != "decode"))
        for e in todo:
            if e.role == "decode":
                await profile_engine(self, e)

    PROFILE_RETRY_S = 30.0  # the first retry after a failed profile ...
    PROFILE_RETRY_MAX_S = 600.0  # ... doubling per consecutive failure up to this

    def profile_retry_s(self, e: EngineState) -> float:
        """The wait before profiling `e` again after its consecutive failures."""
        n = max(0, e.profile_failures - 1)
        return min(self.PROFILE_RETRY_MAX_S, self.PROFILE_RETRY_S * (2.0 ** min(n, 16)))

    def _maybe_reprofile(self, e: EngineState, now: float) -> None:
        """A healthy engine without a profile (down at start, or its profiling failed)
        is profiled again: after a failure, with exponential back-off (profile_retry_s)."""
        if not self.config.admission.prediction.profile_on_start or e.profile_status not in ("pending", "failed"):
            return
        if any(not t.done() for t in self._profiling.values()):
            return
        wait = self.profile_retry_s(e) if e.profile_status == "failed" else self.PROFILE_RETRY_S
        if e.profile_attempted is not None and now - e.profile_attempted < wait:
            return
        if e.role == "decode" and not any(p.role == "prefill" and p.healthy for p in self.engines.values()):
            return
        self.profile(e.name)

    def profile(self, name: str) -> None:
        from .profiler import profile_engine

        old = self._profiling.get(name)
        if old is not None and not old.done():
            return
        e = self.engines[name]
        e.profile_status = "running"
        self._profiling[name] = asyncio.create_task(profile_engine(self, e), name=f"narwhal-profile-{name}")

    async def wait_profiled(self, timeout_s: float = 60.0) -> None:
        tasks = [t for t in self._profiling.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    # -- views -----------------------------------------------------------------------

    def engine_view(self, e: EngineState) -> dict[str, Any]:
        now = self.clock.now()
        reasons = e.ineligible_reasons(self.state.maintenance_waves)
        return {
            "name": e.name,
            "url": e.url,
            "role": e.role,
            "dialect": e.dialect,
            "wave": e.wave,
            "model": e.model or self.config.serving.model,
            "healthy": e.healthy,
            "eligible": not reasons,
            "ineligible_reasons": reasons,
            "draining": e.draining,
            "circuit_breaker": e.breaker.snapshot(),
            "last_health_age_ms": None if e.last_observed is None else round((now - e.last_observed) * 1000.0, 1),
            "last_error": e.last_error,
            "token_accounting": D.BY_NAME[e.dialect].token_accounting,
            "prompt_count": self.prompt_counters[e.name].kind if e.name in self.prompt_counters else None,
            "max_concurrency": e.max_concurrency,
            "profile": {
                "status": e.profile_status,
                "error": e.profile_error,
                "consecutive_failures": e.profile_failures,
                "next_retry_s": round(max(0.0, self.profile_retry_s(e) - (now - e.profile_attempted)), 1) if e.profile_status == "failed" and e.profile_attempted is not None else None,
                "prefill": e.prefill.snapshot(),
                "decode": e.decode.snapshot(),
                "decode_start": {"k0_ms": round(e.start_model.theta[0], 4), "k1_ms_per_ktoken": round(e.start_model.theta[1], 4), "samples": e.start_model.samples},
                "measurements": e.profile_samples,
            },
            "drift": {"prefill": e.prefill.drift.snapshot(), "decode": e.decode.drift.snapshot()},
            "output_length": self.scheduler.output_lengths.snapshot(),
            "load": e.load_snapshot(now),
        }

    def snapshot_for_metrics(self) -> dict[str, Any]:
        return {
            "books": self.books.snapshot(),
            "held": self.held,
            "queued": self.scheduler.queued,
            "decode_queued": len(self.scheduler.decode_queue),
            "state": self.state.reason(self.clock.now()) or "active",
            "engines": [self.engine_view(e) for e in self.engines.values()],
        }
