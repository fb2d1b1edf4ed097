"""`serving.workers` > 1: one admission authority and N data-plane worker processes.

The authority (this process, `supervise`) binds the listening socket, runs the control
plane (narwhal/authority: admission, placement, prediction, fleet health and profiles,
router state, the books) and starts N workers (`python -m narwhal.workers`), handing each
the listening socket and one end of a Unix socket pair: its channel (narwhal/ipc.py). A
worker (`worker_main`) serves HTTP/1.1 and h2 on the shared socket (the kernel gives
each new connection to one worker), parses and validates requests, relays and assembles,
and reaches admission only through the seam over its channel (worker/remote.py).

Failures
  * A worker that dies: the authority ends its requests in flight as `failed` (their
    slots freed) and starts a new one in its place after RESTART_BACKOFF_S (doubling per
    death within a minute, at most RESTART_MAX_S). Its clients' connections were cut.
  * The authority dying (or stopping): each worker's channel ends; the worker stops
    accepting at once and exits after hypercorn's graceful shutdown (graceful_timeout,
    5 s: narwhal/http/server.py). Clients see their connections closed: streams in
    flight end without `data: [DONE]`, new connections are refused while nothing listens.
    The process supervisor (systemd, Kubernetes) restarts the whole router.
  * SIGINT at a terminal reaches the whole process group: workers ignore it and stop
    when the authority stops them (SIGTERM) or their channel ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .authority.channel import WorkerSession
from .authority.control import ControlPlane
from .authority.service import LocalControls
from .config import NarwhalConfig
from .http.server import settle_heap, split_listen
from .upstream.engines import EngineSpec

__all__ = ["supervise", "worker_main", "Supervisor"]

log = logging.getLogger("narwhal")

RESTART_BACKOFF_S = 0.5
RESTART_MAX_S = 30.0
START_TIMEOUT_S = 60.0  # every worker must say Up within this at start
STOP_TIMEOUT_S = 10.0  # then SIGKILL


def listening_socket(listen: str, backlog: int = 4096) -> socket.socket:
    host, port = split_listen(listen)
    s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # inherited by accepted sockets
    s.bind((host, port))
    s.listen(backlog)
    s.setblocking(False)
    s.set_inheritable(True)
    return s


class Supervisor:
    """The authority process's workers: start, watch, restart, stop."""

    def __init__(self, config: NarwhalConfig, engines: list[EngineSpec], sock: socket.socket, n: int, controls: LocalControls) -> None:
        self.config = config
        self.engines = engines
        self.sock = sock
        self.n = n
        self.controls = controls
        self.sessions: dict[int, WorkerSession] = {}
        self.procs: dict[int, asyncio.subprocess.Process] = {}
        self.deaths: dict[int, list[float]] = {}
        self.ups: dict[int, asyncio.Event] = {}
        self.stopping = False
        self._watchers: list[asyncio.Task[None]] = []
        self._hello_config = config.model_dump(mode="json", by_alias=True)
        controls.control.on_facts(self._facts)
        controls.control.on_config(self._reconfigure)

    def _reconfigure(self, config: NarwhalConfig) -> None:
        from . import ipc

        self._hello_config = config.model_dump(mode="json", by_alias=True)  # workers started later get it too
        for s in self.sessions.values():
            s.send(ipc.Reconfigure(self._hello_config))

    def _facts(self, engine: str, facts: list[Any]) -> None:
        from . import ipc

        for s in self.sessions.values():
            s.send(ipc.Facts(engine, facts))

    def _penalise(self, origin: WorkerSession, addr: str, seconds: float) -> None:
        from . import ipc

        for s in self.sessions.values():
            if s is not origin:
                s.send(ipc.Penalise(addr, seconds))

    def _on_up(self, session: WorkerSession, m: Any) -> None:
        from . import ipc

        for name, facts in self.controls.control.all_facts():
            session.send(ipc.Facts(name, facts))
        self.controls.scrapers[session.worker] = session.scrape
        self.ups.setdefault(session.worker, asyncio.Event()).set()
        log.info("worker %d serving (pid %d)", session.worker, m.pid)

    def _on_lost(self, session: WorkerSession) -> None:
        if self.sessions.get(session.worker) is session:
            self.controls.scrapers.pop(session.worker, None)

    async def start_worker(self, i: int) -> None:
        from . import ipc

        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "narwhal.workers", str(theirs.fileno()), str(self.sock.fileno()), str(level),
                pass_fds=(theirs.fileno(), self.sock.fileno()),
            )
        finally:
            theirs.close()
        session = WorkerSession(i, self.controls, on_up=self._on_up, on_penalise=self._penalise, on_lost=self._on_lost)
        await loop.create_unix_connection(lambda: session.channel, sock=ours)
        self.ups[i] = asyncio.Event()
        self.sessions[i] = session
        self.procs[i] = proc
        # the fleet as it is now (it changes at run time: later changes follow as Facts)
        session.send(ipc.Hello(i, self._hello_config, [s.as_dict() for s in self.controls.control.specs.values()]))
        self._watchers.append(asyncio.create_task(self._watch(i, proc, session), name=f"narwhal-worker-{i}"))

    async def _watch(self, i: int, proc: asyncio.subprocess.Process, session: WorkerSession) -> None:
        code = await proc.wait()
        session.close()
        if self.stopping:
            return
        now = time.monotonic()
        recent = [t for t in self.deaths.get(i, []) if now - t < 60.0] + [now]
        self.deaths[i] = recent
        wait = min(RESTART_MAX_S, RESTART_BACKOFF_S * 2 ** (len(recent) - 1))
        log.warning("worker %d (pid %d) exited with %s; restarting it in %.1f s", i, proc.pid, code, wait)
        await asyncio.sleep(wait)
        if not self.stopping:
            try:
                await self.start_worker(i)
            except Exception:
                log.exception("worker %d: restart failed", i)

    async def start(self) -> None:
        for i in range(self.n):
            await self.start_worker(i)
        async with asyncio.timeout(START_TIMEOUT_S):
            for i in range(self.n):
                await self.ups[i].wait()

    async def stop(self) -> None:
        self.stopping = True
        for p in self.procs.values():
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                await asyncio.wait_for(p.wait(), STOP_TIMEOUT_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    p.kill()
                await p.wait()
        for s in self.sessions.values():
            s.close()
        for t in self._watchers:
            t.cancel()


async def supervise(config: NarwhalConfig, engines: list[EngineSpec], listen: str, n: int, *,
                    shutdown_trigger: Callable[[], Awaitable[Any]], ready: Callable[[str], None] | None = None) -> None:
    """The authority process: the control plane and N workers, until shutdown_trigger."""
    sock = listening_socket(listen)
    control = ControlPlane(config, engines)
    controls = LocalControls(control)
    sup = Supervisor(config, engines, sock, n, controls)
    await control.start()
    try:
        await sup.start()
        settle_heap()  # the authority's start-up heap out of the collector's way, as a worker's
        scheme = "https" if config.serving.tls.certfile else "http"
        if ready is not None:
            ready(f"{scheme}://{listen}")
        await shutdown_trigger()
    finally:
        await sup.stop()
        await control.stop()
        sock.close()


# -- the worker process ------------------------------------------------------------------------


async def _worker(ipc_fd: int, listen_fd: int) -> None:
    from hypercorn.asyncio import serve as hypercorn_serve

    from . import ipc
    from .config import parse_config
    from .http import hyper
    from .http.app import create_app
    from .http.server import serving_config
    from .worker.plane import DataPlane, tokenizer_of
    from .worker.remote import Link, RemoteControls, RemoteDoor
    from .worker.telemetry import families

    loop = asyncio.get_running_loop()
    link = Link()
    await loop.create_unix_connection(lambda: link.channel, sock=socket.socket(fileno=ipc_fd))
    hello = await asyncio.wait_for(link.hello, START_TIMEOUT_S)
    config = parse_config(hello.config, source="the authority's configuration")
    engines = [EngineSpec.from_dict(d) for d in hello.engines]
    plane = DataPlane(config, engines, RemoteDoor(link), worker=hello.worker, count_tokens=tokenizer_of(config), controls=RemoteControls(link))
    link.scrape = lambda: families(plane.telemetry.registry, hello.worker)
    link.on_facts = plane.learn_facts
    link.on_reconfigure = lambda cfg: plane.reconfigure(parse_config(cfg, source="the authority's reloaded configuration"))
    app = create_app(plane)
    hc = serving_config(config, config.serving.listen)
    hc.bind = [f"fd://{listen_fd}"]
    # a penalty one worker decides (hyper.py defect 8) holds in every worker
    hyper.PENALTIES.listener = lambda addr, seconds: link.send(ipc.Penalise(addr, seconds))
    link.on_penalise = lambda addr, seconds: hyper.PENALTIES.penalise(addr, seconds, time.monotonic(), shared=False)
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, lambda: None)  # the authority decides (module docstring)

    async def until_stop() -> None:
        done = asyncio.ensure_future(stop.wait())
        lost = asyncio.ensure_future(link.lost.wait())
        await asyncio.wait((done, lost), return_when=asyncio.FIRST_COMPLETED)
        if link.lost.is_set() and not stop.is_set():
            log.warning("worker %d: the authority is gone; stopping", hello.worker)

    settle_heap()
    link.send(ipc.Up(hello.worker, os.getpid()))
    try:
        await hypercorn_serve(app, hc, shutdown_trigger=until_stop)  # type: ignore[arg-type]
    finally:
        await plane.aclose()
        link.channel.close()


def worker_main(argv: list[str]) -> int:
    ipc_fd, listen_fd = int(argv[0]), int(argv[1])
    level = argv[2] if len(argv) > 2 else "INFO"
    logging.basicConfig(level=getattr(logging, level, logging.INFO), format="%(asctime)s %(levelname)s %(name)s[worker]: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_worker(ipc_fd, listen_fd))
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
