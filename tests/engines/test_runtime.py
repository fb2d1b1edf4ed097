"""Authority.wait_grant: expiries are decided by the scheduler's clock, never by an event-loop
timer that may fire a little early (R13 must not come out as R12)."""

from __future__ import annotations

import asyncio
import time

from narwhal.authority.authority import Authority
from narwhal.config import parse_config
from narwhal.core.tickets import Enqueued, Work
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E


class LaggingClock:
    """A clock that runs 10 % slower than the event loop's: every loop timer fires
    'early' by its measure (as an asyncio timer within the clock resolution does)."""

    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def now(self) -> float:
        return 1000.0 + (time.monotonic() - self.t0) * 0.9


def test_deadline_expiry_waits_for_the_scheduler_clock() -> None:
    async def main() -> None:
        cfg = parse_config({"admission": {"mode": "open", "phase_concurrency": {"prefill": 1, "decode": 1}, "prediction": {"profile_on_start": False}}})
        r = Authority(cfg, [EngineSpec("u0", "http://127.0.0.1:9", "unified", "vllm", None, None)], clock=LaggingClock())
        now = r.clock.now()
        hold = r.scheduler.admit(Work("chat", 10, 4, 2000.0, now, 10.0, None), now)
        q = r.scheduler.admit(Work("chat", 10, 4, 2000.0, now, 10.0, 0.2), now)
        assert isinstance(q, Enqueued) and not isinstance(hold, Enqueued)
        got = await r.wait_grant(q.ticket)
        assert got is None
        assert r.scheduler.expiry(q.ticket, r.clock.now()) is E.R13
        await r.client.aclose()

    asyncio.run(asyncio.wait_for(main(), 10))
