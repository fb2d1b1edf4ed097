"""`serving.workers` > 1: one admission authority and N data-plane worker processes.

The authority (this process, `supervise`) binds the listening socket, runs the control
plane (narwhal/authority: admission, placement, prediction, fleet health and profiles,
router state, the books) and starts N workers (`python -c` `_WORKER_BOOT`: `worker_main`), handing each
the listening socket and one end of a Unix socket pair: its channel (narwhal/ipc.py). A
worker (`worker_main`) serves HTTP/1.1 and h2 on the shared socket (the kernel gives
each new connection to one worker), parses and validates requests, relays and assembles,
and reaches admission only through the seam over its channel (worker/remote.py).

Failures
  * A worker that dies: the authority ends its requests in flight as `failed` (their
    slots freed) and starts a new one in its place after RESTART_BACKOFF_S (doubling per
    death within a minute, at most RESTART_MAX_S). Its clients' connections were cut.
  * The authority dying: each worker's channel ends; the worker stops accepting at once
    and exits after hypercorn's graceful shutdown, at most LOST_GRACE_S (5 s; never more
    than serving.shutdown_grace_ms). Clients see their connections closed: streams still
    running then end without `data: [DONE]`, new connections are refused while nothing
    listens. The process supervisor (systemd, Kubernetes) restarts the whole router.

Stopping (router state S06; narwhal/http/server.py `Stopping`)
  * The authority takes the signals: the first SIGTERM or SIGINT makes it drain at once
    (`begin_draining`: /ready 503 draining and R01 for new completion requests, which is
    what every worker answers, since both are the authority's; an ha leader resigns).
    The listener stays open serving.shutdown_delay_ms; then the authority closes its copy
    of the listening socket and sends every worker SIGUSR1: stop accepting, let the
    requests running finish. Workers still running when serving.shutdown_grace_ms
    (counted from the signal) runs out get SIGUSR2: cancel what still runs (class
    cancelled) and exit; STOP_TIMEOUT_S after that, SIGKILL. A second SIGTERM or SIGINT
    sends SIGUSR2 at once.
  * Workers ignore SIGTERM and SIGINT: a terminal's Ctrl-C reaches the whole process
    group, and systemd (KillMode=control-group) signals every process of the service at
    once; a worker acting on that itself would close its listener before the delay and
    cut its streams before the grace. They act only on the authority's SIGUSR1 and
    SIGUSR2 (or their channel ending). A single worker is stopped with SIGUSR1 or SIGKILL.
  * No worker is restarted once stop() has begun; one whose restart was under way then
    is cut as soon as it is made (it would accept after the others stopped).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

from .authority import reconfig
from .authority.channel import WorkerSession
from .authority.control import ControlPlane
from .authority.service import LocalControls
from .config import NarwhalConfig
from .http.server import Stopping, settle_heap, split_listen
from .telemetry.logs import event as log_event
from .upstream.engines import EngineSpec

__all__ = ["supervise", "worker_main", "Supervisor", "begin_draining"]

log = logging.getLogger("narwhal")

RESTART_BACKOFF_S = 0.5
RESTART_MAX_S = 30.0
START_TIMEOUT_S = 60.0  # every worker must say Up within this at start
STOP_TIMEOUT_S = 10.0  # after the grace (and SIGUSR2: cut at once), then SIGKILL
# a worker's first statements: SIGTERM and SIGINT ignored before Narwhal is imported (~0.5 s
# on a slow machine: a group's SIGTERM in that time killed the worker, and the authority
# restarted it during the stop); then worker_main, which says the same again
_WORKER_BOOT = ("import signal as s; s.signal(s.SIGINT, s.SIG_IGN); s.signal(s.SIGTERM, s.SIG_IGN); "
                "import sys; from narwhal.workers import worker_main; sys.exit(worker_main(sys.argv[1:]))")
DRAIN_SIGNAL = signal.SIGUSR1  # authority -> worker: stop accepting, finish what runs
CUT_SIGNAL = signal.SIGUSR2  # authority -> worker: cancel what still runs, exit
LOST_GRACE_S = 5.0  # the authority gone: what runs has this long (at most the grace), then is cut


async def begin_draining(control: ControlPlane) -> None:
    """S06, at the first SIGTERM: this router stops admitting at once (/ready 503
    draining; new completion requests R01 with Retry-After; the waiting ones refused R01),
    and an ha leader resigns (L19: its lease revoked, the key deleted), so a standby
    leads within a watch round trip instead of a lease TTL. Requests already admitted run on."""
    control.state.draining = True
    log.info("router state: draining (stopping)", extra=log_event("router_state", state="draining", previous=None, by="signal"))
    control.refuse_waiting()
    if control.elector is not None:
        await control.elector.resign()


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
        self.stopped = False
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
        log.info("worker %d serving (pid %d)", session.worker, m.pid, extra=log_event("worker_up", worker_index=session.worker, pid=m.pid))

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
                sys.executable, "-c", _WORKER_BOOT, str(theirs.fileno()), str(self.sock.fileno()), str(level),
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
        if self.stopping:
            # a restart the stop overtook (stop() began while this one was being made):
            # stop() may have signalled the workers already, and this one would accept on
            # the shared socket after the others stopped; it holds nothing yet, so it is
            # cut now (before its handlers are in, SIGUSR2's default ends it just as well)
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(CUT_SIGNAL)

    async def _watch(self, i: int, proc: asyncio.subprocess.Process, session: WorkerSession) -> None:
        code = await proc.wait()
        session.close()
        if self.stopping:
            return
        now = time.monotonic()
        recent = [t for t in self.deaths.get(i, []) if now - t < 60.0] + [now]
        self.deaths[i] = recent
        wait = min(RESTART_MAX_S, RESTART_BACKOFF_S * 2 ** (len(recent) - 1))
        log.warning("worker %d (pid %d) exited with %s; restarting it in %.1f s", i, proc.pid, code, wait,
                    extra=log_event("worker_exit", worker_index=i, pid=proc.pid, code=code, restart_in_s=wait))
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

    def _signal(self, sig: int) -> None:
        for p in self.procs.values():
            if p.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(sig)

    async def _exited(self, timeout_s: float, cut: asyncio.Event | None = None) -> bool:
        """Until every worker has exited (True), timeout_s passed or `cut` is set (False)."""
        pending = {asyncio.ensure_future(p.wait()) for p in self.procs.values() if p.returncode is None}
        watch = asyncio.ensure_future(cut.wait()) if cut is not None else None
        deadline = time.monotonic() + timeout_s
        try:
            while pending and (left := deadline - time.monotonic()) > 0:
                done, _ = await asyncio.wait(pending | ({watch} if watch is not None else set()), timeout=left, return_when=asyncio.FIRST_COMPLETED)
                pending -= done
                if watch is not None and watch in done:
                    break
        finally:
            for t in pending:
                t.cancel()
            if watch is not None:
                watch.cancel()
        return not pending

    async def stop(self, stopping: Stopping | None = None) -> None:
        """Without `stopping` (or after a second signal): every worker cuts what runs and
        exits at once (SIGUSR2). With it: the workers stop accepting (SIGUSR1) and have
        what is left of the grace; those still running then are cut (SIGUSR2); any left
        STOP_TIMEOUT_S after that are killed."""
        self.stopping = True
        if stopping is not None and not stopping.at_once.is_set():
            self._signal(DRAIN_SIGNAL)
            await self._exited(stopping.grace_left(), stopping.at_once)
        self._signal(CUT_SIGNAL)
        if not await self._exited(STOP_TIMEOUT_S):
            for i, p in self.procs.items():
                if p.returncode is None:
                    log.warning("worker %d (pid %d) still running %.0f s after the grace; killed", i, p.pid, STOP_TIMEOUT_S)
                    with contextlib.suppress(ProcessLookupError):
                        p.kill()
            await self._exited(STOP_TIMEOUT_S)
        for s in self.sessions.values():
            s.close()
        for t in self._watchers:
            t.cancel()
        self.stopped = True


async def supervise(config: NarwhalConfig, engines: list[EngineSpec], listen: str, n: int, *,
                    stopping: Stopping, ready: Callable[[str], None] | None = None, config_path: str | None = None) -> None:
    """The authority process: the control plane and N workers, until `stopping` says the
    listener closes; then the workers' grace (module docstring, "Stopping")."""
    sock = listening_socket(listen)
    control = ControlPlane(config, engines)
    control.membership.listen = listen  # never an engine (authority/membership.py bounds)
    controls = LocalControls(control)
    sup = Supervisor(config, engines, sock, n, controls)
    stopping.hooks.append(lambda: begin_draining(control))
    reconfig.attach(control, config_path)  # POST /admin/config/reload and SIGHUP read it again
    await control.start()
    try:
        await sup.start()
        settle_heap()  # the authority's start-up heap out of the collector's way, as a worker's
        scheme = "https" if config.serving.tls.certfile else "http"
        if ready is not None:
            ready(f"{scheme}://{listen}")
        await stopping.accepting()
        sock.close()  # the workers' copies close as they stop accepting: then nothing listens
        log.info("listener closing; requests running have %.1f s", stopping.grace_left())
        await sup.stop(stopping)
    finally:
        if not sup.stopped:  # start-up failed, or cancelled: cut at once
            await sup.stop()
        await control.stop()
        sock.close()
        log.info("narwhal stopped; the books: %s", json.dumps(control.books.snapshot()))


# -- the worker process ------------------------------------------------------------------------


async def _worker(ipc_fd: int, listen_fd: int) -> None:
    from . import ipc
    from .config import parse_config
    from .http import hyper
    from .http.app import create_app
    from .http.server import serve_until_stopped, serving_config
    from .telemetry.logs import configure as configure_logs
    from .worker.plane import DataPlane, tokenizer_of
    from .worker.remote import Link, RemoteControls, RemoteDoor
    from .worker.telemetry import families

    loop = asyncio.get_running_loop()
    link = Link()
    await loop.create_unix_connection(lambda: link.channel, sock=socket.socket(fileno=ipc_fd))
    hello = await asyncio.wait_for(link.hello, START_TIMEOUT_S)
    config = parse_config(hello.config, source="the authority's configuration")
    # serving.log_format comes with the configuration (the command line's --log-format is in it)
    configure_logs(config.serving.log_format, logging.getLogger().getEffectiveLevel(), worker=hello.worker)
    engines = [EngineSpec.from_dict(d) for d in hello.engines]
    plane = DataPlane(config, engines, RemoteDoor(link), worker=hello.worker, count_tokens=tokenizer_of(config), controls=RemoteControls(link))
    plane.telemetry.observe(config, worker=hello.worker)  # observability.*: this worker's spans
    link.scrape = lambda: families(plane.telemetry.registry, hello.worker)
    link.on_facts = plane.learn_facts
    link.on_reconfigure = lambda cfg: plane.reconfigure(parse_config(cfg, source="the authority's reloaded configuration"))
    app = create_app(plane)
    hc = serving_config(config, config.serving.listen)
    hc.bind = [f"fd://{listen_fd}"]
    # a penalty one worker decides (hyper.py defect 8) holds in every worker
    hyper.PENALTIES.listener = lambda addr, seconds: link.send(ipc.Penalise(addr, seconds))
    link.on_penalise = lambda addr, seconds: hyper.PENALTIES.penalise(addr, seconds, time.monotonic(), shared=False)
    # the authority decides when this worker stops (module docstring, "Stopping"): its
    # SIGUSR1 closes the listener and lets what runs finish (the grace is the authority's
    # to count: SIGUSR2 cuts), or the authority is gone (its channel ended)
    stopping = Stopping(0.0, config.serving.shutdown_grace_ms / 1000.0, announce=False)

    def drain() -> None:
        if not stopping.begun.is_set():
            log.info("worker %d: stopping: no new connections, requests running finish", hello.worker)
            stopping.signal(DRAIN_SIGNAL)

    def cut() -> None:
        drain()
        if not stopping.at_once.is_set():
            log.info("worker %d: cutting the requests still running", hello.worker)
            stopping.signal(CUT_SIGNAL)

    async def authority_lost() -> None:
        await link.lost.wait()
        if not stopping.begun.is_set():
            log.warning("worker %d: the authority is gone; stopping", hello.worker)
            stopping.grace_s = min(stopping.grace_s, LOST_GRACE_S)
            drain()

    loop.add_signal_handler(DRAIN_SIGNAL, drain)
    loop.add_signal_handler(CUT_SIGNAL, cut)
    for sig in _EARLY:  # arrived during start-up
        (cut if sig == CUT_SIGNAL else drain)()
    lost = asyncio.ensure_future(authority_lost())

    settle_heap()
    link.send(ipc.Up(hello.worker, os.getpid()))
    try:
        await serve_until_stopped(app, hc, stopping)
    finally:
        lost.cancel()
        await plane.aclose()
        plane.telemetry.close()
        link.channel.close()


_EARLY: list[int] = []  # SIGUSR1/SIGUSR2 received before the event loop took them over


def _early(sig: int, frame: Any) -> None:
    _EARLY.append(sig)


def worker_main(argv: list[str]) -> int:
    # before anything else: a terminal's Ctrl-C or systemd's SIGTERM to the whole group is
    # the authority's to act on; its SIGUSR1/SIGUSR2 during start-up are kept for the loop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(DRAIN_SIGNAL, _early)
    signal.signal(CUT_SIGNAL, _early)
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
