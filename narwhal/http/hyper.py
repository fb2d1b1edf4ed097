"""The server's hardening, its limits and its books: the defects a public router cannot
live with (first measured under hypercorn 0.18 and h2 4.x), each fixed where it lives --
HTTP/2's (1-4, 9, 10) in h2conn.py, which serves HTTP/2 over h2's public API; the
connection's (5, 6, 8) and items 14 and 16 in conn.py; HTTP/1.1's in h1/ (Narwhal's own
connection and ASGI cycle); the lean primitives of items 12 and 14 in lean.py.
`install(limits)` sets the limits before serving; what Narwhal uses of hypercorn and h2,
and why, is listed in overrides.py.

Upstream defects (docs/stack.md "hypercorn's defects"; measured under hypercorn 0.18.0 and h2 4.x; the tests of each fix are in tests/http and tests/abuse):
  1. h2 flow control: `H2Protocol._send_data` pops min(window, frame size) bytes; with a
     zero window that is `StreamBuffer.pop(0)`, which un-pauses the writer, so an app's
     sends never block and a stream's buffer grows without bound while the client reads
     nothing. Fixed (h2conn.py D1): a stream's data goes out as far as its window allows;
     with a zero window the app's send waits for a WINDOW_UPDATE, nothing is buffered.
  2. h2 stream limit: a stream beyond SETTINGS_MAX_CONCURRENT_STREAMS raises h2's
     TooManyStreamsError out of `receive_data`, and hypercorn drops the whole connection
     (every other stream on it). RFC 9113 5.1.2: refuse the stream. Fixed: the headers
     are decoded (HPACK state stays in step) and the stream is reset REFUSED_STREAM.
  3. h2 streams the app abandoned (a client that never read; its answer was given up)
     keep their buffer and stream slot. Fixed: reset CANCEL, buffer dropped.
  4. h2 control frames are not rate limited (SETTINGS/PING floods slowed other clients
     100x). Fixed: a token bucket per connection over SETTINGS, PING, RST_STREAM and
     empty DATA frames; a flood gets GOAWAY ENHANCE_YOUR_CALM and the connection closes.
     Rapid reset (CVE-2023-44487): a stream whose HEADERS and RST_STREAM arrive in the
     same read is dropped before hypercorn creates it, so it costs no ASGI task and never
     reaches the app (the app's own check catches a reset that arrives later); it is
     charged RAPID_RESET_COST tokens, the frames parsed for it.
  5. After a client's FIN the connection waits for the keep-alive timer (CLOSE-WAIT, a
     file descriptor held up to keep_alive_timeout). Fixed: EOF stops the idle timer.
  6. Not hypercorn's but the kernel's: a client socket's send buffer autotunes up to
     net.ipv4.tcp_wmem's maximum (4 MiB here), so a client that never reads makes the
     router relay megabytes (tens of thousands of events, and their CPU) before its
     writes block. Bounded: SO_SNDBUF of CLIENT_SNDBUF per client socket, ample for
     token streams (a few KB/s each) and for any answer the router assembles.
  7. hypercorn answers bytes that are not an HTTP/1.1 request (400) and an oversized head
     (431) with an empty body. Fixed (h1/cycle.py A3): the error envelope of rows H08
     and H09.
  8. Not a hypercorn defect but what the calm answer above leaves open: an attacker whose
     connection got ENHANCE_YOUR_CALM reconnects at once, and every frame of the next
     flood is parsed again. Bounded: its address is penalised for
     serving.abuse_penalty_ms; while penalised, its new connections are closed at accept,
     before any byte is read (at most PENALTY_ADDRESSES addresses, oldest forgotten). The
     app penalises the same way for abuse it sees itself (`penalise`: row H10).
  9. hypercorn hands h2 a whole read (up to 64 KiB) at once, and h2 parses every frame in
     it before the loop runs anything else: 520 streams' HEADERS in one read cost ~50 ms of
     pure-Python parsing, a stall for every other client. Fixed: a read is fed to h2 in
     FEED_BYTES pieces with a loop turn between them (no more bytes are read from that
     connection meanwhile), so one connection holds the loop ~5 ms at most per turn.
     Streams refused past the stream limit (2) count against the control-frame bucket
     (4): each costs a RST_STREAM, and a client that keeps opening them is flooding.
  10. A deadlock: the app's receive queue holds max_app_queue_size (10) messages, and
     the connection's reader blocks putting more body into it. An app that answers
     before reading the whole body (408 H07, R03, a client gone) ends its stream, and
     hypercorn then puts http.disconnect into that same full queue from the app's own
     task: the app waits for itself, the reader waits for the app, the connection and
     the request are held for ever (1-byte chunked uploads left every request open).
     Fixed: when the queue is full at StreamClosed, the unread body messages are
     dropped (nobody will read them) and the disconnect is queued without waiting.
  HTTP/1.1 is no longer hypercorn's: narwhal/http/h1/ (its connection, states table and
  ASGI cycle, with the direct path) serves it, and conn.py runs it.
  Also counted here: the open client connections by protocol and state, for /metrics.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from hypercorn.config import Config as HyperConfig

from .h1.cycle import H1Direct
from .h1fast import CLOSE, DIRECT, DIRECT_BUFFER, CloseHook
from .lean import LeanQueue

__all__ = ["Limits", "ConnectionCounts", "COUNTS", "install", "limits", "penalise", "ConnectionCollector",
           "H1Direct", "DIRECT", "DIRECT_BUFFER", "CloseHook", "CLOSE", "ServerConfig", "spawn_lean_app", "run_app"]


@dataclass(frozen=True, slots=True)
class Limits:
    control_frames_per_s: int = 200
    abuse_penalty_s: float = 10.0  # serving.abuse_penalty_ms; 0: off


@dataclass
class ConnectionCounts:
    """Open client connections: total, and how many have a request in flight (busy)."""

    open: int = 0
    busy: int = 0
    h2: int = 0  # HTTP/2 connections open
    refused_streams: int = 0  # streams refused past max_streams_per_connection (total)
    calmed: int = 0  # connections closed with ENHANCE_YOUR_CALM (total)
    penalised: int = 0  # connections closed at accept, their address penalised (total)


class ConnectionCollector:
    """/metrics: narwhal_client_connections{state=idle|busy} (busy: a request in flight),
    narwhal_client_connections_h2, and the totals of refused streams and calmed floods."""

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        g = GaugeMetricFamily("narwhal_client_connections", "Open client connections, by state (busy: a request in flight).", labels=["state"])
        g.add_metric(["idle"], COUNTS.open - COUNTS.busy)
        g.add_metric(["busy"], COUNTS.busy)
        yield g
        yield GaugeMetricFamily("narwhal_client_connections_h2", "Open HTTP/2 client connections.", value=COUNTS.h2)
        yield CounterMetricFamily("narwhal_h2_refused_streams", "HTTP/2 streams refused past serving.max_streams_per_connection.", value=COUNTS.refused_streams)
        yield CounterMetricFamily("narwhal_h2_calmed_connections", "HTTP/2 connections closed with ENHANCE_YOUR_CALM (control-frame floods).", value=COUNTS.calmed)
        yield CounterMetricFamily("narwhal_penalised_connections", "Client connections closed at accept: their address was calmed within serving.abuse_penalty_ms.", value=COUNTS.penalised)
        yield GaugeMetricFamily("narwhal_penalised_addresses", "Client addresses currently penalised.", value=PENALTIES.size())


PENALTY_ADDRESSES = 65536  # the most addresses remembered at once


class Penalties:
    """Defect 8: client addresses penalised until a monotonic time, in a bounded table
    (insertion-ordered: the oldest penalty is forgotten first when it is full)."""

    def __init__(self, limit: int = PENALTY_ADDRESSES) -> None:
        self.limit = limit
        self._until: dict[str, float] = {}
        # told of every penalty this process decides (with serving.workers > 1 the other
        # workers learn it through the authority: narwhal/workers.py)
        self.listener: Any = None

    def size(self) -> int:
        return len(self._until)

    def penalise(self, addr: str, seconds: float, now: float, *, shared: bool = True) -> None:
        """`shared`: a penalty decided here (passed to the listener); False for one
        another worker decided."""
        if seconds <= 0.0:
            return
        self._until.pop(addr, None)
        while len(self._until) >= self.limit:
            del self._until[next(iter(self._until))]
        self._until[addr] = now + seconds
        if shared and self.listener is not None:
            self.listener(addr, seconds)

    def penalised(self, addr: str, now: float) -> bool:
        until = self._until.get(addr)
        if until is None:
            return False
        if until <= now:
            del self._until[addr]
            return False
        return True

    def clear(self) -> None:
        self._until.clear()


COUNTS = ConnectionCounts()
PENALTIES = Penalties()
_LIMITS = Limits()


CLIENT_SNDBUF = 256 * 1024  # bytes (the kernel doubles it for its bookkeeping)


class ServerConfig(HyperConfig):
    """Item 13: response_headers computed once per second and protocol (a new list each
    call: hypercorn extends it)."""

    narwhal_dates: dict[str, tuple[int, list[tuple[bytes, bytes]]]]

    def response_headers(self, protocol: str) -> list[tuple[bytes, bytes]]:
        now = int(time.time())
        cache = self.__dict__.setdefault("narwhal_dates", {})
        hit = cache.get(protocol)
        if hit is None or hit[0] != now:
            hit = cache[protocol] = (now, super().response_headers(protocol))
        return list(hit[1])


def spawn_lean_app(spawn: Any, loop: asyncio.AbstractEventLoop, app: Any, config: Any, scope: Any, send: Any) -> Any:
    """Item 12: the app's task, its receive queue a LeanQueue, for any task group's `spawn`
    (conn.ConnTasks'): returns the app's app_put."""
    app_queue = LeanQueue(config.max_app_queue_size)
    sync_spawn, call_soon = _loop_helpers(loop)
    spawn(run_app, app, config, scope, app_queue.get, send, sync_spawn, call_soon)
    return app_queue.put


async def run_app(app: Any, config: Any, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> None:
    """One ASGI call as the server makes it: an exception the app raises is logged (the
    server's error log), and send(None) tells the stream the app has ended, always."""
    try:
        await app(scope, receive, send, sync_spawn, call_soon)
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - the app's failure is logged, its stream ended below
        await config.log.exception("Error in ASGI Framework")
    finally:
        await send(None)


_HELPERS: tuple[Any, Any, Any] | None = None  # (loop, sync_spawn, call_soon): one loop per process


def _loop_helpers(loop: asyncio.AbstractEventLoop) -> tuple[Any, Any]:
    """hypercorn's per-request sync_spawn and call_soon depend on the loop alone: made once
    per loop, not per request (0.5 KiB per open stream)."""
    global _HELPERS
    if _HELPERS is None or _HELPERS[0] is not loop:

        def _call_soon(func: Any, *args: Any) -> Any:
            return asyncio.run_coroutine_threadsafe(func(*args), loop).result()

        _HELPERS = (loop, partial(loop.run_in_executor, None), _call_soon)
    return _HELPERS[1], _HELPERS[2]


def penalise(scope: dict[str, Any]) -> None:
    """Penalise the client address of an ASGI scope for serving.abuse_penalty_ms (defect
    8): for abuse the app sees (H10, a body in 1-byte pieces), as for a calmed flood."""
    client = scope.get("client")
    if client:
        PENALTIES.penalise(client[0], _LIMITS.abuse_penalty_s, time.monotonic())


def install(limits: Limits) -> None:
    """Serve with these limits (idempotent)."""
    global _LIMITS
    _LIMITS = limits


def limits() -> Limits:
    return _LIMITS
