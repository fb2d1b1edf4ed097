"""Many clients at once, some going away mid-stream, some engines failing: every offered
request ends in exactly one terminal class, the books balance at rest, no slot is left
held, and the engines see every abandoned request cancelled."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import httpx

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router, wait_until

MODEL = "narwhal-demo"


def body(i: int, rnd: random.Random) -> tuple[str, dict[str, Any], str]:
    """(kind, body, expectation) for client i."""
    kind = rnd.choice(["ok", "ok", "ok", "stream", "stream", "disconnect", "fault", "invalid", "nonstream_fault"])
    b: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": f"client {i} " * rnd.randint(1, 60)}], "max_tokens": rnd.randint(2, 12)}
    if kind in ("stream", "disconnect"):
        b["stream"] = True
    if kind == "disconnect":
        # long enough (~2.4 s at the fleet's time scale) that the client's going away after
        # 6 lines is always mid-stream, even when this process (client and router share
        # it) stalls: 40 tokens once finished inside one stall and nothing was cancelled
        b["max_tokens"] = 400
        b["mock"] = {"tpot_ms": 20}
    if kind == "fault":
        b["stream"] = True
        b["mock"] = {"fault": rnd.choice(["drop", "error_event", "bool_token_ids", "stall", "malformed_json"]), "fault_after": rnd.randint(0, 3)}
    if kind == "nonstream_fault":
        b["mock"] = {"fault": rnd.choice(["error_before", "reject", "audio", "drop", "missing_token_ids"]), "fault_after": rnd.randint(0, 2)}
    if kind == "invalid":
        b = rnd.choice([{"model": MODEL}, {**b, "n": 3}, {**b, "model": "other"}, {**b, "stream": "maybe"}])
    return kind, b, ""


async def client(url: str, i: int, rnd: random.Random, results: dict[str, int], http2: bool) -> None:
    kind, b, _ = body(i, rnd)
    async with httpx.AsyncClient(http1=not http2, http2=http2, timeout=30) as c:
        try:
            if b.get("stream"):
                async with c.stream("POST", url + "/v1/chat/completions", json=b) as r:
                    n = 0
                    async for _line in r.aiter_lines():
                        n += 1
                        if kind == "disconnect" and n >= 6:
                            break  # the client goes away mid-stream
            else:
                await c.post(url + "/v1/chat/completions", json=b)
        except httpx.HTTPError:
            pass
    results[kind] = results.get(kind, 0) + 1


def test_books_balance_under_load_disconnects_and_faults(relay_path: str) -> None:
    t = Timing(time_scale=0.3)
    cfgs = [MockConfig(dialect="vllm", role="prefill", name="p0", timing=t), MockConfig(dialect="vllm", role="decode", name="d0", timing=t), MockConfig(dialect="vllm", role="decode", name="d1", timing=t)]
    with running_fleet(cfgs) as mocks:
        specs = [EngineSpec(m.name, m.url, m.config.role, "vllm", None, None) for m in mocks]
        # and one decode engine that is not there at all
        specs.append(EngineSpec("d-dead", f"http://127.0.0.1:{free_port()}", "decode", "vllm", None, None))
        config = {
            "serving": {"relay_path": relay_path},
            "admission": {"mode": "open", "queue_limit": 64, "max_wait_ms": 5000, "phase_concurrency": {"prefill": 4, "decode": 16}, "prediction": {"profile_on_start": False}},
            "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
            "upstream": {"idle_timeout_ms": 700},
        }
        with running_router(config, specs) as rr:
            rnd = random.Random(42)
            results: dict[str, int] = {}

            async def main() -> None:
                await asyncio.gather(*(client(rr.url, i, random.Random(rnd.random()), results, http2=i % 3 == 0) for i in range(150)))

            asyncio.run(main())
            b = rr.balanced(timeout=20)
            assert b["offered"] == 150 == sum(b["terminal"].values())
            assert b["double_ends"] == 0
            assert b["terminal"]["completed"] > 0 and b["terminal"]["failed"] > 0 and b["terminal"]["invalid_requests"] > 0
            assert results.get("disconnect", 0) > 0 and b["terminal"]["cancelled"] > 0

            def slots() -> list[tuple[str, int, int, int]]:
                return [(e.name, e.prefill_in_use, e.decode_in_use, len(e.queue)) for e in rr.router.engines.values()]

            assert all(x[1:] == (0, 0, 0) for x in rr.call(slots)), rr.call(slots)
            assert rr.call(lambda: (rr.router.scheduler.queued, len(rr.router.scheduler.decode_queue), rr.router.held, len(rr.router.waiters))) == (0, 0, 0, 0)
            # every abandoned request was cancelled at the engines too
            wait_until(lambda: all(m.stats()["in_flight"] == 0 for m in mocks), timeout=10, what="engines to drain")
