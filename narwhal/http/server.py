"""Serving (the settings, kept in hypercorn's Config; narwhal/compose.py runs it; conn.serve
serves Narwhal's own HTTP/1.1 and HTTP/2 over h2): HTTP/1.1 and HTTP/2 cleartext (prior knowledge and h2c
upgrade) on one port; HTTPS with HTTP/2 negotiated by ALPN when serving.tls is set.

How a serving process stops (`Stopping`, `serve_until_stopped`; router state S06): the
first SIGTERM or SIGINT begins draining (the composition marks the authority draining:
/ready 503, new completion requests R01); the listener stays open for
serving.shutdown_delay_ms (at most the grace); then hypercorn stops accepting and its
graceful shutdown gives the requests still running what is left of
serving.shutdown_grace_ms, counted from the signal. At its end hypercorn cancels every
connection task it still has: a completion handler cancelled so ends in the class
`cancelled` (narwhal/http/completions.py) and its stream is cut. A second signal stops at
once (graceful timeout 0, or the running shutdown cancelled).

hypercorn closes a connection after keep_alive_max_requests requests (HTTP/2: GOAWAY)
by default after 1000 (docs/stack.md); a router holds long-lived client connections, so the
limit is raised far out of reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from hypercorn.config import Config as HyperConfig

from ..config import NarwhalConfig
from . import hyper

__all__ = ["hypercorn_config", "split_listen", "free_port", "settle_heap", "raise_nofile", "serving_config", "Stopping", "serve_until_stopped"]

log = logging.getLogger("narwhal")


def settle_heap() -> None:
    """Move every object alive once the app is built to the collector's permanent
    generation (gc.freeze), so a full collection under load scans only what requests
    created since.

    Why: the imports, generated models and tables, the app and the router leave ~45,000
    tracked objects, and one full (generation-2) collection over them stalls the event
    loop ~28 ms on this machine kind (0.005 ms once frozen): every request in flight
    meanwhile waits, which shows as a TTFT p99 tail (docs/performance.md). Frozen objects
    are still freed by reference counting; only a cycle among them would stay, and
    these live as long as the process anyway.
    NARWHAL_GC_FREEZE=0 turns this off (for A/B measurement).
    """
    if os.environ.get("NARWHAL_GC_FREEZE", "1") == "0":
        return
    gc.collect()
    gc.freeze()


def raise_nofile() -> tuple[int, int] | None:
    """Raise the soft limit of open files to the hard one: every client connection and
    every engine connection is a descriptor, and a soft limit of 512 or 1024 locks later
    clients out long before the machine runs short. Returns (soft, hard) after."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on this platform
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            log.warning("cannot raise the open-files limit from %d to %d", soft, hard)
    return soft, hard


def split_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    return host.strip("[]"), int(port)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def hypercorn_config(listen: str, *, certfile: str | None = None, keyfile: str | None = None, log_level: str = "warning",
                     keep_alive_ms: int = 5000, max_streams: int = 100, grace_ms: int = 30000) -> HyperConfig:
    c = hyper.ServerConfig()  # hyper.py item 13
    c.bind = [listen]
    c.keep_alive_max_requests = 1 << 40
    # serving.keep_alive_ms: an idle connection (or one whose request head is still
    # arriving: the idle timer runs until a request starts) closes after this long
    c.keep_alive_timeout = keep_alive_ms / 1000.0
    c.h2_max_concurrent_streams = max_streams  # serving.max_streams_per_connection
    c.backlog = 4096
    # serving.shutdown_grace_ms: the longest requests run on once hypercorn stops accepting
    # (serve_until_stopped sets what is left of it at that moment)
    c.graceful_timeout = grace_ms / 1000.0
    c.accesslog = None
    c.errorlog = logging.getLogger("hypercorn.error")
    c.loglevel = log_level.upper()
    if certfile and keyfile:
        c.certfile, c.keyfile = certfile, keyfile
        c.alpn_protocols = ["h2", "http/1.1"]
    return c


def serving_config(config: NarwhalConfig, listen: str) -> HyperConfig:
    """The server's configuration from serving.*, with its limits installed
    (narwhal/http/hyper.py)."""
    sv = config.serving
    hyper.install(hyper.Limits(control_frames_per_s=sv.h2_control_frames_per_second, abuse_penalty_s=sv.abuse_penalty_ms / 1000.0))
    return hypercorn_config(listen, certfile=sv.tls.certfile, keyfile=sv.tls.keyfile, keep_alive_ms=sv.keep_alive_ms, max_streams=sv.max_streams_per_connection,
                            grace_ms=sv.shutdown_grace_ms)


class Stopping:
    """The stop of one serving process (serving.shutdown_delay_ms, serving.shutdown_grace_ms).

    `signal()` is called on each SIGTERM or SIGINT (`install`): the first sets `begun`
    and notes the time, from which the delay and the grace are counted; any later one
    sets `at_once`. `hooks` (async, no arguments) run once at the first signal, in order,
    as one task (`drained` holds it): the composition's "stop admitting" (the authority
    draining, waiters refused, an ha leader resigning)."""

    def __init__(self, delay_s: float, grace_s: float, *, clock: Callable[[], float] = time.monotonic, announce: bool = True) -> None:
        self.announce = announce  # log each signal at WARNING (the process the operator signals)
        self.delay_s = delay_s
        self.grace_s = grace_s
        self.clock = clock
        self.since: float | None = None
        self.begun = asyncio.Event()
        self.at_once = asyncio.Event()
        self.hooks: list[Callable[[], Awaitable[Any]]] = []
        self.drained: asyncio.Task[None] | None = None

    @classmethod
    def of(cls, config: NarwhalConfig) -> Stopping:
        sv = config.serving
        return cls(sv.shutdown_delay_ms / 1000.0, sv.shutdown_grace_ms / 1000.0)

    def install(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)) -> None:
        loop = asyncio.get_running_loop()
        for sig in signals:
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, self.signal, sig)

    def signal(self, sig: int | None = None) -> None:
        name = signal.Signals(sig).name if sig is not None else "stop"
        if self.since is None:
            self.since = self.clock()
            if self.announce:
                log.warning("%s: draining (/ready 503, new requests R01); listener open %.1f s, requests running have %.1f s; a second signal stops at once",
                            name, min(self.delay_s, self.grace_s), self.grace_s)
            self.begun.set()
            self.drained = asyncio.ensure_future(self._run_hooks())
        elif not self.at_once.is_set():
            log.log(logging.WARNING if self.announce else logging.DEBUG, "%s: the second signal; stopping at once", name)
            self.at_once.set()

    async def _run_hooks(self) -> None:
        for hook in self.hooks:
            try:
                await hook()
            except Exception:  # noqa: BLE001 - a failed hook must not stop the stop
                log.exception("while beginning to drain")

    def left(self, span_s: float) -> float:
        """Seconds left of `span_s` counted from the first signal (0 once at_once)."""
        if self.at_once.is_set():
            return 0.0
        if self.since is None:
            return span_s
        return max(0.0, span_s - (self.clock() - self.since))

    def grace_left(self) -> float:
        return self.left(self.grace_s)

    async def accepting(self) -> None:
        """Until the listener should close: the delay after the first signal (never past
        the grace: a grace shorter than the delay wins) and the hooks done (never past the
        grace either), or a second signal."""
        await self.begun.wait()

        async def delay_and_hooks() -> None:
            await asyncio.sleep(self.left(min(self.delay_s, self.grace_s)))
            if self.drained is not None:
                await asyncio.shield(self.drained)

        done = asyncio.ensure_future(delay_and_hooks())
        cut = asyncio.ensure_future(self.at_once.wait())
        try:
            await asyncio.wait((done, cut), timeout=max(self.left(min(self.delay_s, self.grace_s)), self.grace_left()), return_when=asyncio.FIRST_COMPLETED)
        finally:
            done.cancel()
            cut.cancel()


async def serve_until_stopped(app: Any, hc: HyperConfig, stopping: Stopping, *,
                              accepting: Callable[[], Awaitable[Any]] | None = None) -> None:
    """Serve (conn.serve: a LeanConnection per connection) until
    `accepting()` returns (default: `stopping.accepting`), then its graceful shutdown
    with what is left of the grace (`stopping.grace_left()`): the requests still running
    after it are cancelled (LeanConnection.cancel). `stopping.at_once` cuts at once, before or during the grace. Returns once
    hypercorn has run the app's lifespan shutdown (or, cut during it, once cancelled)."""
    from .conn import serve as lean_serve

    wait_accepting = accepting if accepting is not None else stopping.accepting
    closing = False

    async def trigger() -> None:
        nonlocal closing
        await wait_accepting()
        hc.graceful_timeout = stopping.grace_left()
        closing = True
        if stopping.announce:
            log.info("listener closed; requests running have %.1f s", hc.graceful_timeout)

    task = asyncio.ensure_future(lean_serve(app, hc, shutdown_trigger=trigger))
    cut = asyncio.ensure_future(stopping.at_once.wait())
    try:
        await asyncio.wait((task, cut), return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and closing:
            task.cancel()  # in the grace: hypercorn cancels the connections it waits for
        # (before the listener closed, the trigger returns now with no grace)
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled() or asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
    finally:
        cut.cancel()
        if not task.done():
            task.cancel()
