"""narwhal/http/sink.py `until_disconnect` under hypercorn (a CloseHook): the request
runs in the app's own task; the client's cut (its stream closed, or send_stall_ms) ends it
as `cancelled`, and any other cancellation goes on up. Table-driven, without sockets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from narwhal.http import hyper
from narwhal.http import sink as C


class _Sink:
    def __init__(self, stall_s: float = 60.0) -> None:
        self.ending = False
        self.stall_s = stall_s
        self.sending_since = 0.0
        self.rid = "r"


async def _scenario(what: str) -> tuple[str, int, bool]:
    """(how it ended, the app task's pending cancellations after, the work saw CancelledError)"""
    hook = hyper.CloseHook()
    sink = _Sink(stall_s=0.05 if what == "stall" else 60.0)
    stalls = C.Stalls()
    saw: list[bool] = [False]

    async def work() -> str:
        try:
            if what == "finishes":
                await asyncio.sleep(0)
                return "ok"
            if what == "ends_then_closes":  # the answer's end closes the stream: not a cut
                sink.ending = True
                hook.fire()
                await asyncio.sleep(0)
                return "ok"
            if what == "stall":
                sink.sending_since = C._monotonic()
            await asyncio.sleep(30)
            return "ok"
        except asyncio.CancelledError:
            saw[0] = True
            if what == "client_gone_then_work_fails":
                raise RuntimeError("a bug in the request's own clean-up") from None
            raise

    async def app() -> tuple[str, int]:
        try:
            got = await C.until_disconnect(work(), None, sink, hook, stalls)  # type: ignore[arg-type]
        except asyncio.CancelledError:
            return "raised", asyncio.current_task().cancelling()  # type: ignore[union-attr]
        except RuntimeError:
            await asyncio.sleep(0)  # the endpoint answers H06 and goes on: nothing is pending
            return "error", asyncio.current_task().cancelling()  # type: ignore[union-attr]
        await asyncio.sleep(0)  # nothing pending: the app's task goes on (its own sends, the books)
        return got, asyncio.current_task().cancelling()  # type: ignore[union-attr]

    t = asyncio.ensure_future(app())
    await asyncio.sleep(0.01)
    if what in ("client_gone", "client_gone_and_shutdown", "client_gone_then_work_fails"):
        hook.fire()
    if what in ("shutdown", "client_gone_and_shutdown"):
        t.cancel()
    got, pending = await asyncio.wait_for(t, 5)
    assert not stalls.watched and (stalls._task is None)
    return got, pending, saw[0]


@pytest.mark.parametrize(
    ("what", "ends", "work_cancelled"),
    [
        ("finishes", "ok", False),
        ("ends_then_closes", "ok", False),
        ("client_gone", "cancelled", True),  # its engine request is cancelled with it
        ("stall", "cancelled", True),
        ("shutdown", "raised", True),  # not the client's: goes on up
        ("client_gone_and_shutdown", "raised", True),
        ("client_gone_then_work_fails", "error", True),  # the work's own error goes on up, the cut taken back
    ],
)
def test_the_clients_cut_is_the_class_cancelled_and_nothing_else_is(what: str, ends: str, work_cancelled: bool) -> None:
    got, pending, saw = asyncio.run(_scenario(what))
    assert (got, saw) == (ends, work_cancelled)
    if got != "raised":
        assert pending == 0  # the cut was taken back: later awaits of the app's task are not cancelled


def test_a_stream_closed_before_the_request_ran_reaches_no_engine() -> None:
    async def main() -> tuple[str, bool]:
        hook = hyper.CloseHook()
        hook.fire()
        started = [False]

        async def work() -> str:
            started[0] = True
            return "ok"

        return await C.until_disconnect(work(), None, _Sink(), hook, C.Stalls()), started[0]  # type: ignore[arg-type]

    assert asyncio.run(main()) == ("cancelled", False)


def test_the_request_makes_no_task_of_its_own() -> None:
    """The work runs in the caller's task (the endpoint's Stalls sweeper aside)."""
    async def main() -> tuple[set[Any], set[Any]]:
        stalls = C.Stalls()
        during: list[set[Any]] = []

        async def work() -> str:
            during.append({t for t in asyncio.all_tasks() if t is not stalls._task})
            return "ok"

        before = set(asyncio.all_tasks())
        await C.until_disconnect(work(), None, _Sink(), hyper.CloseHook(), stalls)  # type: ignore[arg-type]
        return before, during[0]

    before, during = asyncio.run(main())
    assert during == before
