"""The control plane of one router: the authority plus the tasks that keep its fleet
truth fresh (health polling, profiling, KV-event feeds, the fleet sources of
narwhal/fleet), started and stopped together; fleet membership (membership.py) runs
through it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..core.fleet import EngineState
from ..fleet.source import Snapshot, Source, SourceError
from ..fleet.sources import configured
from ..upstream.engines import EngineSpec
from . import health, kvevents, load, profiler
from .authority import Authority
from .ha import Elector
from .membership import Membership

__all__ = ["ControlPlane"]

log = logging.getLogger("narwhal")


class ControlPlane(Authority):
    _tasks: list[asyncio.Task[Any]]
    elector: Elector | None = None

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._tasks = []
        self.kv_feeds: dict[str, kvevents.EventFeed] = {}
        self._kv_tasks: dict[str, asyncio.Task[Any]] = {}
        self.membership = Membership(
            self, drain_timeout_s=self.config.discovery.drain_timeout_ms / 1000.0,
            subscribe=self._subscribe_kv, unsubscribe=self._unsubscribe_kv, poll=self._poll_now,
        )
        self.sources: dict[str, Source] = configured(self.config)  # narwhal/fleet: name -> run(emit)
        self._source_tasks: list[asyncio.Task[Any]] = []
        # the configuration file (narwhal serve --config) and what was loaded from it
        # (reconfig.py: POST /admin/config/reload, SIGHUP)
        self.config_path: str | None = None
        self.config_hash: str | None = None
        self.config_overrides: frozenset[str] = frozenset()  # keys the command line set (--workers)
        self.config_loaded_at: float | None = None
        self._config_listeners: list[Any] = []
        if self.config.ha is not None:  # leader election: standby until elected
            self.elector = Elector(self, self.config.ha)
            self.elector.take_over = self.take_over
            self.state.election = self.elector.leadership

    # -- membership hooks (authority.py, membership.py) ----------------------------------

    def observed(self, e: EngineState) -> None:
        self.membership.observed(e)

    def released(self) -> None:
        self.membership.check_idle()

    def set_draining(self, name: str, on: bool) -> None:
        self.membership.drain(name, on)

    def emit(self, item: Snapshot | SourceError) -> None:
        """What a fleet source says (narwhal/fleet/source.py)."""
        if isinstance(item, SourceError):
            self.membership.error(item.source, item.message)
            return
        self.membership.source_ok(item.source)
        self.membership.apply(item.source, item.engines)

    def on_config(self, listener: Any) -> None:
        """`listener(config)` whenever a reload changes the running configuration."""
        self._config_listeners.append(listener)

    def tell_config(self, config: Any) -> None:
        for listener in self._config_listeners:
            listener(config)

    def restart_sources(self, sources: dict[str, Source]) -> None:
        """A reload changed discovery: the old sources stop, the new ones start (their
        first snapshot is diffed against the engines the old ones named)."""
        for t in self._source_tasks:
            t.cancel()
        for gone in set(self.sources) - set(sources):
            self.membership.apply(gone, ())  # a source no longer configured: its engines leave
        self.sources = sources
        self._start_sources()

    def _start_sources(self) -> None:
        self._source_tasks = [asyncio.create_task(self._run_source(n, run), name=f"narwhal-fleet-{n}") for n, run in self.sources.items()]

    def _subscribe_kv(self, e: EngineState, spec: EngineSpec) -> None:
        idx = self.scheduler.prefix.get(e.name)
        if idx is None or not idx.token or not spec.kv_events:
            return
        name = e.name
        feed = kvevents.EventFeed(name, idx, spec.kv_block_size, on_block_size=lambda b, n=name: self.set_kv_block_size(n, b))
        self.kv_feeds[name] = feed
        self._kv_tasks[name] = asyncio.create_task(kvevents.subscribe(feed, spec.kv_events), name=f"narwhal-kv-{name}")

    def _unsubscribe_kv(self, name: str) -> None:
        self.kv_feeds.pop(name, None)
        task = self._kv_tasks.pop(name, None)
        if task is not None:
            task.cancel()

    def _poll_now(self, e: EngineState) -> None:
        self._tasks.append(asyncio.create_task(health.poll_one(self, e), name=f"narwhal-join-{e.name}"))
        self._tasks = [t for t in self._tasks if not t.done()]

    def operator_changed(self) -> None:
        if self.elector is not None:
            self.elector.operator_changed()

    async def take_over(self) -> None:
        """L01: before this router's first admission as the new leader: fresh health of
        every engine and the load the engines report (authority/load.py), each bounded by
        monitoring.poll_timeout_ms."""
        await health.poll_once(self)
        await asyncio.gather(*(load.observe(self, e) for e in self.engines.values()))
        self.took_over_at = self.clock.now()

    async def start(self) -> None:
        self._tasks = []
        self.started_at = self.clock.now()
        self.first_poll = asyncio.Event()
        self._tasks.append(asyncio.create_task(health.monitor(self), name="narwhal-health"))
        if self.elector is not None:
            self.elector.start()
        for name in list(self.scheduler.prefix):
            self._subscribe_kv(self.engines[name], self.specs[name])
        self._start_sources()
        if self.config.admission.prediction.profile_on_start:
            # profile once the first health poll says which engines answer; an engine that
            # is down now is profiled when a later poll finds it up (profiler.maybe_reprofile)
            async def after_first_poll() -> None:
                await self.first_poll.wait()
                await profiler.profile_all(self, only_healthy=True)

            self.profiling["*start"] = asyncio.create_task(after_first_poll(), name="narwhal-profile-start")

    async def _run_source(self, name: str, run: Source) -> None:
        """A fleet source until the router stops; a bug in it is logged and it starts
        again (bounded: once a second)."""
        while True:
            try:
                await run(self.emit)
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("fleet source %s failed; restarting it", name)
                await asyncio.sleep(1.0)

    async def stop(self) -> None:
        tasks = [*self._tasks, *self.profiling.values(), *self._kv_tasks.values(), *self._source_tasks]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(BaseException):
                await t
        self._tasks = []
        self.profiling.clear()
        if self.elector is not None:
            await self.elector.stop()
        await self.client.aclose()

    def profile(self, name: str) -> str:
        """POST /admin/engines/{name}/profile: profile now (once at a time)."""
        profiler.profile(self, name)
        return self.engines[name].profile_status

    async def wait_profiled(self, timeout_s: float = 60.0) -> None:
        tasks = [t for t in self.profiling.values() if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)

    def profile_retry_s(self, e: EngineState) -> float:
        return profiler.retry_s(e)
