"""`narwhal bench versus`: Narwhal side by side with SMG 1.13, vLLM's router and Envoy 1.40
in one run (issue 25 items 1 and 3).

    narwhal bench versus [--routers narwhal,smg,vllm-router,envoy] [--runs 3] [--parts relay,ttft,memory]
                         [--mode open|predictive] [--servers hypercorn] [--mem-streams 20000] [--quiet-wait 30] [--out out/bench]
    narwhal bench versus --from-json out/bench/versus.json      (the tables of a saved run again, no processes)
    python -m narwhal_bench.versus ...                           (the same, without the `narwhal bench` entry)

The run
  * Every router runs through the very harness of `narwhal bench relay`, `overhead` and
    `memory` (experiments.relay_one, phase, memory_one): the same engines, the same load
    client (the raw HTTP/1.1 client), the router's CPU and RSS read from /proc over its
    whole process tree, the router pinned alone to one CPU and the engines and the load
    tool to the other (harness.processes.layout()). Peers are started by harness.start_peer as plain
    relays (no retries, circuit breaker or health polling where they have a flag; Envoy
    with one worker thread per router CPU). Narwhal: `narwhal serve` (hypercorn; granian
    with --servers granian when installed), admission `--mode` (default open, as the
    relay bench) in the relay and TTFT parts; the memory part as the memory bench (open,
    no profiling, every limit above the streams held).
  * `--runs` runs (default 3); in each, the parts in turn and in each part the routers
    one after another, in the order of --routers in odd runs and reversed in even ones.
    Every router is started fresh for every part of every run and stopped by its PID.
  * relay: one ticker engine (narwhal_bench.ticker) streaming `--tokens` tokens (100)
    `--interval-ms` apart (20), `--streams` (200) concurrent HTTP/1.1 streams in a closed
    loop; relayed token events counted at the client over `--window` s (15) after
    `--warm` s (4), divided by the router's CPU seconds over the same window.
  * ttft: one mock vLLM engine (`narwhal mock-engine`, time scale 0.1, prefill 0 ms,
    `--output-tokens` 16 tokens `--tpot-ms` 10 ms apart); per router the routed arm
    (Poisson at `--rate` 200 req/s for `--ttft-duration` s, 10, seeded by the run) and,
    at the same time and interleaved with it, the direct arm against the engine (Poisson
    at `--direct-rate` 50 req/s, its own seed), open loop, streaming, HTTP/1.1. Added
    TTFT = routed minus direct percentile (p50, p99): the two arms share the run's engine
    load and the VM's speed of the moment, which drift from phase to phase by more than
    the target's margin (the direct p50 of back-to-back phases went from 0.9 to 1.8 ms).
    `--direct-rate 0` measures as before: a direct phase at --rate, then the routed
    phase on the same arrivals.
  * memory: `--mem-streams` (20,000) streams opened over `--mem-ramp` s (60) through the
    router to tickers sending one token every `--mem-interval-ms` (10 s), held `--mem-hold` s (5); KiB per open
    stream = (RSS with them open - RSS idle after a warm-up) / streams open. The streams
    come from holder processes (narwhal_bench.hold, 9,000 each at most) to as many
    ticker engines: one process holds at most RLIMIT_NOFILE's hard limit of descriptors.
    A router process holds two per stream: past what one holds (9,872 with a hard limit
    of 20,000), Narwhal runs with the data-plane workers it needs (5 for 20,000) and a
    peer, one process, is measured at the most it holds (experiments.memory_preflight;
    the table shows each router's count). Ephemeral ports are checked before anything
    runs; a count that does not fit stops the run at once, naming the most that would.
  * Before each measurement the run waits at most `--quiet-wait` s for the rest of the
    machine to go quiet (< 0.15 core busy, harness.quiet.await_quiet), and records how busy the
    rest of the machine kept the CPUs meanwhile (`others' cores`).

Results: per router and run, then per router the median over runs: events per router
CPU-s, µs per event, Narwhal's CPU per event over each peer's and over the best Rust peer's
(SMG, vllm-router; Envoy is the baseline row, its ratio shown, never a target's peer),
added TTFT p50/p99 and Narwhal's p50 minus the best Rust peer's, KiB per open stream.
Targets (issue 25), PASS/MISS on the medians: Narwhal CPU per relayed event <= 1.5x the
best Rust peer's (stretch <= 1.0x); added TTFT p50 <= the best Rust peer's + 0.2 ms and
p99 <= 2 ms at 200 req/s; memory per open stream <= 16 KiB at 20,000 streams (measured at
fewer streams, the line says so). Output: Markdown on stdout and, with --out (default
out/bench), versus.md and versus.json (harness.report.Report), the command line included.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from . import harness as H
from .experiments import memory_one, memory_preflight, narwhal_overrides, relay_one
from .harness import options as O
from .harness.load import RequestShape, fixed_rate, phase, phases_at_once
from .harness.options import opt
from .harness.processes import command_line, layout, pin_self, run_bench
from .harness.report import Report, pinning_note
from .harness.stats import fmt_ms, markdown_table, summarize

__all__ = ["add_arguments", "run", "main", "versus", "command", "runs_order", "median", "summary", "verdict", "tables", "estimate_s", "PARTS", "ROUTERS", "TARGETS"]

PARTS = ("relay", "ttft", "memory")
ROUTERS = ("narwhal", "smg", "vllm-router", "envoy")
TARGETS = {"cpu_ratio": 1.5, "cpu_ratio_stretch": 1.0, "ttft_p50_margin_ms": 0.2, "ttft_p99_ms": 2.0, "kib_per_stream": 16.0, "mem_streams": 20_000}


# -- arguments ---------------------------------------------------------------------------------


OPTIONS = (
    opt("--routers", default=",".join(ROUTERS), help=f"comma-separated, in the order of odd runs (default {','.join(ROUTERS)}); known: {', '.join(H.PEERS)}"),
    opt("--runs", type=int, default=3, help="runs, the routers' order reversed every other run (default 3)"),
    opt("--parts", default=",".join(PARTS), help="comma-separated: relay, ttft, memory (default all)"),
    opt("--mode", default="open", choices=["open", "predictive"], help="Narwhal's admission mode in the relay and TTFT parts (default open, as the relay bench)"),
    opt("--servers", default="hypercorn", help="Narwhal's ASGI servers: hypercorn, granian (comma-separated; each a row)"),
    opt("--workers", type=int, default=1, help="Narwhal's serving.workers (default 1)"),
    opt("--streams", type=int, default=200, help="relay: concurrent streams (default 200)"),
    opt("--tokens", type=int, default=100, help="relay: tokens per stream (default 100)"),
    opt("--interval-ms", type=float, default=20.0, help="relay: ms between a stream's tokens (default 20)"),
    opt("--warm", type=float, default=4.0, help="relay: seconds of ramp before the window (default 4)"),
    opt("--window", type=float, default=15.0, help="relay: measured seconds (default 15)"),
    opt("--rate", type=float, default=200.0, help="ttft: req/s, Poisson (default 200)"),
    opt("--ttft-duration", type=float, default=10.0, help="ttft: seconds of arrivals per phase (default 10)"),
    opt("--direct-rate", type=float, default=50.0, help="ttft: req/s of the direct arm, sent at the same time as the routed one (default 50; 0: a direct phase at --rate before the routed one)"),
    opt("--prompt-tokens", type=int, default=64),
    opt("--output-tokens", type=int, default=16),
    opt("--tpot-ms", type=float, default=10.0),
    opt("--mem-streams", type=int, default=TARGETS["mem_streams"], help="memory: streams held open (default 20000; fewer for a smoke run)"),
    # 20,000 streams on two cores: opened at 333/s and one token each 10 s (2,000 events/s),
    # so the holders, tickers and routers keep up (at 1,333/s and 10,000 events/s some were cut)
    opt("--mem-interval-ms", type=float, default=10000.0, help="memory: ms between a held stream's tokens (default 10000)"),
    opt("--mem-ramp", type=float, default=60.0, help="memory: seconds to open them (default 60)"),
    opt("--mem-hold", type=float, default=5.0, help="memory: seconds held before the reading (default 5)"),
    opt("--quiet-wait", type=float, default=30.0, help="wait at most this long before each measurement for the rest of the machine to go quiet (default 30; 0: never)"),
    opt("--out", default="out/bench", help="save versus.md and versus.json here (default out/bench; '' to skip)"),
    O.from_json("versus"),
)


add_arguments = O.adder(OPTIONS)


def command(args: argparse.Namespace) -> str:
    """The exact command line when run as `narwhal bench versus` or `python -m
    narwhal_bench.versus`; else (called from Python, e.g. a test) the `narwhal bench versus`
    line that repeats the run: every option that differs from its default."""
    if sys.argv and (Path(sys.argv[0]).name == "narwhal" or sys.argv[0].endswith("versus.py")):
        return command_line("narwhal_bench.versus")
    p = argparse.ArgumentParser()
    add_arguments(p)
    out = ["narwhal bench versus"]
    for act in p._actions:
        if not act.option_strings or act.dest in ("help", "from_json"):
            continue
        v = getattr(args, act.dest, act.default)
        if v != act.default:
            out.append(f"{act.option_strings[0]} {v:g}" if isinstance(v, float) else f"{act.option_strings[0]} {v}")
    return " ".join(out)


# -- pure parts --------------------------------------------------------------------------------


def runs_order(routers: Sequence[str], k: int) -> list[str]:
    """The routers' order in run k (0-based): as given in even k, reversed in odd k."""
    return list(routers) if k % 2 == 0 else list(reversed(routers))


def median(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None and not math.isnan(x)]
    return statistics.median(v) if v else None


def estimate_s(parts: Sequence[str], n_routers: int, runs: int, *, warm: float = 4.0, window: float = 15.0, ttft_duration: float = 10.0, mem_ramp: float = 15.0,
               mem_hold: float = 5.0, mem_streams: int = 20_000) -> float:
    """Expected wall time of a run (seconds) on a quiet machine: per router and part its start
    and stop (~1.5 s; Narwhal's is the longest), the quiet check (0.5 s), warm-ups, the
    measured spans; the memory part's cancel of its streams grows with them (as measured
    here: 1 run of the three parts in ~27 s per router at smoke size, 9,800 streams in ~27 s)."""
    per = {
        "relay": 2 + warm + window + 1.5,
        "ttft": 2 + 3.5 + 2 * ttft_duration + 1,  # (at most: interleaved arms take one duration)
        "memory": 2 + 2 + mem_ramp + 1 + mem_hold + 4 + mem_streams / 5000,
    }
    return 10 + runs * n_routers * sum(per[p] for p in parts if p in per)


def _rows_of(measurements: Sequence[dict[str, Any]], part: str, router: str) -> list[dict[str, Any]]:
    return [m for m in measurements if m["part"] == part and m["router"] == router and not m.get("failed")]


def summary(measurements: Sequence[dict[str, Any]], routers: Sequence[str], rust: Sequence[str] = H.RUST_PEERS) -> dict[str, Any]:
    """Per router the values of each run and their medians, and Narwhal's ratios.

    `measurements`: one dict per (part, run, router): relay ones carry events_per_cpu_s,
    ttft ones added_p50_ms / added_p99_ms, memory ones kib_per_stream."""
    per: dict[str, dict[str, Any]] = {}
    for r in routers:
        eps = [m["events_per_cpu_s"] for m in _rows_of(measurements, "relay", r)]
        us = [1e6 / x for x in eps if x and math.isfinite(x)]
        a50 = [m["added_p50_ms"] for m in _rows_of(measurements, "ttft", r)]
        a99 = [m["added_p99_ms"] for m in _rows_of(measurements, "ttft", r)]
        kib = [m["kib_per_stream"] for m in _rows_of(measurements, "memory", r)]
        per[r] = {"events_per_cpu_s": eps, "events_per_cpu_s_median": median(eps), "us_per_event": us, "us_per_event_median": median(us),
                  "added_p50_ms": a50, "added_p50_ms_median": median(a50), "added_p99_ms": a99, "added_p99_ms_median": median(a99),
                  "kib_per_stream": kib, "kib_per_stream_median": median(kib)}
    peers_ = [r for r in rust if r in per]
    best_cpu = min((r for r in peers_ if per[r]["us_per_event_median"] is not None), key=lambda r: per[r]["us_per_event_median"], default=None)
    best_ttft = min((r for r in peers_ if per[r]["added_p50_ms_median"] is not None), key=lambda r: per[r]["added_p50_ms_median"], default=None)
    out: dict[str, Any] = {"routers": per, "rust_peers": peers_, "best_cpu_peer": best_cpu, "best_ttft_peer": best_ttft, "narwhal": {}}
    for n in (r for r in routers if r.startswith("narwhal")):
        nus = per[n]["us_per_event_median"]
        ratios = {r: (nus / per[r]["us_per_event_median"]) if nus is not None and per[r]["us_per_event_median"] else None for r in routers if not r.startswith("narwhal")}
        n50 = per[n]["added_p50_ms_median"]
        out["narwhal"][n] = {
            "cpu_ratio": ratios, "cpu_ratio_best": ratios.get(best_cpu) if best_cpu else None,
            "ttft_p50_minus_best_ms": (n50 - per[best_ttft]["added_p50_ms_median"]) if n50 is not None and best_ttft else None,
        }
    return out


def _pf(ok: bool | None) -> str:
    return "n/a" if ok is None else ("PASS" if ok else "MISS")


def verdict(s: dict[str, Any], *, mem_streams: int | None = None, rate: float | None = None, targets: dict[str, float] = TARGETS) -> list[dict[str, Any]]:
    """The issue's targets on the medians, one entry per (Narwhal arm, target):
    {"narwhal", "target", "result" (PASS | MISS | n/a), "line"}. `mem_streams` and `rate`: what
    the memory and TTFT parts ran at, named in the line when not the target's own."""
    out: list[dict[str, Any]] = []
    per = s["routers"]
    best_cpu, best_ttft = s["best_cpu_peer"], s["best_ttft_peer"]
    for n, nv in s["narwhal"].items():
        me = per[n]

        def add(target: str, ok: bool | None, line: str, n: str = n) -> None:
            out.append({"narwhal": n, "target": target, "result": _pf(ok), "line": f"**{_pf(ok)}** {n}: {line}"})

        r = nv["cpu_ratio_best"]
        if r is None:
            why = "no Rust peer's relay measurement" if best_cpu is None else f"no relay measurement of {n}"
            add("cpu", None, f"CPU per relayed event ≤ {targets['cpu_ratio']:.1f}× the best Rust peer's: n/a ({why})")
            add("cpu-stretch", None, f"CPU per relayed event ≤ {targets['cpu_ratio_stretch']:.1f}× the best Rust peer's (stretch): n/a ({why})")
        else:
            what = f"{me['us_per_event_median']:.2f} µs vs {best_cpu} {per[best_cpu]['us_per_event_median']:.2f} µs per event: {r:.2f}×"
            add("cpu", r <= targets["cpu_ratio"], f"CPU per relayed event ≤ {targets['cpu_ratio']:.1f}× the best Rust peer's: {what}")
            add("cpu-stretch", r <= targets["cpu_ratio_stretch"], f"CPU per relayed event ≤ {targets['cpu_ratio_stretch']:.1f}× the best Rust peer's (stretch): {what}")
        d = nv["ttft_p50_minus_best_ms"]
        if d is None:
            add("ttft-p50", None, f"added TTFT p50 ≤ the best Rust peer's + {targets['ttft_p50_margin_ms']:g} ms: n/a (no TTFT measurement of {n if best_ttft else 'any Rust peer'})")
        else:
            add("ttft-p50", d <= targets["ttft_p50_margin_ms"] + 1e-9, f"added TTFT p50 ≤ the best Rust peer's + {targets['ttft_p50_margin_ms']:g} ms: "
                f"{me['added_p50_ms_median']:.3f} ms vs {best_ttft} {per[best_ttft]['added_p50_ms_median']:.3f} ms ({d:+.3f} ms)")
        p99 = me["added_p99_ms_median"]
        off = "" if rate is None or rate == 200 else f" (measured at {rate:g} req/s: indicative only)"
        add("ttft-p99", None if p99 is None else p99 <= targets["ttft_p99_ms"],
            f"added TTFT p99 ≤ {targets['ttft_p99_ms']:g} ms at 200 req/s: " + ("n/a (no TTFT measurement)" if p99 is None else f"{p99:.3f} ms{off}"))
        kib = me["kib_per_stream_median"]
        at = "" if mem_streams is None or mem_streams >= targets["mem_streams"] else \
            f" (measured at {mem_streams:,} streams, not {targets['mem_streams']:,}: indicative only)"
        add("memory", None if kib is None else kib <= targets["kib_per_stream"],
            f"memory per open stream ≤ {targets['kib_per_stream']:g} KiB at {targets['mem_streams']:,} streams: " + ("n/a (no memory measurement)" if kib is None else f"{kib:.1f} KiB{at}"))
    return out


def _f(v: float | None, fmt: str = "{:.2f}") -> str:
    return "—" if v is None else fmt.format(v)


def tables(data: dict[str, Any]) -> str:
    """The whole Markdown report of a run (or of its saved JSON)."""
    routers = [r for r in data["routers"] if r not in data.get("unavailable", {})] + [r for r in data["routers"] if r in data.get("unavailable", {})]
    s = summary(data["measurements"], routers)
    ms = data["measurements"]
    lines = [f"Reproduce: `{data['command']}`", "",
             f"{data['runs']} run(s), parts {', '.join(data['parts'])}; routers one after another in the order {', '.join(data['routers'])} in odd runs, reversed in even runs, "
             f"each started fresh for every part. Narwhal: admission mode {data['mode']} (relay, ttft); memory part open, no profiling. {data['pinning']} "
             f"RLIMIT_NOFILE {data['nofile'][0]}/{data['nofile'][1]}. Started {data['started']}, {data['elapsed_s'] / 60:.1f} min.", ""]
    cols = ["router", "events per router CPU-s (median)", "runs", "µs per event", "Narwhal CPU per event ÷ this", "added TTFT p50 ms", "added TTFT p99 ms", "KiB per open stream"]
    narwhal = next(iter(s["narwhal"]), None)
    rows = []
    for r in routers:
        v = s["routers"][r]
        ratio = s["narwhal"][narwhal]["cpu_ratio"].get(r) if narwhal and not r.startswith("narwhal") else None
        tag = " (Rust peer)" if r in s["rust_peers"] else " (baseline)" if r == "envoy" else ""
        rows.append([r + tag, _f(v["events_per_cpu_s_median"], "{:,.0f}"), " / ".join(_f(x, "{:,.0f}") for x in v["events_per_cpu_s"]) or "—",
                     _f(v["us_per_event_median"]), "—" if r.startswith("narwhal") else _f(ratio), _f(v["added_p50_ms_median"], "{:.3f}"),
                     _f(v["added_p99_ms_median"], "{:.3f}"), _f(v["kib_per_stream_median"], "{:.1f}")])
    lines += ["Medians over the runs:", "", markdown_table(cols, rows), ""]
    for n, nv in s["narwhal"].items():
        best = s["best_cpu_peer"]
        lines.append(f"{n}: CPU per event over the best Rust peer's ({best or '—'}) {_f(nv['cpu_ratio_best'])}×; "
                     f"added TTFT p50 minus the best Rust peer's ({s['best_ttft_peer'] or '—'}) {_f(nv['ttft_p50_minus_best_ms'], '{:+.3f}')} ms.")
    lines += ["", "Targets (issue 25):", ""]
    lines += [f"- {v['line']}" for v in verdict(s, mem_streams=data["mem_streams"] if "memory" in data["parts"] else None, rate=data["settings"]["rate"])]
    relay = [m for m in ms if m["part"] == "relay"]
    if relay:
        lines += ["", f"Relay, per run ({data['settings']['streams']} streams, {data['settings']['tokens']} tokens {data['settings']['interval_ms']:g} ms apart, "
                  f"{data['settings']['window']:g} s window after {data['settings']['warm']:g} s):", ""]
        lines.append(markdown_table(["run", "#", "router", "events/s at the client", "router cores busy", "events per router CPU-s", "µs per event", "TPOT p50 ms", "TPOT p99 ms",
                                     "errors", "others' cores"],
                                    [[m["run"], m["position"], m["router"], *(["failed: " + m["failed"][:120]] + [""] * 8 if m.get("failed") else
                                      [f"{m['events_per_s']:,.0f}", f"{m['cpu_s'] / m['seconds']:.2f}", f"{m['events_per_cpu_s']:,.0f}", f"{1e6 / m['events_per_cpu_s']:.2f}",
                                       fmt_ms(m["tpot_p50"]), fmt_ms(m["tpot_p99"]), m["errors"], _f(m.get("others_cores"))])] for m in relay]))
    ttft = [m for m in ms if m["part"] == "ttft"]
    if ttft:
        st = data["settings"]
        how = (f"the direct arm at {st['direct_rate']:g} req/s at the same time, interleaved" if st.get("direct_rate", 0) > 0 else
               "direct then routed on the same arrivals")
        lines += ["", f"TTFT, per run ({st['rate']:g} req/s Poisson for {st['ttft_duration']:g} s, {how}; prompt {st['prompt_tokens']}, "
                  f"{st['output_tokens']} tokens {st['tpot_ms']:g} ms apart; ms):", ""]
        lines.append(markdown_table(["run", "#", "router", "ok/offered", "direct p50", "routed p50", "added p50", "direct p99", "routed p99", "added p99", "router CPU µs / token",
                                     "others' cores"],
                                    [[m["run"], m["position"], m["router"], *(["failed: " + m["failed"][:120]] + [""] * 8 if m.get("failed") else
                                      [f"{m['ok']}/{m['offered']}", _f(m["direct_p50_ms"], "{:.3f}"), _f(m["routed_p50_ms"], "{:.3f}"), _f(m["added_p50_ms"], "{:.3f}"),
                                       _f(m["direct_p99_ms"], "{:.3f}"), _f(m["routed_p99_ms"], "{:.3f}"), _f(m["added_p99_ms"], "{:.3f}"), _f(m["cpu_us_per_token"], "{:.1f}"),
                                       _f(m.get("others_cores"))])] for m in ttft]))
    mem = [m for m in ms if m["part"] == "memory"]
    if mem:
        lines += ["", f"Memory, per run ({data['mem_streams']:,} streams opened over {data['settings']['mem_ramp']:g} s, one token every "
                  f"{data['settings']['mem_interval_ms']:g} ms, read after {data['settings']['mem_hold']:g} s"
                  + (f"; from {mp['holders']} holder processes to {mp['tickers']} ticker engines; Narwhal with {mp['narwhal_workers']} data-plane workers, a peer (one process) "
                     f"at the most one process's descriptors hold, {mp['peer_streams']:,}" if (mp := data.get("mem_plan")) and mp["narwhal_workers"] > 1 else "") + "):", ""]
        lines.append(markdown_table(["run", "#", "router", "streams open", "RSS idle MiB", "RSS open MiB", "KiB per open stream", "errors", "others' cores"],
                                    [[m["run"], m["position"], m["router"], *(["failed: " + m["failed"][:120]] + [""] * 5 if m.get("failed") else
                                      [f"{m['open']:,}/{m.get('streams', data['mem_streams']):,}", f"{m['rss_idle'] / 2**20:.0f}", f"{m['rss_open'] / 2**20:.0f}", f"{m['kib_per_stream']:.2f}",
                                       m["errors"], _f(m.get("others_cores"))])] for m in mem]))
    lines += ["", "Routers:"] + [f"- {k}: {v}" for k, v in data.get("notes", {}).items()]
    lines += [f"- **{k}** did not run: {v}" for k, v in data.get("unavailable", {}).items()]
    lines.append("\nAdded TTFT = routed minus direct percentile, same engine, same run" + (", the arms interleaved" if data["settings"].get("direct_rate", 0) > 0 else ", same arrivals")
                 + ". Router CPU and RSS: utime+stime and RSS of the router's whole "
                 "process tree from /proc. others' cores: how busy the rest of the machine kept the CPUs during the measurement (noise).")
    return "\n".join(lines)


# -- the run -----------------------------------------------------------------------------------


def _measure(fn: Callable[[], dict[str, Any]], roots: Sequence[int], quiet_wait: float) -> dict[str, Any]:
    """fn() after waiting (bounded) for a quiet machine, with how busy the rest kept it."""
    from .harness.quiet import Others, await_quiet, tree_pids

    quiet = await_quiet([p for r in roots for p in tree_pids(r)], max_wait_s=quiet_wait, sample_s=0.5) if quiet_wait > 0 else None
    o = Others(roots)
    d = fn()
    return {**d, "others_cores": o.cores(), "quiet": quiet}


def _ttft_one(r: H.Started, eng: H.Engine, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    shape = RequestShape(stream=True, mock={"prefill_ms": 0, "tpot_ms": a.tpot_ms})
    kw = {"prompt_tokens": a.prompt_tokens, "output_tokens": a.output_tokens}
    phase(r.url, r.headers, "1", fixed_rate(min(a.rate, 50), 2.0, seed=99, **kw), shape)  # warm-up: connections, caches
    phase(eng.url, {}, "1", fixed_rate(min(a.rate, 50), 1.0, seed=98, **kw), shape)
    arr = fixed_rate(a.rate, a.ttft_duration, seed=seed, **kw)
    if a.direct_rate > 0:
        # interleaved: the direct arm (its own Poisson arrivals, a different seed) at the
        # same time as the routed one, so both see the same engine load and the same VM
        direct = fixed_rate(a.direct_rate, a.ttft_duration, seed=seed + 7919, **kw)
        c0 = r.proc.cpu()
        dr, sr = phases_at_once([(eng.url, {}, direct), (r.url, r.headers, arr)], "1", shape, drain_s=20.0)
        cpu = r.proc.cpu() - c0
        d, s = summarize(dr), summarize(sr)
    else:  # the direct phase first, then the routed one on the same arrivals
        d = summarize(phase(eng.url, {}, "1", arr, shape))
        c0 = r.proc.cpu()
        s = summarize(phase(r.url, r.headers, "1", arr, shape, drain_s=20.0))
        cpu = r.proc.cpu() - c0

    def ms(x: dict[str, Any], q: str) -> float | None:
        return None if x["ttft"][q] is None else x["ttft"][q] * 1000.0

    out = {"offered": s["offered"], "ok": s["ok"], "errors": s["errors"], "statuses": s["statuses"], "error_samples": s["error_samples"], "router_cpu_s": cpu,
           "cpu_us_per_token": cpu / max(1, s["tokens"]) * 1e6, "direct_ok": d["ok"], "send_lag_p99_ms": None if s["send_lag"]["p99"] is None else s["send_lag"]["p99"] * 1e3}
    for q in ("p50", "p99"):
        dq, rq = ms(d, q), ms(s, q)
        out[f"direct_{q}_ms"], out[f"routed_{q}_ms"] = dq, rq
        out[f"added_{q}_ms"] = None if dq is None or rq is None else rq - dq
    return out


def _one(part: str, r: H.Started, e: H.Engine, a: argparse.Namespace, run_no: int, mem_tokens: int, mem_streams: int) -> dict[str, Any]:
    """One router's measurement of one part."""
    if part == "relay":
        return relay_one(r, streams=a.streams, tokens=a.tokens, warm_s=a.warm, window_s=a.window)
    if part == "ttft":
        return _ttft_one(r, e, a, seed=run_no)
    return memory_one(r, streams=mem_streams, ramp_s=a.mem_ramp, tokens=mem_tokens, hold_s=a.mem_hold)


def versus(a: argparse.Namespace) -> dict[str, Any]:
    parts = O.names(a.parts)
    for p in parts:
        if p not in PARTS:
            raise ValueError(f"unknown part {p!r} (known: {', '.join(PARTS)})")
    routers = H.router_names(O.names(a.routers), O.names(a.servers))
    if a.runs < 1:
        raise ValueError("--runs must be at least 1")
    pre = memory_preflight(a.mem_streams) if "memory" in parts else memory_preflight(0)
    if "memory" in parts and pre["problems"]:
        raise RuntimeError(f"--mem-streams {a.mem_streams:,} does not fit on this machine (at most {pre['max_streams']:,}): " + "; ".join(pre["problems"])
                           + f". Rerun with --mem-streams {pre['max_streams']} or fewer (the memory target stays stated at 20,000), or without the memory part.")
    mem_workers = max(a.workers, pre["narwhal_workers"])
    rcpu, lcpu = layout()
    pin_self(lcpu)
    est = estimate_s(parts, len(routers), a.runs, warm=a.warm, window=a.window, ttft_duration=a.ttft_duration, mem_ramp=a.mem_ramp, mem_hold=a.mem_hold, mem_streams=a.mem_streams)
    t_start = time.monotonic()
    data: dict[str, Any] = {
        "command": command(a), "routers": routers, "runs": a.runs, "parts": parts, "mode": a.mode, "mem_streams": a.mem_streams,
        "settings": {k: getattr(a, k) for k in ("streams", "tokens", "interval_ms", "warm", "window", "rate", "direct_rate", "ttft_duration", "prompt_tokens", "output_tokens", "tpot_ms",
                                                 "mem_interval_ms", "mem_ramp", "mem_hold", "quiet_wait", "workers")},
        "pinning": pinning_note(rcpu, lcpu), "nofile": pre["nofile"], "preflight": pre, "estimate_s": est, "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "measurements": [], "notes": {}, "unavailable": {}, "targets": TARGETS,
    }
    data["mem_plan"] = {"narwhal_workers": mem_workers, "peer_streams": pre["peer_streams"], "holders": pre["spread"], "tickers": pre["spread"]}
    print(f"narwhal bench versus: {', '.join(routers)} x {a.runs} run(s), parts {', '.join(parts)}; expected ~{est / 60:.0f} min", flush=True)
    mem_tokens = int((a.mem_ramp + a.mem_hold + 40) * 1000 / a.mem_interval_ms) + 5
    with H.stopping() as things:
        eng: dict[str, H.Engine] = {}
        if "relay" in parts:
            eng["relay"] = H.ticker_engine("t-relay", interval_ms=a.interval_ms, cpus=lcpu)
        if "ttft" in parts:
            eng["ttft"] = H.mock_engine("u0", cpus=lcpu, timing={"time_scale": 0.1})
        mem_engines: list[H.Engine] = []
        if "memory" in parts:  # one ticker per holder: each holds one descriptor per stream
            mem_engines = [H.ticker_engine(f"t-memory{i}", interval_ms=a.mem_interval_ms, cpus=lcpu) for i in range(pre["spread"])]
            eng["memory"] = mem_engines[0]
        things.extend(eng.values())
        things.extend(mem_engines[1:])
        for k in range(a.runs):
            order = runs_order(routers, k)
            for part in parts:
                for pos, name in enumerate(order, 1):
                    if name in data["unavailable"]:
                        continue
                    e = eng[part]
                    ov = narwhal_overrides("open", mem_workers, a.mem_streams) if part == "memory" else narwhal_overrides(a.mode, a.workers)
                    rec: dict[str, Any] = {"part": part, "run": k + 1, "position": pos, "router": name}
                    # past one process's descriptors Narwhal spreads over its workers; a peer holds what it can
                    mem_streams = a.mem_streams if name.startswith("narwhal") else pre["peer_streams"]
                    try:
                        r = H.start_peer(name, mem_engines if part == "memory" else [e], cpus=rcpu, narwhal_overrides=ov)
                    except H.PeerUnavailable as ex:
                        data["unavailable"][name] = str(ex)
                        print(f"  {name}: not run: {str(ex).splitlines()[0]}", flush=True)
                        continue
                    except (RuntimeError, TimeoutError) as ex:
                        data["measurements"].append({**rec, "failed": f"start: {ex}"})
                        print(f"  run {k + 1} {part} {name}: failed to start: {str(ex).splitlines()[0]}", flush=True)
                        continue
                    things.append(r)
                    if part != "memory" or name not in data["notes"]:  # (the memory table names its own process count)
                        data["notes"][name] = r.notes
                    try:
                        roots = [r.proc.pid] + [x.proc.pid for x in (mem_engines if part == "memory" else [e])]
                        m = _measure(functools.partial(_one, part, r, e, a, k + 1, mem_tokens, mem_streams), roots, a.quiet_wait)
                        m.pop("profile", None)
                        rec.update(m)
                    except (RuntimeError, TimeoutError, OSError) as ex:
                        rec["failed"] = f"{type(ex).__name__}: {ex}"
                    finally:
                        r.stop()
                        things.remove(r)
                    data["measurements"].append(rec)
                    print("  " + _progress(rec), flush=True)
    data["elapsed_s"] = time.monotonic() - t_start
    return data


def _progress(m: dict[str, Any]) -> str:
    head = f"run {m['run']} {m['part']} #{m['position']} {m['router']}:"
    if m.get("failed"):
        return f"{head} failed: {m['failed'][:200]}"
    if m["part"] == "relay":
        return f"{head} {m['events_per_cpu_s']:,.0f} events per router CPU-s ({1e6 / m['events_per_cpu_s']:.2f} µs), {m['events_per_s']:,.0f} events/s, errors {m['errors']}"
    if m["part"] == "ttft":
        return f"{head} added TTFT p50 {_f(m['added_p50_ms'], '{:.3f}')} ms p99 {_f(m['added_p99_ms'], '{:.3f}')} ms, ok {m['ok']}/{m['offered']}"
    return f"{head} {m['kib_per_stream']:.2f} KiB per open stream ({m['open']:,} open), errors {m['errors']}"


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        print(tables(data))
        return 0
    rc, data = run_bench("versus", lambda: versus(args))
    if rc:
        return rc
    data["summary"] = summary(data["measurements"], data["routers"])
    data["verdict"] = verdict(data["summary"], mem_streams=data["mem_streams"] if "memory" in data["parts"] else None, rate=data["settings"]["rate"])
    rep = Report("versus: Narwhal, SMG, vllm-router and Envoy side by side")
    rep.data = data
    print()
    rep.add(tables(data))
    rep.save(Path(args.out) if args.out else None)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return O.main("narwhal_bench.versus", __doc__.split("\n\n")[0] if __doc__ else None, add_arguments, run, argv)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
