"""Serving under hypercorn (the settings; narwhal/compose.py runs it): HTTP/1.1 and HTTP/2 cleartext (prior knowledge and h2c
upgrade) on one port; HTTPS with HTTP/2 negotiated by ALPN when serving.tls is set.

hypercorn closes a connection after keep_alive_max_requests requests (HTTP/2: GOAWAY)
by default after 1000 (STACK.md); a router holds long-lived client connections, so the
limit is raised far out of reach.
"""

from __future__ import annotations

import gc
import logging
import os
import socket

from hypercorn.config import Config as HyperConfig

from ..config import NarwhalConfig
from . import hyper

__all__ = ["hypercorn_config", "split_listen", "free_port", "settle_heap", "raise_nofile", "serving_config"]

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
                     keep_alive_ms: int = 5000, max_streams: int = 100) -> HyperConfig:
    c = HyperConfig()
    c.bind = [listen]
    c.keep_alive_max_requests = 1 << 40
    # serving.keep_alive_ms: an idle connection (or one whose request head is still
    # arriving: the idle timer runs until a request starts) closes after this long
    c.keep_alive_timeout = keep_alive_ms / 1000.0
    c.h2_max_concurrent_streams = max_streams  # serving.max_streams_per_connection
    c.backlog = 4096
    c.graceful_timeout = 5.0
    c.accesslog = None
    c.errorlog = logging.getLogger("hypercorn.error")
    c.loglevel = log_level.upper()
    if certfile and keyfile:
        c.certfile, c.keyfile = certfile, keyfile
        c.alpn_protocols = ["h2", "http/1.1"]
    return c


def serving_config(config: NarwhalConfig, listen: str) -> HyperConfig:
    """hypercorn's configuration from serving.*, with the hardened protocol installed
    (narwhal/http/hyper.py)."""
    sv = config.serving
    hyper.install(hyper.Limits(control_frames_per_s=sv.h2_control_frames_per_second, abuse_penalty_s=sv.abuse_penalty_ms / 1000.0))
    return hypercorn_config(listen, certfile=sv.tls.certfile, keyfile=sv.tls.keyfile, keep_alive_ms=sv.keep_alive_ms, max_streams=sv.max_streams_per_connection)
