"""Fair retention on the issue's load (issue 40 item 6): tenants configured with weights
only, the global HTTP retention (admission.http_retention_limit, R02) the binding limit,
one engine, a quiet tenant at 4 req/s and a noisy one at 40 req/s. Prints, per arm, the
quiet tenant's answered share and TTFT p50/p99 against the quiet tenant alone, and the
noisy tenant's answers and refusals by code.

    python scripts/tenants_retention.py [--duration 30] [--retention 24]

Bounded: a mock engine and `narwhal serve` in subprocesses stopped by PID at the end,
every request with a timeout. Run it against another tree with PYTHONPATH=that-tree
(docs/tenants-bench.md: before and after).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

KEYS = {"quiet": "sk-bench-quiet-000000", "noisy": "sk-bench-noisy-000000"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


from fleet_cost import process  # noqa: E402 - the scripts run as files: scripts/ is on sys.path


async def one(c: httpx.AsyncClient, url: str, tenant: str, out: list[dict[str, Any]]) -> None:
    body = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 8, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    rec: dict[str, Any] = {"tenant": tenant, "status": None, "ttft": None, "code": None}
    try:
        async with c.stream("POST", url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEYS[tenant]}"}) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                with contextlib.suppress(Exception):
                    rec["code"] = json.loads(await r.aread())["error"]["code"]
            else:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and rec["ttft"] is None:
                        rec["ttft"] = time.perf_counter() - t0
    except httpx.HTTPError as e:
        rec["code"] = type(e).__name__
    out.append(rec)


async def drive(url: str, rates: dict[str, float], duration: float, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    out: list[dict[str, Any]] = []
    tasks = []
    arrivals = sorted((t, tenant) for tenant, rate in rates.items() if rate > 0 for t in _poisson(rng, rate, duration))
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=60, limits=limits) as c:
        start = time.perf_counter()
        for at, tenant in arrivals:
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(c, url, tenant, out)))
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    return out


def _poisson(rng: random.Random, rate: float, duration: float) -> list[float]:
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= duration:
            return out
        out.append(t)


def summary(recs: list[dict[str, Any]], tenant: str) -> dict[str, Any]:
    mine = [r for r in recs if r["tenant"] == tenant]
    ok = [r for r in mine if r["status"] == 200 and r["ttft"] is not None]
    ttfts = sorted(r["ttft"] * 1000 for r in ok)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else None
    return {"sent": len(mine), "answered": len(ok), "answered_pct": round(100 * len(ok) / max(1, len(mine)), 1),
            "ttft_p50_ms": round(statistics.median(ttfts), 1) if ttfts else None, "ttft_p99_ms": round(p99, 1) if p99 else None,
            "refused": dict(Counter(r["code"] for r in mine if r["status"] != 200))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--retention", type=int, default=24, help="admission.http_retention_limit (the binding limit)")
    ap.add_argument("--quiet", type=float, default=4.0)
    ap.add_argument("--noisy", type=float, default=40.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--max-concurrency", type=int, default=2, help="engines[].max_concurrency of the one engine (0: unset)")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-retention-"))
    keys = tmp / "keys.yaml"
    keys.write_text(json.dumps([{"id": f"k-{t}", "tenant": t, "sha256": hashlib.sha256(k.encode()).hexdigest()} for t, k in KEYS.items()]))
    mport, rport = free_port(), free_port()
    cfg = {"serving": {"listen": f"127.0.0.1:{rport}", "shutdown_delay_ms": 0, "shutdown_grace_ms": 1000},
           "admission": {"mode": "open", "prediction": {"profile_on_start": False}, "http_retention_limit": args.retention, "queue_limit": 1024},
           "monitoring": {"poll_interval_ms": 500},
           "tenants": {"quiet": {"weight": 1}, "noisy": {"weight": 1}},
           "auth": {"keys_file": str(keys)},
           "engines": [{"name": "e0", "url": f"http://127.0.0.1:{mport}", "role": "unified", "dialect": "vllm", "max_concurrency": args.max_concurrency or None}]}
    (tmp / "narwhal.json").write_text(json.dumps(cfg))
    py = sys.executable
    mock = [py, "-m", "narwhal.cli", "mock-engine", "--dialect", "vllm", "--role", "unified", "--port", str(mport), "--model", "narwhal-demo",
            "--prefill-base-ms", "40", "--tpot-base-ms", "5"]
    results: dict[str, Any] = {"config": {k: v for k, v in vars(args).items()}, "tree": os.environ.get("PYTHONPATH") or "this tree"}
    with process(mock, tmp / "mock.log"), process([py, "-m", "narwhal.cli", "serve", "--config", str(tmp / "narwhal.json")], tmp / "router.log"):
        url = f"http://127.0.0.1:{rport}"
        end = time.monotonic() + 60
        while time.monotonic() < end:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            time.sleep(0.1)
        alone = asyncio.run(drive(url, {"quiet": args.quiet}, args.duration, args.seed))
        time.sleep(2)
        shared = asyncio.run(drive(url, {"quiet": args.quiet, "noisy": args.noisy}, args.duration, args.seed + 1))
    results["alone"] = {"quiet": summary(alone, "quiet")}
    results["shared"] = {"quiet": summary(shared, "quiet"), "noisy": summary(shared, "noisy")}
    a, s = results["alone"]["quiet"], results["shared"]["quiet"]
    results["quiet_ttft_p99_vs_alone"] = round(s["ttft_p99_ms"] / a["ttft_p99_ms"], 2) if s["ttft_p99_ms"] and a["ttft_p99_ms"] else None
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
