"""Open streams held from more than one process: the memory bench's load at 20,000 streams.

One process holds at most RLIMIT_NOFILE's hard limit of descriptors (20,000 on this
machine kind), one per client connection, so `hold_spread` runs `holders` child
processes (`python -m narwhal_bench.hold URL SHARE RAMP_S TOKENS`), each opening its
share of the streams over the same ramp. A child prints a JSON line each HOLD_TICK_S:
{"open": n} (streams whose first token came and which have not ended), and once its
stdin closes (or after HOLD_MAX_S) it cancels its streams and prints its last line,
{"open": n, "errors": e, "error_samples": [...], "done": true}.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from typing import Any

__all__ = ["hold_spread", "HOLD_TICK_S", "HOLD_MAX_S", "PER_HOLDER"]

HOLD_TICK_S = 0.5
HOLD_MAX_S = 600.0  # a child left alone ends by itself
PER_HOLDER = 9000  # streams one holder opens (descriptors well under a 20,000 hard limit)


def _open(results: list[Any]) -> int:
    return sum(1 for r in results if r.first_token_at is not None and r.done_at is None)


async def _child(url: str, streams: int, ramp_s: float, tokens: int, headers: dict[str, str]) -> None:
    from .harness.client import make_client
    from .harness.load import Arrival, RequestShape, _one
    from .harness.processes import raise_nofile
    from .harness.stats import Result

    raise_nofile()
    loop = asyncio.get_running_loop()
    c = make_client(url, "1", headers=headers or None)
    shape, a = RequestShape(stream=True), Arrival(0.0, 16, tokens)
    results: list[Result] = []
    tasks: list[asyncio.Task[None]] = []
    stop = asyncio.Event()

    async def stdin_closed() -> None:
        r = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(r), sys.stdin)
        while await r.read(4096):
            pass
        stop.set()

    watcher = asyncio.ensure_future(stdin_closed())

    async def ticker() -> None:
        while not stop.is_set():
            print(json.dumps({"open": _open(results)}), flush=True)
            await asyncio.sleep(HOLD_TICK_S)

    tick = asyncio.ensure_future(ticker())
    t0 = loop.time()
    for k in range(streams):
        if stop.is_set():
            break
        d = t0 + ramp_s * k / max(1, streams) - loop.time()
        if d > 0:
            await asyncio.sleep(d)
        tasks.append(asyncio.ensure_future(_one(c, shape, a, time.perf_counter(), HOLD_MAX_S, results)))
    try:
        await asyncio.wait_for(stop.wait(), HOLD_MAX_S)
    except TimeoutError:
        pass
    stop.set()
    n = _open(results)
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=20)
    tick.cancel()
    watcher.cancel()
    await c.aclose()
    bad = [r.error for r in results if r.error and r.error != "cut at end of run"]
    print(json.dumps({"open": n, "errors": len(bad), "error_samples": bad[:3], "done": True}), flush=True)


async def hold_spread(url: str, streams: int, ramp_s: float, tokens: int, hold_s: float, proc: Any, *, headers: dict[str, str] | None = None,
                      holders: int | None = None, cpus: set[int] | None = None, settle_s: float = 30.0) -> dict[str, Any]:
    """`streams` open streams through `url` from `holders` processes (default: one per
    PER_HOLDER); the router's RSS (proc.rss()) idle, and `hold_s` after all are open (or
    `settle_s` after the ramp, with fewer)."""
    n = holders or max(1, -(-streams // PER_HOLDER))
    shares = [streams // n + (1 if i < streams % n else 0) for i in range(n)]
    rss_idle = proc.rss()
    pre = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    kids = []
    for share in shares:
        argv = [sys.executable, "-m", "narwhal_bench.hold", url, str(share), str(ramp_s), str(tokens), json.dumps(headers or {})]
        kids.append(await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, preexec_fn=pre))
    last: list[dict[str, Any]] = [{"open": 0} for _ in kids]

    async def read(i: int) -> None:
        out = kids[i].stdout
        assert out is not None
        while line := await out.readline():
            try:
                last[i] = json.loads(line)
            except ValueError:
                continue

    readers = [asyncio.ensure_future(read(i)) for i in range(len(kids))]
    try:
        loop = asyncio.get_running_loop()
        end = loop.time() + ramp_s + settle_s
        while loop.time() < end and sum(x["open"] for x in last) < streams and not any(k.returncode is not None for k in kids):
            await asyncio.sleep(HOLD_TICK_S)
        await asyncio.sleep(hold_s)
        open_now = sum(x["open"] for x in last)
        rss_open = proc.rss()
    finally:
        for k in kids:
            if k.stdin is not None:
                k.stdin.close()
        try:
            await asyncio.wait_for(asyncio.gather(*(k.wait() for k in kids)), 60)
        except TimeoutError:
            for k in kids:
                if k.returncode is None:
                    k.kill()
        await asyncio.gather(*readers, return_exceptions=True)
    await asyncio.sleep(2)
    samples = [s for x in last for s in x.get("error_samples", [])]
    return {"rss_idle": rss_idle, "rss_open": rss_open, "open": open_now, "rss_after": proc.rss(), "errors": sum(x.get("errors", 0) for x in last),
            "error_samples": samples[:3], "holders": len(kids), "shares": shares}


if __name__ == "__main__":
    _url, _n, _ramp, _tokens = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
    _headers = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    # uvloop (a dependency of Narwhal's): a holder on asyncio's own loop spent ~1.5 ms of
    # CPU per stream opened, and three of them with the tickers filled the load tool's core
    # (connects timed out at 20,000 streams on a slow day)
    import uvloop

    uvloop.run(_child(_url, _n, _ramp, _tokens, _headers))
