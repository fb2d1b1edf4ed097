"""The control plane of one router: the authority plus the tasks that keep its fleet
truth fresh (health polling, profiling), started and stopped together."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from ..core.fleet import EngineState
from . import health, kvevents, load, profiler
from .authority import Authority
from .ha import Elector

__all__ = ["ControlPlane"]


class ControlPlane(Authority):
    _tasks: list[asyncio.Task[Any]]
    elector: Elector | None = None

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._tasks = []
        self.kv_feeds: dict[str, kvevents.EventFeed] = {}
        if self.config.ha is not None:  # leader election: standby until elected
            self.elector = Elector(self, self.config.ha)
            self.elector.take_over = self.take_over
            self.state.election = self.elector.leadership

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
        for name, idx in self.scheduler.prefix.items():
            spec = self.specs[name]
            if idx.token and spec.kv_events:
                feed = kvevents.EventFeed(name, idx, spec.kv_block_size, on_block_size=lambda b, n=name: self.set_kv_block_size(n, b))
                self.kv_feeds[name] = feed
                self._tasks.append(asyncio.create_task(kvevents.subscribe(feed, spec.kv_events), name=f"narwhal-kv-{name}"))
        if self.config.admission.prediction.profile_on_start:
            # profile once the first health poll says which engines answer; an engine that
            # is down now is profiled when a later poll finds it up (profiler.maybe_reprofile)
            async def after_first_poll() -> None:
                await self.first_poll.wait()
                await profiler.profile_all(self, only_healthy=True)

            self.profiling["*start"] = asyncio.create_task(after_first_poll(), name="narwhal-profile-start")

    async def stop(self) -> None:
        tasks = [*self._tasks, *self.profiling.values()]
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
