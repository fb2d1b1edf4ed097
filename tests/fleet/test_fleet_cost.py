"""What a fleet change and a scrape cost at 1,000 engines (issue 40 item 4), counted
rather than timed (a loaded machine makes times noisy; the counts are what made them):

  * a PUT or a removal re-derives nothing per engine of the fleet: the engine URLs parsed
    by one change do not grow with the fleet (before: every engine's, at every change);
  * a /metrics scrape lets the event loop run between batches of engines, and renders
    the text in a thread (before: 7,000 engines held the loop 2.7 s in one piece).

scripts/fleet_cost.py measures the times over HTTP (docs/operations.md)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from narwhal.compose import Router
from narwhal.config import parse_config
from narwhal.upstream.engines import EngineSpec

N = 1000


def _router(n: int) -> Router:
    cfg = parse_config({"admission": {"mode": "open", "prediction": {"profile_on_start": False}},
                        "monitoring": {"poll_interval_ms": 60000}, "discovery": {"drain_timeout_ms": 0}})
    return Router(cfg, [EngineSpec(f"e{i}", f"http://127.0.0.{1 + i // 250}:{20000 + i}", "unified", "vllm", None, None) for i in range(n)])


def test_a_change_parses_the_urls_it_changes_not_the_fleets(monkeypatch: pytest.MonkeyPatch) -> None:
    import narwhal.worker.plane as plane

    calls: list[str] = []
    real = plane.urlsplit

    def counted(url: str, *a: Any, **kw: Any) -> Any:
        calls.append(url)
        return real(url, *a, **kw)

    monkeypatch.setattr(plane, "urlsplit", counted)

    async def go() -> None:
        r = _router(N)
        m = r.control.membership
        calls.clear()
        for i in range(5):
            m.put(EngineSpec(f"x{i}", f"http://127.0.0.9:{30000 + i}", "unified", "vllm", None, None))
        for i in range(5):
            m.remove(f"x{i}")
        assert len(calls) <= 10, len(calls)  # the five new URLs (once each), not 1,000 per change

    asyncio.run(go())


def test_a_scrape_lets_the_event_loop_run_while_it_reads_the_fleet() -> None:
    async def go() -> tuple[int, int]:
        r = _router(N)
        ticks = 0
        stop = False

        async def ticker() -> None:
            nonlocal ticks
            while not stop:
                ticks += 1
                await asyncio.sleep(0)

        t = asyncio.ensure_future(ticker())
        await asyncio.sleep(0)
        before = ticks
        body = await r.controls.metrics()
        stop = True
        await t
        assert body.count(b"narwhal_engine_healthy{") == N
        return before, ticks

    before, after = asyncio.run(go())
    assert after - before >= N // 64 - 2, (before, after)  # the loop ran between every batch
