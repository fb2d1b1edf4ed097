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
    flag and a lazily made list of waiters.
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["LeanQueue", "LeanEvent"]


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


class LeanEvent:
    __slots__ = ("_flag", "_waiters")

    def __init__(self) -> None:
        self._flag = False
        self._waiters: list[asyncio.Future[None]] | None = None

    def is_set(self) -> bool:
        return self._flag

    async def set(self) -> None:
        if not self._flag:
            self._flag = True
            ws, self._waiters = self._waiters, None
            for w in ws or ():
                if not w.done():
                    w.set_result(None)

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
