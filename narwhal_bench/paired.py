"""`narwhal bench paired`: two source trees of Narwhal relaying side by side, at once, on
the router's core: the before-and-after of a change to the per-event path.

    narwhal bench paired --trees /tmp/wt_before,/work/main [--windows 4] [--streams 100]

Why: the relay bench's CPU per event moves by up to 1.5x between runs of the same code on
this VM (docs/performance.md), so two arms measured one after the other cannot show a
change of 5 %. Here both routers (trees A and B, e.g. `git worktree add /tmp/wt_before
<commit>`) run at the same time, pinned to the same CPU, behind the same ticker engine,
each with `--streams` streams in a closed loop from the same load process: whatever the
machine does to one it does to the other. Each window reports both routers' CPU per
relayed event and B/A; an A/A run (the same tree twice) shows the method's own bias.
Two processes on one core add context switches: read the ratio, not the absolute
microseconds (which are higher than the relay bench's).

A router's relayed events in a window are counted from its own streams' results after
the run (each stream's tokens spread evenly over its first-to-last token, the part
inside the window); the harness's global token counter over the window is printed
beside as a check. `narwhal_generated` is the installed one for both trees.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from . import harness as H
from .client import SSERecorder, make_client
from .experiments import _cleanup, _run, narwhal_overrides
from .load import RequestShape, run_closed_loop
from .procs import layout, pin_self, run_bench
from .stats import Result

__all__ = ["add_arguments", "run", "in_window"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trees", required=True, help="A,B: two source trees holding a narwhal/ package (git worktrees); the same twice for an A/A run")
    p.add_argument("--streams", type=int, default=100, help="concurrent streams per router (default 100: 200 in all, as the relay bench)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per stream (default 100)")
    p.add_argument("--interval-ms", type=float, default=20.0, help="the ticker's token interval (default 20)")
    p.add_argument("--warm", type=float, default=4.0, help="seconds before the first window (default 4)")
    p.add_argument("--window", type=float, default=15.0, help="seconds per window (default 15)")
    p.add_argument("--windows", type=int, default=4, help="windows (default 4)")


def in_window(results: list[Result], t0: float, t1: float) -> float:
    """Token events of these streams inside [t0, t1): each stream's tokens spread evenly
    over its first-to-last token (the ticker's are evenly spaced)."""
    n = 0.0
    for r in results:
        a, b = r.first_token_at, r.last_token_at
        if a is None or b is None or not r.tokens:
            continue
        if b <= a:
            n += r.tokens if t0 <= a < t1 else 0
            continue
        n += r.tokens * max(0.0, min(b, t1) - max(a, t0)) / (b - a)
    return n


async def _side_by_side(routers: list[H.Started], args: argparse.Namespace) -> list[dict[str, Any]]:
    clients = [make_client(r.url, "1", headers=r.headers) for r in routers]
    total = args.warm + args.windows * args.window + 2.0
    loads = [asyncio.create_task(run_closed_loop(c, RequestShape(stream=True), concurrency=args.streams, duration_s=total, prompt_tokens=32,
                                                 output_tokens=args.tokens, ramp_s=min(2.0, args.warm))) for c in clients]
    await asyncio.sleep(args.warm)
    marks = []
    for _ in range(args.windows):
        t0, k0, c0 = time.perf_counter(), SSERecorder.tokens_seen, [r.proc.cpu() for r in routers]
        await asyncio.sleep(args.window)
        t1, k1, c1 = time.perf_counter(), SSERecorder.tokens_seen, [r.proc.cpu() for r in routers]
        marks.append((t0, t1, k1 - k0, [b - a for a, b in zip(c0, c1, strict=True)]))
    results = [await x for x in loads]
    for c in clients:
        await c.aclose()
    rows = []
    for t0, t1, seen, cpu in marks:
        ev = [in_window(res, t0, t1) for res in results]
        us = [c / e * 1e6 if e else float("inf") for c, e in zip(cpu, ev, strict=True)]
        rows.append({"seconds": t1 - t0, "events_seen": seen, "events": ev, "cpu_s": cpu, "us_per_event": us, "b_over_a": us[1] / us[0]})
    return rows


def paired(args: argparse.Namespace) -> dict[str, Any]:
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    if len(trees) != 2:
        raise SystemExit("--trees takes two source trees, A,B")
    rcpu, lcpu = layout()
    pin_self(lcpu)
    with _cleanup() as things:
        tk = H.ticker_engine("t-paired", interval_ms=args.interval_ms, cpus=lcpu)
        things.append(tk)
        routers = []
        for name, tree in zip(("narwhal-a", "narwhal-b"), trees, strict=True):
            cfg = H.narwhal_config([tk], **narwhal_overrides("open", 1))
            r = H.start_narwhal(cfg, cpus=rcpu, name=name, tree=tree)
            things.append(r)
            routers.append(r)
        rows = _run(_side_by_side(routers, args))
    return {"trees": [str(t) for t in trees], "streams_per_router": args.streams, "windows": rows}


def run(args: argparse.Namespace) -> int:
    rc, data = run_bench("paired", lambda: paired(args))
    if rc:
        return rc
    print(f"A = {data['trees'][0]}\nB = {data['trees'][1]}\n")
    print("| window | events A / B (global counter) | A µs per event | B µs per event | B / A |")
    print("|---|---|---|---|---|")
    for i, w in enumerate(data["windows"]):
        print(f"| {i + 1} | {w['events'][0]:,.0f} / {w['events'][1]:,.0f} ({w['events_seen']:,}) | {w['us_per_event'][0]:.2f} | {w['us_per_event'][1]:.2f} | "
              f"**{w['b_over_a']:.3f}** |")
    ratios = sorted(w["b_over_a"] for w in data["windows"])
    print(f"\nB / A, median of {len(ratios)} windows: **{ratios[len(ratios) // 2]:.3f}**")
    return 0
