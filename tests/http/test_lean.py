"""narwhal/http/lean.py: LeanQueue and LeanEvent behave as asyncio.Queue and hypercorn's
EventWrapper do (hyper.py item 12 swaps them in for memory per open stream); LeanIdle
closes as hypercorn's keep-alive task does (item 14); LeanLock locks as asyncio.Lock
(item 16's send lock)."""

from __future__ import annotations

import asyncio
import tracemalloc
from typing import Any

import pytest

from narwhal.http.lean import LeanEvent, LeanLock, LeanQueue


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


@pytest.mark.parametrize("make", [lambda n: asyncio.Queue(n), lambda n: LeanQueue(n)], ids=["asyncio", "lean"])
def test_same_behaviour_as_asyncio_queue(make: Any) -> None:
    """FIFO, the bound (put waits while full), nowait errors, a waiting get woken by a put."""
    async def main() -> list[Any]:
        q = make(2)
        seen: list[Any] = [q.empty(), q.full()]
        q.put_nowait(1)
        await q.put(2)
        seen += [q.full(), q.qsize()]
        with pytest.raises(asyncio.QueueFull):
            q.put_nowait(3)
        blocked = asyncio.ensure_future(q.put(3))
        await asyncio.sleep(0.01)
        seen.append(blocked.done())
        seen.append(await q.get())  # makes room: the waiting put goes in
        await asyncio.wait_for(blocked, 1)
        seen += [q.get_nowait(), await q.get()]
        with pytest.raises(asyncio.QueueEmpty):
            q.get_nowait()
        getter = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.01)
        q.put_nowait("late")
        seen.append(await asyncio.wait_for(getter, 1))
        return seen

    assert run(main()) == [True, False, True, 2, False, 1, 2, 3, "late"]


def test_a_cancelled_getter_passes_its_wake_up_on() -> None:
    """Two getters wait; the first is woken and cancelled in the same turn: the item goes
    to the second, as asyncio.Queue does."""
    async def main() -> Any:
        q = LeanQueue(10)
        g1 = asyncio.ensure_future(q.get())
        g2 = asyncio.ensure_future(q.get())
        await asyncio.sleep(0.01)
        q.put_nowait("x")
        g1.cancel()
        return await asyncio.wait_for(g2, 1)

    assert run(main()) == "x"


def test_a_cancelled_putter_leaves_no_waiter_behind() -> None:
    async def main() -> int:
        q = LeanQueue(1)
        q.put_nowait(1)
        p = asyncio.ensure_future(q.put(2))
        await asyncio.sleep(0.01)
        p.cancel()
        await asyncio.sleep(0)
        assert q.get_nowait() == 1
        return len(q._putters or [])

    assert run(main()) == 0


_LOCK_SCRIPTS = {
    # (task, step) in order; steps: "take" (async with, hold until "drop"), "drop", "cancel"
    "uncontended": [("a", "take"), ("a", "drop")],
    "fifo": [("a", "take"), ("b", "take"), ("c", "take"), ("a", "drop"), ("b", "drop"), ("c", "drop")],
    "waiter_cancelled": [("a", "take"), ("b", "take"), ("c", "take"), ("b", "cancel"), ("a", "drop"), ("c", "drop")],
    "woken_then_cancelled": [("a", "take"), ("b", "take"), ("c", "take"), ("a", "drop_and_cancel_b"), ("c", "drop")],
}


@pytest.mark.parametrize("script", list(_LOCK_SCRIPTS), ids=list(_LOCK_SCRIPTS))
def test_lean_lock_locks_as_asyncio_lock(script: str) -> None:
    """The same script under asyncio.Lock and LeanLock: who holds it after each step, who
    was cancelled, and the lock free at the end."""
    async def play(lock: Any) -> list[Any]:
        log: list[Any] = []
        gates: dict[str, asyncio.Event] = {}
        tasks: dict[str, asyncio.Task[None]] = {}

        async def holder(name: str) -> None:
            try:
                async with lock:
                    log.append(("holds", name))
                    await gates[name].wait()
            except asyncio.CancelledError:
                log.append(("cancelled", name))
                raise

        for name, step in _LOCK_SCRIPTS[script]:
            if step == "take":
                gates[name] = asyncio.Event()
                tasks[name] = asyncio.ensure_future(holder(name))
            elif step == "drop":
                gates[name].set()
            elif step == "cancel":
                tasks[name].cancel()
            elif step == "drop_and_cancel_b":
                gates[name].set()
                await asyncio.sleep(0)  # a releases: b is woken but has not run
                tasks["b"].cancel()
            for _ in range(5):
                await asyncio.sleep(0)
            log.append(("locked", lock.locked()))
        await asyncio.gather(*tasks.values(), return_exceptions=True)
        return log + [lock.locked()]

    assert run(play(LeanLock())) == run(play(asyncio.Lock()))


def test_lean_event() -> None:
    async def main() -> list[Any]:
        e = LeanEvent()
        w = asyncio.ensure_future(e.wait())
        await asyncio.sleep(0.01)
        out: list[Any] = [e.is_set(), w.done()]
        await e.set()
        await asyncio.wait_for(w, 1)
        out.append(e.is_set())
        await e.wait()  # set: returns at once
        await e.clear()
        out.append(e.is_set())
        return out

    assert run(main()) == [False, False, True, False]


def test_they_are_lean() -> None:
    """What they are for: a fraction of asyncio's allocation before anything waits."""
    def size(make: Any) -> int:
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            keep = [make() for _ in range(200)]
            n = tracemalloc.get_traced_memory()[0] - before
            del keep
            return n
        finally:
            tracemalloc.stop()

    assert size(lambda: LeanQueue(10)) * 4 < size(lambda: asyncio.Queue(10))
    assert size(LeanEvent) * 2 < size(asyncio.Event)
    assert size(LeanLock) < size(asyncio.Lock)  # no instance dict (~40 bytes less with key-sharing dicts)


class _Server:
    """What LeanIdle uses of hypercorn's TCPServer."""

    def __init__(self, timeout_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.config = type("C", (), {"keep_alive_timeout": timeout_s})()
        self.closes = 0

    async def _initiate_server_close(self) -> None:
        self.closes += 1


class _Group:
    def __init__(self, tg: asyncio.TaskGroup) -> None:
        self.create_task = tg.create_task


@pytest.mark.parametrize(
    ("steps", "closes"),
    [
        (["restart", "sleep_past"], 1),  # idle past keep_alive_timeout: closed once
        (["restart", "stop", "sleep_past"], 0),  # a request began: nothing is closed
        (["restart", "restart", "sleep_past"], 1),  # restarted: one timer, one close
        (["restart", "sleep_half", "restart", "sleep_half", "stop", "sleep_past"], 0),  # restart moves the deadline on
        (["restart", "terminate"], 1),  # the server stops: an idle connection closes at once
        (["terminate", "restart"], 1),  # idle after the server began stopping: at once
        (["restart", "stop", "terminate", "sleep_past"], 0),  # busy when the server stops: not by the timer
    ],
    ids=["fires", "stopped", "restarted", "deadline_moves", "terminated_while_idle", "idle_after_terminated", "busy_at_terminate"],
)
def test_lean_idle_closes_as_hypercorns_idle_task(steps: list[str], closes: int) -> None:
    """hyper.py item 14: the keep-alive timer's rule, without a task per request."""
    from narwhal.http.lean import LeanIdle

    async def main() -> tuple[int, int]:
        srv = _Server(0.1)
        term = LeanEvent()
        async with asyncio.TaskGroup() as tg:
            idle = LeanIdle(srv, term)
            for s in steps:
                if s == "restart":
                    await idle.restart(_Group(tg), None)
                elif s == "stop":
                    await idle.stop()
                elif s == "terminate":
                    await term.set()
                    await asyncio.sleep(0.01)
                elif s == "sleep_past":
                    await asyncio.sleep(0.25)
                elif s == "sleep_half":
                    await asyncio.sleep(0.06)
            hooked = len(term._hooks or {})
        return srv.closes, hooked

    got, hooked = run(main())
    assert got == closes
    assert hooked == 0  # in every case the timer ends stopped or fired: nothing left hooked


def test_lean_idle_makes_no_task_per_request() -> None:
    """A request's stop and the response's restart run without suspending (no loop turn on
    the request's path) and without making a task."""
    from narwhal.http.lean import LeanIdle

    async def main() -> int:
        srv = _Server(5.0)
        term = LeanEvent()
        async with asyncio.TaskGroup() as tg:
            idle = LeanIdle(srv, term)
            before = len(asyncio.all_tasks())
            for _ in range(100):
                await idle.restart(_Group(tg), None)
                c = idle.stop()
                try:
                    c.send(None)
                except StopIteration:
                    pass
                else:
                    raise AssertionError("stop() suspended")
            made = len(asyncio.all_tasks()) - before
        return made

    assert run(main()) == 0
