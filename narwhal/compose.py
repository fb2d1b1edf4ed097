"""Composition: configuration -> a running router.

  * `Router` — one process: the control plane (narwhal/authority) and one data plane
    (narwhal/worker) meeting at the in-process door: `serving.workers: 1`.
  * `serve` — `narwhal serve`: with serving.workers 1 the router above under hypercorn;
    with N > 1 (or auto) the supervisor (narwhal/workers.py) runs the
    authority here and N worker processes on one shared
    listening socket, the door carried over the IPC channel (narwhal/ipc.py). Either
    stops gracefully on SIGTERM (draining, then the grace; `serve`).
  * `embedded_fleet` — the embedded default's simulated engines, when no engines are
    configured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

from .authority import reconfig
from .authority.control import ControlPlane
from .authority.service import LocalControls
from .config import EMBEDDED_FLEET, ConfigError, NarwhalConfig, has_discovery
from .core.clock import Clock
from .http.app import create_app
from .http.server import (
    Stopping,
    free_port,
    raise_nofile,
    serve_until_stopped,
    serving_config,
    settle_heap,
)
from .upstream.engines import EngineSpec, config_engines
from .worker.plane import DataPlane, tokenizer_of
from .worker.telemetry import families
from .workers import begin_draining, supervise

__all__ = ["Router", "build_router", "embedded_fleet", "serve", "worker_count", "config_engines"]

log = logging.getLogger("narwhal")


def worker_count(config: NarwhalConfig) -> int:
    """serving.workers: a number, or auto (the cores this process may use)."""
    w = config.serving.workers
    if w == "auto":
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not on Linux
            return max(1, os.cpu_count() or 1)
    return int(w.root)  # type: ignore[union-attr]


class Router:
    """One router in one process: the authority and one data plane, the door between
    them short-circuited (the same calls the IPC channel carries, made directly)."""

    def __init__(self, config: NarwhalConfig, engines: list[EngineSpec], *, clock: Clock | None = None, count_tokens: Callable[[str], int] | None = None) -> None:
        self.config = config
        self.control = ControlPlane(config, engines, clock=clock)
        self.controls = LocalControls(self.control)
        self.plane = DataPlane(config, engines, self.controls.door, worker=0, clock=self.control.clock, count_tokens=count_tokens, controls=self.controls)
        registry = self.plane.telemetry.registry

        async def scrape() -> list[Any]:
            return families(registry, 0)

        self.controls.scrapers[0] = scrape
        self.control.on_facts(self.plane.learn_facts)
        self.control.on_config(self.plane.reconfigure)  # a reload reaches the data plane
        self.plane.telemetry.observe(config)  # observability.* (traces), serving.log_format (request_end lines)

    async def start(self) -> None:
        await self.control.start()

    async def stop(self) -> None:
        await self.control.stop()
        await self.plane.aclose()
        self.plane.telemetry.close()  # the spans still queued, flushed (bounded)

    def app(self, *, manage: bool = True) -> Any:
        """The ASGI app; with `manage`, its lifespan starts and stops the router."""
        return create_app(self.plane, lifespan_hooks=(self.start, self.stop) if manage else None)


def build_router(config: NarwhalConfig, engines: list[EngineSpec]) -> Router:
    return Router(config, engines, count_tokens=tokenizer_of(config))


@contextlib.asynccontextmanager
async def embedded_fleet(config: NarwhalConfig, host: str = "127.0.0.1") -> AsyncIterator[list[EngineSpec]]:
    """docs/contract.md "Commands": the embedded default's simulated fleet (one prefill and one decode
    engine of the vllm dialect), served in this process on free loopback ports."""
    from .mock import MockConfig, serve_mock

    stop = asyncio.Event()
    tasks = []
    specs = []
    for spec in EMBEDDED_FLEET:
        port = free_port(host)
        mc = MockConfig(dialect=spec["dialect"], role=spec["role"], model=config.serving.model, name=spec["name"])
        tasks.append(asyncio.create_task(serve_mock(mc, host, port, shutdown_trigger=stop.wait)))
        specs.append(EngineSpec(spec["name"], f"http://{host}:{port}", spec["role"], spec["dialect"], spec["wave"], None))
    # listening before the router's first health poll (bounded: 10 s)
    for s in specs:
        port = int(s.url.rsplit(":", 1)[1])
        for _ in range(500):
            try:
                _, w = await asyncio.open_connection(host, port)
                w.close()
                break
            except OSError:
                await asyncio.sleep(0.02)
    try:
        yield specs
    finally:
        stop.set()
        await asyncio.wait(tasks, timeout=10)


async def serve(config: NarwhalConfig, *, listen: str | None = None, stopping: Stopping | None = None, ready: Callable[[str], None] | None = None,
                built: Callable[[Router], None] | None = None, config_path: str | None = None) -> None:
    """Run the router until it stops (narwhal/http/server.py `Stopping`; router state
    S06): the first SIGTERM or SIGINT (or `stopping.signal()`) makes it drain — the
    authority stops admitting (/ready 503 draining, new completion requests R01 with
    Retry-After, waiting ones refused R01) and an ha leader resigns at once — while the
    listener stays open serving.shutdown_delay_ms; then it stops accepting, the requests
    running have what is left of serving.shutdown_grace_ms (counted from the signal) and
    are then cancelled (class cancelled); a second signal stops at once. Either way it
    returns normally (`narwhal serve` exits 0). `built` is given the Router (workers 1). `config_path`: the file
    POST /admin/config/reload and SIGHUP read again (narwhal/authority/reconfig.py)."""
    listen = listen or config.serving.listen
    if stopping is None:
        stopping = Stopping.of(config)
        stopping.install()
    n = worker_count(config)
    async with contextlib.AsyncExitStack() as stack:
        if config.engines is None and not has_discovery(config):
            engines = await stack.enter_async_context(embedded_fleet(config))
        else:
            engines = config_engines(config)
        raise_nofile()
        scheme = "https" if config.serving.tls.certfile else "http"
        if n > 1 and config.gateway is not None:  # the picker admits through the in-process door (docs/gateway.md)
            raise ConfigError("gateway.listen needs serving.workers: 1")
        if n > 1:
            log.info("narwhal serving %s://%s with %d workers (engines: %s)", scheme, listen, n, ", ".join(f"{e.name}={e.url}" for e in engines))
            await supervise(config, engines, listen, n, stopping=stopping, ready=ready, config_path=config_path)
            return
        router = build_router(config, engines)
        router.control.membership.listen = listen  # never an engine (membership.py bounds)
        stopping.hooks.append(lambda: begin_draining(router.control))
        reconfig.attach(router.control, config_path)  # POST /admin/config/reload and SIGHUP read it again
        if built is not None:
            built(router)
        app = router.app()
        hc = serving_config(config, listen)
        log.info("narwhal serving %s://%s (engines: %s)", scheme, listen, ", ".join(f"{e.name}={e.url}" for e in engines))
        settle_heap()
        if ready is not None:
            ready(f"{scheme}://{listen}")
        if config.gateway is not None:  # gateway.listen: the endpoint picker beside the HTTP listener
            try:
                from .gateway.server import GatewayServer
            except ImportError as e:
                raise ConfigError(f"gateway.listen needs the gateway extra (pip install 'narwhal[gateway]'): {e}") from None
            picker = GatewayServer(router.plane, router.controls.ready, config.gateway)
            await picker.start()
            stack.push_async_callback(picker.stop)
        await serve_until_stopped(app, hc, stopping)
        log.info("narwhal stopped; the books: %s", json.dumps(router.control.books.snapshot()))
