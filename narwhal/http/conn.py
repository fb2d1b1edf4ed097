"""Client connections as asyncio protocols, and the listener that makes them.

hypercorn's asyncio server (hypercorn/asyncio/run.py, tcp_server.py) gives each
connection a task reading through an asyncio StreamReader and writing through a
StreamWriter (with its StreamReaderProtocol), and an asyncio.TaskGroup for the
connection's tasks: ~6 KiB per open connection measured with tracemalloc, a quarter of
what an open stream costs the router (docs/performance.md), and a task wake-up for
every read. `LeanConnection` is that server (with hyper.py's defects 5, 6 and 8 and item
14) as one protocol object: each read is handed from `data_received` to the connection's
protocol -- Narwhal's HTTP/1.1 (h1.cycle.H1Server) or, negotiated by ALPN, switched to by
a prior-knowledge preface or an h2c upgrade, HTTP/2 (h2conn.H2Server, over h2's public API).

Invariants, each TCPServer's:
  * The protocol's handle() calls run one at a time, in the order the bytes came
    (then the end of reading: Closed). One runs to its end inside the callback unless it
    suspends (the app's receive queue is full, a send waits for the client to drain,
    h2's feed turns of defect 9); then reading pauses, a task finishes it, and what came
    meanwhile waits its turn: at most one read, the end of reading and the loss.
  * Writes (protocol_send RawData) hold the connection's send lock and wait while the
    transport's buffer is over its high-water mark, as StreamWriter.drain waits; a lost
    connection makes them raise ConnectionResetError, which hypercorn turns into Closed.
  * The connection ends -- closed, counted out, forgotten by the listener -- once reading
    has ended (the client's FIN, the loss, the server's close) and every task it spawned
    (the apps', the idle close) is done: as hypercorn's `async with TaskGroup` would.
  * A task of the connection that raises (the app's are caught by hyper.run_app)
    ends the connection and its other tasks, as an asyncio.TaskGroup would.
  * `serve`: hypercorn's worker_serve -- lifespan, the listeners, the shutdown trigger,
    then config.graceful_timeout for the connections to end, then what still runs is
    cancelled (`LeanConnection.cancel`) and its end awaited (at most CANCEL_WAIT_S), then
    the lifespan's shutdown. config.read_timeout is not used (Narwhal never sets it).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from random import randint
from typing import Any

from hypercorn.asyncio.lifespan import Lifespan
from hypercorn.asyncio.statsd import StatsdLogger
from hypercorn.asyncio.worker_context import WorkerContext
from hypercorn.config import Config as HyperConfig
from hypercorn.events import Closed, RawData, Updated
from hypercorn.typing import ConnectionState
from hypercorn.utils import (
    ShutdownError,
    parse_socket_addr,
    raise_shutdown,
    repr_socket_addr,
)

from . import hyper
from .h1.cycle import H1Server
from .h2conn import H2Server
from .lean import LeanEvent, LeanIdle, LeanLock

__all__ = ["LeanConnection", "ConnTasks", "Live", "Asgi", "LeanContext", "serve", "CANCEL_WAIT_S"]

log = logging.getLogger("narwhal.http.conn")

CANCEL_WAIT_S = 5.0  # after the grace: the longest wait for cancelled connections to unwind


class LeanContext(WorkerContext):
    """hypercorn's WorkerContext whose events are LeanEvents (item 12): the class's own
    `event_class`, a public attribute set on a subclass."""

    event_class = LeanEvent  # type: ignore[assignment]


class ConnTasks:
    """The connection's tasks (the task group its protocols spawn in)."""

    __slots__ = ("_conn", "tasks")

    def __init__(self, conn: LeanConnection) -> None:
        self._conn = conn
        self.tasks: list[asyncio.Task[Any]] = []  # one at a time over HTTP/1.1: a list is a third of a set

    async def spawn_app(self, app: Any, config: Any, scope: Any, send: Any) -> Any:
        return hyper.spawn_lean_app(self.spawn, self._conn.loop, app, config, scope, send)

    def spawn(self, func: Callable[..., Coroutine[Any, Any, Any]], *args: Any) -> None:
        self.create_task(func(*args))

    def create_task(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        t = self._conn.loop.create_task(coro)
        self.tasks.append(t)
        t.add_done_callback(self._done)
        return t

    def _done(self, t: asyncio.Task[Any]) -> None:
        if t in self.tasks:
            self.tasks.remove(t)
        if not t.cancelled() and t.exception() is not None:
            self._conn._failed(t.exception())  # type: ignore[arg-type]
        self._conn._maybe_end()


class Live:
    """The listener's open connections; `wait_empty` until none is left."""

    __slots__ = ("conns", "_empty")

    def __init__(self) -> None:
        self.conns: set[LeanConnection] = set()
        self._empty: asyncio.Future[None] | None = None

    def add(self, c: LeanConnection) -> None:
        self.conns.add(c)

    def discard(self, c: LeanConnection) -> None:
        self.conns.discard(c)
        if not self.conns and self._empty is not None and not self._empty.done():
            self._empty.set_result(None)

    async def wait_empty(self, timeout_s: float) -> bool:
        """True once no connection is open; False after `timeout_s` with some open."""
        if not self.conns:
            return True
        if self._empty is None or self._empty.done():
            self._empty = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._empty), max(0.0, timeout_s))
        except TimeoutError:
            return False
        return True


class LeanConnection(asyncio.Protocol):
    """One client connection: hypercorn's TCPServer as a protocol (the module's docstring
    states its invariants). `transport` and `send_lock` are what H1Direct writes with."""


    __slots__ = (
        "app", "loop", "config", "context", "state", "live", "transport", "protocol", "send_lock", "idle_task", "_group",
        "_busy", "_running", "_backlog", "_reading", "_read_paused", "_lost", "_lost_exc", "_write_paused", "_drain",
        "_closers", "_ended", "_ssl", "_ends",
    )

    def __init__(self, app: Any, loop: asyncio.AbstractEventLoop, config: HyperConfig, context: WorkerContext, state: Any, live: Live) -> None:
        self.app = app
        self.loop = loop
        self.config = config
        self.context = context
        self.state = state
        self.live = live
        self.transport: Any = None
        self.protocol: Any = None  # H1Server or H2Server
        self.send_lock = LeanLock()
        terminated = context.terminated
        assert isinstance(terminated, LeanEvent), "a LeanContext"
        self.idle_task = LeanIdle(self, terminated)  # item 14
        self._group = ConnTasks(self)
        self._busy = False
        self._running: Any = None  # the handle() that suspended: the future it waits on, then its task
        self._backlog: list[Event] | None = None
        self._reading = True
        self._read_paused = False
        self._lost = False
        self._lost_exc: BaseException | None = None
        self._write_paused = False
        self._drain: list[asyncio.Future[None]] | None = None
        self._closers: list[asyncio.Future[None]] | None = None
        self._ended = False
        self._ssl = False
        self._ends: tuple[Any, Any] = (None, None)

    # -- asyncio.Protocol --------------------------------------------------------------

    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        peer = transport.get_extra_info("peername")
        if not peer or PENALTIES.penalised(peer[0], time.monotonic()):  # defect 8 (or gone already)
            if peer:
                COUNTS.penalised += 1
            self._reading = False
            self._ended = True
            transport.abort()
            return
        sock = transport.get_extra_info("socket")
        family = getattr(sock, "family", socket.AF_INET)
        if sock is not None:  # defect 6
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, hyper.CLIENT_SNDBUF)
            except OSError:
                pass
        ssl_object = transport.get_extra_info("ssl_object")
        self._ssl = ssl_object is not None
        alpn = (ssl_object.selected_alpn_protocol() or "http/1.1") if ssl_object is not None else "http/1.1"
        COUNTS.open += 1
        self.live.add(self)
        self._ends = (_addr(family, peer), _addr(family, transport.get_extra_info("sockname")))
        if alpn == "h2":
            self.protocol = self._h2()
        else:
            self.protocol = H1Server(self.app, self.config, self.context, self._group, ConnectionState(self.state), self._ssl, self._ends[0], self._ends[1], self)
        self._submit(_BEGIN)

    def _h2(self) -> H2Server:
        return H2Server(self.app, self.config, self.context, self._group, ConnectionState(self.state), self._ssl, self._ends[0], self._ends[1], self)

    async def switch_h2(self, data: bytes, headers: list[tuple[bytes, bytes]] | None, settings: bytes | None) -> None:
        """The connection goes on as HTTP/2: prior knowledge (`data` starts with the
        preface) or an h2c upgrade (`headers`, `settings`: the upgraded request, stream 1)."""
        self.protocol = h2 = self._h2()
        if headers is None:
            await h2.initiate()
        else:
            await h2.initiate(headers, settings)
        if data:
            await h2.handle(RawData(data=data))

    def data_received(self, data: bytes) -> None:
        if self._reading:
            self._submit(RawData(data))

    def eof_received(self) -> bool:
        self._end_reading()
        return not self._ssl  # keep the write side open (StreamReaderProtocol's answer)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._lost_exc = exc
        for w in self._drain or ():
            if not w.done():
                w.set_result(None) if exc is None else w.set_exception(exc)
        self._drain = None
        for w in self._closers or ():
            if not w.done():
                w.set_result(None)
        self._closers = None
        self._end_reading()
        self._maybe_end()

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for w in self._drain or ():
            if not w.done():
                w.set_result(None)
        self._drain = None

    # -- the handle() calls, one at a time ----------------------------------------------

    def _end_reading(self) -> None:
        if self._reading:
            self._reading = False
            self._submit(_READ_ENDED)

    def _submit(self, event: Event) -> None:
        if self._running is not None:  # one is suspended: after it (reading is paused)
            if self._backlog is None:
                self._backlog = []
            self._backlog.append(event)
            return
        self._drive(self._coro(event))

    def _coro(self, event: Event) -> Coroutine[Any, Any, None]:
        if event is _BEGIN:
            return self._begin()
        if event is _READ_ENDED:
            return self._read_ended()
        assert self.protocol is not None
        return self.protocol.handle(event)

    async def _begin(self) -> None:
        assert self.protocol is not None
        await self.protocol.initiate()
        await self.idle_task.restart(self._group, None)

    async def _read_ended(self) -> None:
        assert self.protocol is not None
        await self.protocol.handle(Closed())
        self.idle_task.disarm()  # defect 5: after the FIN the keep-alive timer holds nothing open

    def _drive(self, coro: Coroutine[Any, Any, None] | None) -> None:
        """Run handle() calls in this callback until the backlog is empty or one suspends."""
        while coro is not None:
            try:
                waits = coro.send(None)
            except StopIteration:
                coro = self._next()
                continue
            except BaseException as e:  # noqa: BLE001 - hypercorn's run() would end with it
                self._failed(e)
                return
            self._suspended(coro, waits)
            return
        if self._read_paused and self._reading and not self._lost:
            self._read_paused = False
            self.transport.resume_reading()
        self._maybe_end()

    def _next(self) -> Coroutine[Any, Any, None] | None:
        b = self._backlog
        if not b:
            return None
        return self._coro(b.pop(0))

    def _suspended(self, coro: Coroutine[Any, Any, None], waits: Any) -> None:
        """`coro` yielded `waits` (a future, or None: a bare yield, asyncio.sleep(0)): a task
        resumes it once that is done (a task resumes a coroutine where it stopped)."""
        if self._reading and not self._read_paused and not self._lost:
            self._read_paused = True
            self.transport.pause_reading()
        if waits is None:
            self._handoff(coro)
            return
        waits._asyncio_future_blocking = False  # as Task.__step does before it waits
        self._running = waits
        waits.add_done_callback(lambda _f: self._handoff(coro))

    def _handoff(self, coro: Coroutine[Any, Any, None]) -> None:
        t = self._running = self.loop.create_task(coro)
        t.add_done_callback(self._resumed)

    def _resumed(self, t: asyncio.Task[None]) -> None:
        self._running = None
        if t.cancelled():  # cancel() (or, never expected, another's): the connection ends
            self.cancel()
            return
        e = t.exception()
        if e is not None:
            self._failed(e)
            return
        self._drive(self._next())

    # -- hypercorn's TCPServer ------------------------------------------------------------

    async def protocol_send(self, event: Any) -> None:
        # type(), not isinstance(): hypercorn's events are ABCs (a Python-level check each)
        # and it sends these classes exactly
        kind = type(event)
        if kind is RawData:
            async with self.send_lock:
                try:
                    self.transport.write(event.data)
                    await self._drained()
                except (ConnectionError, RuntimeError):
                    assert self.protocol is not None
                    await self.protocol.handle(Closed())
        elif kind is Closed:
            await self._close()
        elif kind is Updated:
            if event.idle == self._busy:
                self._busy = not event.idle
                COUNTS.busy += 1 if self._busy else -1
            if event.idle:
                await self.idle_task.restart(self._group, None)
            else:
                self.idle_task.disarm()

    async def _drained(self) -> None:
        """StreamWriter.drain: a closing transport gets a loop turn (its loss may be due),
        a lost one raises, a paused one waits for resume_writing (or the loss)."""
        if self.transport.is_closing():
            await asyncio.sleep(0)
        if self._lost:
            raise self._lost_exc if isinstance(self._lost_exc, ConnectionError) else ConnectionResetError("Connection lost")
        if not self._write_paused:
            return
        w = self.loop.create_future()
        if self._drain is None:
            self._drain = []
        self._drain.append(w)
        await w

    async def _close(self) -> None:
        try:
            self._shut()
            if not self._lost:
                w = self.loop.create_future()
                if self._closers is None:
                    self._closers = []
                self._closers.append(w)
                await w
        except (BrokenPipeError, ConnectionAbortedError, ConnectionResetError, RuntimeError, asyncio.CancelledError):
            pass  # hypercorn's _close swallows these, a cancellation included
        finally:
            self.idle_task.disarm()

    def _shut(self) -> None:
        """FIN after what is written, then close (hypercorn's _close without its wait)."""
        t = self.transport
        try:
            t.write_eof()
        except (NotImplementedError, OSError, RuntimeError):
            pass  # TLS, or closed already
        t.close()

    async def _initiate_server_close(self) -> None:
        """The keep-alive timer's close (LeanIdle)."""
        assert self.protocol is not None
        await self.protocol.handle(Closed())
        self.transport.close()

    # -- the end -----------------------------------------------------------------------

    def _maybe_end(self) -> None:
        if self._ended or self._reading or self._running is not None or self._backlog or self._group.tasks:
            return
        self._ended = True
        self.idle_task.disarm()
        if not self._lost:
            self._shut()
        COUNTS.open -= 1
        if self._busy:
            self._busy = False
            COUNTS.busy -= 1
        self.live.discard(self)

    def _failed(self, e: BaseException) -> None:
        """A handle() or a task of the connection raised: logged, the rest cancelled, the
        connection closed (hypercorn's TaskGroup and its run()'s finally)."""
        if not isinstance(e, (OSError, asyncio.CancelledError)):
            self.loop.call_exception_handler({"message": "client connection failed", "exception": e, "protocol": self})
        self.cancel()

    def cancel(self) -> None:
        """Cancel what the connection runs (the grace is over, or it failed); it ends once
        that has unwound, and its transport is closed then."""
        if self._reading:
            self._reading = False
            if not self._read_paused and not self._lost:
                self._read_paused = True
                self.transport.pause_reading()
        self._backlog = None
        r = self._running
        if r is not None:
            r.cancel()
        for t in list(self._group.tasks):
            t.cancel()
        self._maybe_end()


class Asgi:
    """hypercorn's ASGIWrapper (an ASGI 3 app called with hypercorn's two extra arguments)
    without a coroutine of its own: the app's coroutine is what hypercorn awaits, so an
    open stream holds no frame of this layer. An app with a `call` method (the router's
    front, app._Front) is entered there: the same ASGI call, returning its coroutine."""

    __slots__ = ("app",)

    def __init__(self, app: Any) -> None:
        self.app = getattr(app, "call", app)

    def __call__(self, scope: Any, receive: Any, send: Any, sync_spawn: Any, call_soon: Any) -> Awaitable[None]:
        return self.app(scope, receive, send)  # type: ignore[no-any-return]


def _addr(family: int, addr: Any) -> tuple[str, int] | None:
    """hypercorn's parse_socket_addr, the host interned: every connection from one address
    shares its string (memory per open stream)."""
    a = parse_socket_addr(family, addr)
    return None if a is None else (sys.intern(a[0]), a[1])


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


Event = Any  # RawData | _Marker
_BEGIN = _Marker("begin")  # initiate() and the keep-alive timer's first start
_READ_ENDED = _Marker("read-ended")  # Closed, then the timer stops (defect 5)
COUNTS = hyper.COUNTS
PENALTIES = hyper.PENALTIES


async def serve(app: Any, config: HyperConfig, *, shutdown_trigger: Callable[[], Awaitable[Any]]) -> None:
    """hypercorn.asyncio.serve (its worker_serve) with a LeanConnection per connection;
    `app` is an ASGI 3 application."""
    wrapped = Asgi(app)
    config.set_statsd_logger_class(StatsdLogger)
    loop = asyncio.get_running_loop()
    lifespan_state: dict[str, Any] = {}
    lifespan = Lifespan(wrapped, config, loop, lifespan_state)
    lifespan_task = loop.create_task(lifespan.handle_lifespan())
    await lifespan.wait_for_startup()
    if lifespan_task.done():
        exception = lifespan_task.exception()
        if exception is not None:
            raise exception
    sockets = config.create_sockets()
    if sockets.quic_sockets:
        raise ValueError("HTTP/3 (quic_bind) is not served")
    max_requests = None
    if config.max_requests is not None:
        max_requests = config.max_requests + randint(0, config.max_requests_jitter)
    context = LeanContext(max_requests)
    live = Live()

    def factory() -> LeanConnection:
        return LeanConnection(wrapped, loop, config, context, lifespan_state, live)

    servers = []
    ssl_context = config.create_ssl_context() if config.ssl_enabled else None
    for sock in sockets.secure_sockets:
        servers.append(await loop.create_server(factory, sock=sock, backlog=config.backlog, ssl=ssl_context, ssl_handshake_timeout=config.ssl_handshake_timeout))
        await config.log.info(f"Running on https://{repr_socket_addr(sock.family, sock.getsockname())} (CTRL + C to quit)")
    for sock in sockets.insecure_sockets:
        servers.append(await loop.create_server(factory, sock=sock, backlog=config.backlog))
        await config.log.info(f"Running on http://{repr_socket_addr(sock.family, sock.getsockname())} (CTRL + C to quit)")
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(raise_shutdown(shutdown_trigger))
            tg.create_task(raise_shutdown(context.terminate.wait))
    except BaseExceptionGroup as error:
        _, other_errors = error.split((ShutdownError, KeyboardInterrupt))
        if other_errors is not None:
            raise other_errors from None
    except (ShutdownError, KeyboardInterrupt):
        pass
    finally:
        await context.terminated.set()
        for server in servers:
            server.close()
            await server.wait_closed()
        try:
            await live.wait_empty(config.graceful_timeout)
        finally:
            for c in list(live.conns):
                c.cancel()
            await live.wait_empty(CANCEL_WAIT_S)
            await lifespan.wait_for_shutdown()
            lifespan_task.cancel()
            await lifespan_task
