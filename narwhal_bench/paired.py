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

`--part ttft` compares the two trees' router-added first-token time the same way: both
routers behind one mock engine at once, each an open loop of `--rate` req/s Poisson, and
the engine's direct arm (`--direct-rate`) interleaved with them, in `--windows` rounds of
`--window` seconds (the TTFT part of `narwhal bench versus`: prompt 64 tokens, 16 tokens
10 ms apart); per round each tree's added p50 and p99 (routed minus direct), its router
CPU per request, and B - A.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from statistics import median
from typing import Any

from . import harness as H
from .experiments import narwhal_overrides
from .harness import options as O
from .harness.client import SSERecorder, make_client
from .harness.load import RequestShape, fixed_rate, phase, phases_at_once, run_closed_loop, run_loop
from .harness.options import opt
from .harness.processes import layout, pin_self, run_bench
from .harness.stats import Result, summarize

__all__ = ["add_arguments", "run", "in_window", "ttft_round", "ttft_report"]


OPTIONS = (
    opt("--trees", required=True, help="A,B: two source trees holding a narwhal/ package (git worktrees); the same twice for an A/A run"),
    opt("--streams", type=int, default=100, help="concurrent streams per router (default 100: 200 in all, as the relay bench)"),
    opt("--tokens", type=int, default=100, help="tokens per stream (default 100)"),
    opt("--interval-ms", type=float, default=20.0, help="the ticker's token interval (default 20)"),
    opt("--warm", type=float, default=4.0, help="seconds before the first window (default 4)"),
    opt("--window", type=float, default=15.0, help="seconds per window (default 15)"),
    opt("--windows", type=int, default=4, help="windows (default 4); with --part ttft, rounds"),
    opt("--part", choices=("relay", "ttft"), default="relay", help="relay: CPU per relayed event (default); ttft: the added first-token time, rounds of --window s"),
    opt("--rate", type=float, default=150.0, help="ttft: req/s per router, Poisson (default 150: 300 on the router's core)"),
    opt("--direct-rate", type=float, default=50.0, help="ttft: req/s of the engine's direct arm, interleaved (default 50)"),
)


add_arguments = O.adder(OPTIONS)


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


_TTFT_SHAPE = {"prompt_tokens": 64, "output_tokens": 16}  # the TTFT part of `narwhal bench versus`


def ttft_round(direct: list[Result], routed: list[list[Result]], cpu_s: list[float]) -> dict[str, Any]:
    """One round of --part ttft: each router's added p50 and p99 (ms, routed minus the
    direct arm's), its CPU per completed request (µs) and B - A of the added p50 (µs)."""
    d = summarize(direct)["ttft"]
    row: dict[str, Any] = {"added_p50_ms": [], "added_p99_ms": [], "cpu_us_per_request": [], "ok": [], "offered": []}
    for res, cpu in zip(routed, cpu_s, strict=True):
        s = summarize(res)
        row["added_p50_ms"].append((s["ttft"]["p50"] - d["p50"]) * 1e3)
        row["added_p99_ms"].append((s["ttft"]["p99"] - d["p99"]) * 1e3)
        row["cpu_us_per_request"].append(cpu / max(1, s["ok"]) * 1e6)
        row["ok"].append(s["ok"])
        row["offered"].append(s["offered"])
    row["b_minus_a_us"] = (row["added_p50_ms"][1] - row["added_p50_ms"][0]) * 1e3
    return row


def ttft_report(rounds: list[dict[str, Any]]) -> list[str]:
    """The rounds of --part ttft as a table, then the medians."""
    lines = ["| round | A ok | A added p50 / p99 ms | A CPU µs per request | B ok | B added p50 / p99 ms | B CPU µs per request | B − A p50 µs |", "|---|---|---|---|---|---|---|---|"]
    for i, r in enumerate(rounds):
        cells = [f"{r['ok'][k]}/{r['offered'][k]} | {r['added_p50_ms'][k]:.3f} / {r['added_p99_ms'][k]:.3f} | {r['cpu_us_per_request'][k]:.0f}" for k in (0, 1)]
        lines.append(f"| {i + 1} | {cells[0]} | {cells[1]} | **{r['b_minus_a_us']:+.0f}** |")
    diffs = [r["b_minus_a_us"] for r in rounds]
    lines += ["", f"added p50, median of {len(rounds)} rounds: A {median([r['added_p50_ms'][0] for r in rounds]):.3f} ms, B {median([r['added_p50_ms'][1] for r in rounds]):.3f} ms; "
              f"CPU per request A {median([r['cpu_us_per_request'][0] for r in rounds]):.0f} µs, B {median([r['cpu_us_per_request'][1] for r in rounds]):.0f} µs",
              f"B − A added p50 per round: median **{median(diffs):+.0f} µs** (rounds {', '.join(f'{x:+.0f}' for x in diffs)})"]
    return lines


def _ttft(routers: list[H.Started], eng: H.Engine, args: argparse.Namespace) -> list[dict[str, Any]]:
    shape = RequestShape(stream=True, mock={"prefill_ms": 0, "tpot_ms": 10})
    for r in routers:  # warm: connections to the engine, the first requests' imports
        phase(r.url, r.headers, "1", fixed_rate(50, 2.0, seed=99, **_TTFT_SHAPE), shape)
    rows = []
    for j in range(args.windows):
        arms = [(eng.url, {}, fixed_rate(args.direct_rate, args.window, seed=j + 7919, **_TTFT_SHAPE))]
        arms += [(r.url, r.headers, fixed_rate(args.rate, args.window, seed=j * 2 + i + 1, **_TTFT_SHAPE)) for i, r in enumerate(routers)]
        c0 = [r.proc.cpu() for r in routers]
        res = phases_at_once(arms, "1", shape, drain_s=20.0)
        rows.append(ttft_round(res[0], res[1:], [r.proc.cpu() - c for r, c in zip(routers, c0, strict=True)]))
    return rows


def paired(args: argparse.Namespace) -> dict[str, Any]:
    trees = [Path(t).resolve() for t in args.trees.split(",")]
    if len(trees) != 2:
        raise SystemExit("--trees takes two source trees, A,B")
    rcpu, lcpu = layout()
    pin_self(lcpu)
    if getattr(args, "part", "relay") == "ttft":
        with H.stopping() as things:
            eng = H.mock_engine("u0", cpus=lcpu, timing={"time_scale": 0.1})
            things.append(eng)
            routers = []
            for name, tree in zip(("narwhal-a", "narwhal-b"), trees, strict=True):
                r = H.start_narwhal(H.narwhal_config([eng], **narwhal_overrides("open", 1)), cpus=rcpu, name=name, tree=tree)
                things.append(r)
                routers.append(r)
            return {"trees": [str(t) for t in trees], "part": "ttft", "rate": args.rate, "direct_rate": args.direct_rate, "rounds": _ttft(routers, eng, args)}
    with H.stopping() as things:
        tk = H.ticker_engine("t-paired", interval_ms=args.interval_ms, cpus=lcpu)
        things.append(tk)
        routers = []
        for name, tree in zip(("narwhal-a", "narwhal-b"), trees, strict=True):
            cfg = H.narwhal_config([tk], **narwhal_overrides("open", 1))
            r = H.start_narwhal(cfg, cpus=rcpu, name=name, tree=tree)
            things.append(r)
            routers.append(r)
        rows = run_loop(_side_by_side(routers, args))
    return {"trees": [str(t) for t in trees], "streams_per_router": args.streams, "windows": rows}


def run(args: argparse.Namespace) -> int:
    rc, data = run_bench("paired", lambda: paired(args))
    if rc:
        return rc
    print(f"A = {data['trees'][0]}\nB = {data['trees'][1]}\n")
    if data.get("part") == "ttft":
        print(f"{data['rate']:g} req/s per router, the direct arm {data['direct_rate']:g} req/s, interleaved\n")
        print("\n".join(ttft_report(data["rounds"])))
        return 0
    print("| window | events A / B (global counter) | A µs per event | B µs per event | B / A |")
    print("|---|---|---|---|---|")
    for i, w in enumerate(data["windows"]):
        print(f"| {i + 1} | {w['events'][0]:,.0f} / {w['events'][1]:,.0f} ({w['events_seen']:,}) | {w['us_per_event'][0]:.2f} | {w['us_per_event'][1]:.2f} | "
              f"**{w['b_over_a']:.3f}** |")
    ratios = sorted(w["b_over_a"] for w in data["windows"])
    print(f"\nB / A, median of {len(ratios)} windows: **{ratios[len(ratios) // 2]:.3f}**")
    return 0
