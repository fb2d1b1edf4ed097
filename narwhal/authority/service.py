"""The authority's operations and read models as the data planes reach them
(narwhal/core/lease.py `Controls`): in process directly, from worker processes over the
IPC channel (narwhal/ipc.py), the same calls either way.

Every operation is validated by the caller's HTTP layer (the admin API's rows H03-H05:
engine and wave names are the configuration's) before it reaches here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from narwhal_generated import errors as E

from ..telemetry.logs import event as log_event
from ..upstream.engines import EngineSpec
from . import metrics, views
from .control import ControlPlane
from .door import LocalDoor

__all__ = ["LocalControls", "Scraper"]

log = logging.getLogger("narwhal")

# a data plane's families for a scrape (narwhal/authority/metrics.py)
Scraper = Callable[[], Awaitable[list[metrics.Family]]]

SCRAPE_TIMEOUT_S = 2.0  # a worker that does not answer a scrape in time is left out of it


class LocalControls:
    def __init__(self, control: ControlPlane) -> None:
        self.control = control
        self.door = LocalDoor(control)
        self.scrapers: dict[int, Scraper] = {}  # worker -> its families

    async def ready(self) -> tuple[int, dict[str, Any]]:
        return views.ready(self.control)

    async def engines(self, sizing: dict[str, Any]) -> dict[str, Any]:
        return views.engines(self.control, sizing=sizing)

    async def metrics(self) -> bytes:
        async def one(scrape: Scraper) -> list[metrics.Family]:
            try:
                async with asyncio.timeout(SCRAPE_TIMEOUT_S):
                    return await scrape()
            except (TimeoutError, ConnectionError):
                return []  # a worker being restarted (or stuck): its series are absent from this scrape

        # all workers at once: a stuck one costs SCRAPE_TIMEOUT_S, not that per worker
        planes = await asyncio.gather(*(one(s) for _, s in sorted(self.scrapers.items())))
        # off the loop's critical path (issue 40 item 4): the engines read in batches with
        # the loop let go between them, the text rendered in a thread
        snap = await views.state_snapshot_paced(self.control)
        return await asyncio.to_thread(metrics.render, lambda: snap, planes)

    async def set_state(self, state: str) -> str:
        before = self.control.state.reason(self.control.clock.now()) or "active"
        self.control.set_operator(state)
        log.info("router state: the operator set %s (was %s)", state, before, extra=log_event("router_state", state=state, previous=before, by="operator"))
        el = self.control.elector
        if state == "active" and el is not None:
            # with ha the router campaigns again: answer once that campaign has an outcome
            await el.settled(self.control.config.ha.lease_ttl_ms / 1000.0)  # type: ignore[union-attr]
        return self.control.state.reason(self.control.clock.now()) or "active"

    async def set_wave(self, wave: str, on: bool) -> None:
        self.control.set_wave_maintenance(wave, on)
        log.info("wave %s: maintenance %s", wave, "on" if on else "off", extra=log_event("wave_maintenance", wave=wave, maintenance=on))

    async def drain(self, engine: str, on: bool) -> None:
        self.control.set_draining(engine, on)
        log.info("engine %s: the operator's drain %s", engine, "on" if on else "off", extra=log_event("engine_drain", engine=engine, drain=on))

    async def put_engine(self, entry: dict[str, Any]) -> dict[str, Any]:
        """PUT /admin/engines/{name}: `entry` validated by the caller (config.parse_engines)."""
        c = self.control
        spec = EngineSpec.from_dict(entry)
        refused = c.membership.refusal(spec)
        if refused is not None:  # the router's own address, discovery.max_engines
            return {"engine": spec.name, "refused": refused}
        what = c.membership.put(spec, source="admin")
        e = c.engines.get(spec.name)
        return {"engine": spec.name, "change": what, "lifecycle": e.lifecycle.state if e is not None else "gone"}

    async def reload(self) -> dict[str, Any]:
        """POST /admin/config/reload: {"ok": True, ...what changed} or {"ok": False,
        "row": "H11" | "H05", "detail": ...} (nothing changed)."""
        from . import reconfig

        try:
            return {"ok": True, **await reconfig.reload(self.control)}
        except reconfig.ReloadError as e:
            return {"ok": False, "row": (E.H05 if e.missing else E.H11).id, "detail": str(e)}

    async def delete_engine(self, name: str) -> dict[str, Any]:
        """DELETE /admin/engines/{name}: drain it, then remove it (lifecycle M04, M12)."""
        c = self.control
        if name not in c.engines:
            return {"engine": name, "lifecycle": None}
        return {"engine": name, "lifecycle": c.membership.remove(name), "drain_timeout_ms": c.config.discovery.drain_timeout_ms}

    async def profile(self, engine: str) -> str:
        return self.control.profile(engine)
