"""Small asyncio primitives for what the server holds per connection and per stream.

Memory per open stream is a target (docs/performance.md): asyncio.Queue allocates four
deques and an Event (3.3 KiB measured with tracemalloc) and asyncio.Event a deque (0.86
KiB), each before anything waits. hypercorn makes a Queue per request (the ASGI app's
receive messages), an Event per HTTP/1.1 connection and two per HTTP/2 stream. These keep
the same semantics with nothing allocated until a waiter exists:

  * `LeanQueue`: asyncio.Queue's FIFO with a bound (put waits while full, get waits while
    empty; get_nowait/put_nowait raise QueueEmpty/QueueFull), waiters woken first come
    first served, a cancelled waiter passing its wake-up on, as asyncio.Queue does.
    Items in a list: the bound is small (hypercorn's max_app_queue_size, 10).
  * `LeanEvent`: hypercorn's EventWrapper API (async set and clear, wait, is_set) over a
    flag and a lazily made list of waiters; `hook(key, cb)` runs cb once at set().
  * `LeanIdle`: hypercorn's keep-alive timer (AsyncioSingleTask running
    TCPServer._idle_timeout) as one loop timer. hypercorn stops the timer when a request
    starts and restarts it when the response ends, each time cancelling a task (and the
    task wait_for makes inside it) and awaiting it: two to four loop turns on every
    request's path before the app runs, and two tasks made per request. Same rule: a
    connection idle for keep_alive_timeout, or idle when the server stops, is closed.
  * `LeanLock`: asyncio.Lock (3.11's: FIFO, a woken waiter cancelled passes the wake-up
    on) without its instance dict: each client connection's send lock (conn.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

__all__ = ["LeanQueue", "LeanEvent", "LeanIdle", "LeanLock"]


def _wake_first(waiters: list[asyncio.Future[None]] | None) -> None:
    while waiters:
        w = waiters.pop(0)
        if not w.done():
            w.set_result(None)
            return


class LeanQueue:
    __slots__ = ("maxsize", "_items", "_getters", "_putters")

    def __init__(self, maxsize: int = 0) -> None:
        self.maxsize = maxsize
        self._items: list[Any] = []
        self._getters: list[asyncio.Future[None]] | None = None
        self._putters: list[asyncio.Future[None]] | None = None

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def full(self) -> bool:
        return 0 < self.maxsize <= len(self._items)

    def put_nowait(self, item: Any) -> None:
        if self.full():
            raise asyncio.QueueFull
        self._items.append(item)
        _wake_first(self._getters)

    def get_nowait(self) -> Any:
        if not self._items:
            raise asyncio.QueueEmpty
        item = self._items.pop(0)
        _wake_first(self._putters)
        return item

    async def put(self, item: Any) -> None:
        while self.full():
            if self._putters is None:
                self._putters = []
            fut = asyncio.get_running_loop().create_future()
            self._putters.append(fut)
            try:
                await fut
            except BaseException:
                fut.cancel()
                if fut in self._putters:
                    self._putters.remove(fut)
                elif not self.full() and not fut.cancelled():
                    _wake_first(self._putters)  # it was woken, then cancelled: pass it on
                raise
        self.put_nowait(item)

    async def get(self) -> Any:
        while not self._items:
            if self._getters is None:
                self._getters = []
            fut = asyncio.get_running_loop().create_future()
            self._getters.append(fut)
            try:
                await fut
            except BaseException:
                fut.cancel()
                if fut in self._getters:
                    self._getters.remove(fut)
                elif self._items and not fut.cancelled():
                    _wake_first(self._getters)
                raise
        return self.get_nowait()


class LeanLock:
    __slots__ = ("_locked", "_waiters")

    def __init__(self) -> None:
        self._locked = False
        self._waiters: list[asyncio.Future[bool]] | None = None

    def locked(self) -> bool:
        return self._locked

    async def acquire(self) -> bool:
        if not self._locked and (not self._waiters or all(w.cancelled() for w in self._waiters)):
            self._locked = True
            return True
        if self._waiters is None:
            self._waiters = []
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            try:
                await fut
            finally:
                self._waiters.remove(fut)
        except asyncio.CancelledError:
            if not self._locked:
                self._wake_up_first()  # it was woken, then cancelled: pass it on
            raise
        self._locked = True
        return True

    def release(self) -> None:
        if not self._locked:
            raise RuntimeError("Lock is not acquired.")
        self._locked = False
        self._wake_up_first()

    def _wake_up_first(self) -> None:
        if self._waiters:
            fut = self._waiters[0]
            if not fut.done():
                fut.set_result(True)

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()


class LeanEvent:
    __slots__ = ("_flag", "_waiters", "_hooks")

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[asyncio.Future[None]] | None = None
        self._hooks: dict[object, Callable[[], object]] | None = None

    def hook(self, key: object, cb: Callable[[], object]) -> None:
        """cb() once, at the next set() (a key hooks one callback; unhook(key) drops it)."""
        if self._hooks is None:
            self._hooks = {}
        self._hooks[key] = cb

    def unhook(self, key: object) -> None:
        if self._hooks is not None:
            self._hooks.pop(key, None)

    def is_set(self) -> bool:
        return self._flag

    async def set(self) -> None:
        if not self._flag:
            self._flag = True
            ws, self._waiters = self._waiters, None
            for w in ws or ():
                if not w.done():
                    w.set_result(None)
            hooks, self._hooks = self._hooks, None
            for cb in (hooks or {}).values():
                cb()

    async def clear(self) -> None:
        self._flag = False

    async def wait(self) -> None:
        if self._flag:
            return
        if self._waiters is None:
            self._waiters = []
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut
        finally:
            if self._waiters is not None and fut in self._waiters:
                self._waiters.remove(fut)


class LeanIdle:
    """The keep-alive timer of one hypercorn TCPServer (its `idle_task`): `restart` arms a
    loop timer of config.keep_alive_timeout, `stop` disarms it; neither suspends. When it
    fires, or the worker's `terminated` event is set while it is armed (the server is
    stopping), the connection is closed as hypercorn's _idle_timeout closes it
    (`_initiate_server_close`, as a task of the connection's task group). Invariant: once
    stop() returns, the timer closes nothing; a close already begun runs on, as hypercorn's
    shielded one does."""

    __slots__ = ("_server", "_terminated", "_handle", "_group", "_closing")

    def __init__(self, server: Any, terminated: LeanEvent) -> None:
        self._server = server
        self._terminated = terminated
        self._handle: asyncio.TimerHandle | None = None
        self._group: Any = None
        self._closing: asyncio.Task[None] | None = None

    async def restart(self, task_group: Any, action: object = None) -> None:
        """`action` (hypercorn passes its _idle_timeout) is what `_fire` does."""
        self.disarm()
        self._group = task_group
        if self._terminated.is_set():
            self._fire()
            return
        s = self._server
        self._handle = s.loop.call_later(s.config.keep_alive_timeout, self._fire)
        self._terminated.hook(self, self._fire)

    async def stop(self) -> None:
        self.disarm()

    def disarm(self) -> None:
        """stop(), from a callback (it never suspends)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
            self._terminated.unhook(self)

    def _fire(self) -> None:
        self.disarm()
        if self._closing is None and self._group is not None:
            self._closing = self._group.create_task(self._server._initiate_server_close())
