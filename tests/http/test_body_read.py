"""The request body's read (completions._read_body): a whole body hypercorn has queued is
taken without a timer; anything else is read within serving.read_timeout_ms (H07), under
max_request_bytes (R03), with a client's disconnect noticed -- the same outcome either way."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from narwhal.http import completions as C
from narwhal.http.lean import LeanQueue

_WHOLE = {"type": "http.request", "body": b'{"a": 1}', "more_body": False}
_PART = {"type": "http.request", "body": b'{"a":', "more_body": True}
_REST = {"type": "http.request", "body": b" 1}", "more_body": False}
_GONE = {"type": "http.disconnect"}


async def _read(queued: list[dict[str, Any]], later: list[dict[str, Any]], *, lean: bool, limit: int = 1 << 20, deadline_s: float = 0.2) -> tuple[str, Any, int]:
    """Read with `queued` in the queue at the start and `later` put 10 ms after; returns
    (outcome, value, timers made)."""
    made = 0
    real = asyncio.timeout

    def counting(delay: float | None) -> Any:
        nonlocal made
        made += 1
        return real(delay)

    q = LeanQueue(10)
    for m in queued:
        q.put_nowait(m)

    async def feed() -> None:
        await asyncio.sleep(0.01)
        for m in later:
            await q.put(m)

    async def plain() -> Any:  # another server's receive(): not hypercorn's queue
        return await q.get()

    f = asyncio.ensure_future(feed())
    C.asyncio.timeout = counting  # type: ignore[attr-defined]
    try:
        body = await C._read_body({"headers": []}, q.get if lean else plain, limit, deadline_s)
        return "body", body, made
    except (C._TooLarge, C._TooSlow, C._Gone) as e:
        return type(e).__name__, getattr(e, "ended", None), made
    finally:
        C.asyncio.timeout = real  # type: ignore[attr-defined]
        f.cancel()


@pytest.mark.parametrize(
    ("queued", "later", "limit", "want", "lean_timers"),
    [
        ([_WHOLE], [], 1 << 20, ("body", b'{"a": 1}'), 0),  # the common case: no timer
        ([_WHOLE], [], 4, ("_TooLarge", True), 0),  # R03: over the limit, the whole body sent
        ([], [_WHOLE], 1 << 20, ("body", b'{"a": 1}'), 1),  # not there yet: a wait, bounded
        ([_PART], [_REST], 1 << 20, ("body", b'{"a": 1}'), 1),  # in two pieces
        ([_PART], [], 1 << 20, ("_TooSlow", None), 1),  # H07: the rest never comes
        ([_GONE], [], 1 << 20, ("_Gone", None), 1),
        ([_PART, _GONE], [], 1 << 20, ("_Gone", None), 1),
    ],
    ids=["whole", "too_large", "later", "two_pieces", "too_slow", "gone", "gone_midway"],
)
def test_the_body_read_is_the_same_with_or_without_the_queue_shortcut(queued: list[dict[str, Any]], later: list[dict[str, Any]], limit: int, want: tuple[str, Any],
                                                                       lean_timers: int) -> None:
    lean = asyncio.run(_read(list(queued), list(later), lean=True, limit=limit))
    other = asyncio.run(_read(list(queued), list(later), lean=False, limit=limit))
    assert lean[:2] == want and other[:2] == want
    assert lean[2] == lean_timers  # a timer only where a wait may come
    assert other[2] == 1  # another server's receive: always within one timer
