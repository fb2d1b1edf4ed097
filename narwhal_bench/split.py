"""`narwhal bench split`: what the split into one admission authority and N data-plane
worker processes (`serving.workers`, issue 13) costs on this machine.

  decisions   the seam's round trip (narwhal/core/lease.py), in process (LocalDoor) vs
              over the IPC channel (RemoteDoor -> WorkerSession), in the same run, open
              loop at a fixed rate of decisions: arrive and admit round trips, p50..max;
              with, for scale, the same client against an authority that decides nothing
              (_Echo) and the machine's floor (a bare blocking echo, `floor`).
  saturation  the highest rate of request cycles one authority core sustains with both
              round trips' p99 <= 1 ms, and the authority's CPU per request (/proc/self/stat).
  relay       relayed token events per CPU-second summed over every router process
              (authority + workers), workers 1 vs 2, alternating in one session.
  ttft        the highest open-loop rate at which the router-added TTFT p99 (routed minus
              direct, same arrivals) stays <= 5 ms, workers 1 vs 2.

How
  * decisions / saturation: the authority is THIS process (a ControlPlane over fake
    unified engines, never started: no health polls, monitoring.stale_after_ms set out of
    reach so R01 never fires; LocalControls and its door). The in-process arm drives
    `door` here directly. The IPC arm gives each client a `WorkerSession` on one end of
    a `socketpair(AF_UNIX)`; the client is a separate `python -m narwhal_bench.split
    client ...` process under uvloop (like `python -m narwhal.workers`) holding a `Link`
    on the other end and driving `RemoteDoor` exactly as a worker's request does. This
    process runs on the router CPU, the clients on the load CPU (harness.processes.layout()).
  * A cycle: arrive, admit, [granted], then (cycle "full", the default: what a streamed
    request on a unified engine sends) first_token and close with a full Outcome (ok
    engine, TPOT, output tokens, finish reason, reported prompt tokens), or (cycle
    "minimal") close(Outcome(at)); then end("completed"). A decision = one admit.
  * Arrivals are uniform at the rate (each client takes rate/N, phase-shifted so their
    union is uniform); each cycle is its own task, started when due whatever happened to
    earlier ones (open loop). As in harness.load.open_loop, a cycle due within 0.5 ms leaves
    at once (uvloop's timers tick in milliseconds; no busy wait), so at 2,000/s cycles
    leave in ones and twos; how late (or early) each one left is kept (send lag). A
    round trip is timed from the call itself, not from when its cycle was due.
  * The client process freezes its start-up heap (gc.freeze) as a worker does
    (narwhal.http.server.settle_heap); the authority here does not, as `supervise` does
    not; collections in the authority during the window are counted and timed.
  * The machine is shared: before each measurement the run waits (bounded) for the
    other processes to go quiet, measures how busy they kept the CPUs meanwhile
    (/proc/stat minus this benchmark's processes), and repeats a measurement taken on a
    busy machine (at most twice; every attempt is reported).
  * The processes of a router are found from the `narwhal serve` PID through
    /proc/<pid>/task/*/children; CPU is utime + stime of each (all threads).

Every loop is bounded in time and count; every process started here is stopped by its
PID (or its own process group).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import harness as H
from .harness import quiet as Q
from .harness.load import RequestShape, fixed_rate, phase, run_loop
from .harness.processes import layout, pin_self
from .harness.quiet import QUIET_CORES, Others, tree_cpu, tree_pids
from .harness.report import Report
from .harness.stats import fmt_ms, markdown_table, percentile, summarize
from .split_seam import authority, client_main, floor, inproc, ipc_arm, pct, summ, us

__all__ = ["split", "decisions", "saturation", "relay_split", "ttft_split", "floor", "await_quiet", "Others", "tree_pids", "tree_cpu"]



_LAYOUT: tuple[set[int] | None, set[int] | None] | None = None
_stopping = False


def _layout() -> tuple[set[int] | None, set[int] | None]:
    """harness.processes.layout(), taken once: each part pins this process, after which layout()
    would see one CPU."""
    global _LAYOUT
    if _LAYOUT is None:
        _LAYOUT = layout()
    return _LAYOUT


def _on_sigterm(signum: int, frame: object) -> None:
    """Stop at the next check (_check), and at once where this process is not inside the
    event loop: uvloop swallows an exception raised in a protocol callback."""
    global _stopping
    _stopping = True
    raise KeyboardInterrupt


def _check() -> None:
    if _stopping:
        raise KeyboardInterrupt


def _role(pid: int, root: int) -> str:
    if pid == root:
        return "authority" if len(tree_pids(root)) > 1 else "router"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return "worker" if b"narwhal.workers" in argv else Path(argv[0].decode(errors="replace")).name



def _attempts(repeats: int, retries: int, busy: Any) -> Any:
    """(k, attempt) pairs: `repeats` runs, each run again while busy() says the last
    attempt was taken on a busy machine (at most `retries` times)."""
    for k in range(repeats):
        for attempt in range(retries + 1):
            _check()
            yield k, attempt
            if not busy():
                break


def decisions(*, rate: float = 2000.0, warm_s: float = 2.0, window_s: float = 10.0, engines: int = 4, mode: str = "predictive", cycle: str = "full",
              repeats: int = 2, retries: int = 2, rep: Report | None = None) -> Report:
    """Part 1: the round trip at `rate` decisions/s, in process and over the channel,
    with the machine's floor (a bare echo over a socket pair) in the same run."""
    rep = rep or Report("split: one authority, N workers")
    rcpu, lcpu = _layout()
    pin_self(rcpu)
    p = {"rate": rate, "warm_s": warm_s, "window_s": window_s, "cycle": cycle, "drain_s": 5.0}

    async def go() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], dict[str, Any]]:
        controls = authority(engines, mode)
        with tempfile.TemporaryDirectory(prefix="narwhal-split-") as tmp:
            local = await inproc(controls, p)
            remote = await ipc_arm(controls, p, 1, lcpu, Path(tmp))
            echo = await ipc_arm(controls, p, 1, lcpu, Path(tmp), echo=True)
        books = controls.control.books.snapshot()
        await controls.control.stop()
        return local, remote, echo, books

    runs: list[dict[str, Any]] = []
    rows = []
    for k, attempt in _attempts(repeats, retries, lambda: bool(runs) and runs[-1]["others_cores"] > RETRY_OTHERS):
        quiet = await_quiet()
        at = time.strftime("%H:%M:%S", time.gmtime())
        local, remote, echo, books = run_loop(go())
        fl, f_others = floor(rate, warm_s, window_s, lcpu)
        ls, rs, es = summ(local), summ(remote), summ(echo)
        es["authority_cpu_us_per_cycle"] = echo["authority_cpu_s"] / max(1, es["completed"]) * 1e6
        ls["process_cpu_us_per_cycle"] = local["proc_cpu_s"] / max(1, ls["completed"]) * 1e6
        ls["process_cpu_us_per_cycle_precise"] = local["cpu_s"] / max(1, ls["completed"]) * 1e6
        rs["authority_cpu_us_per_cycle"] = remote["authority_cpu_s"] / max(1, rs["completed"]) * 1e6
        rs["authority_cpu_us_per_cycle_precise"] = remote["authority_cpu_s_precise"] / max(1, rs["completed"]) * 1e6
        rs["client_cpu_us_per_cycle"] = sum(remote["client_cpu_s"]) / max(1, rs["completed"]) * 1e6
        others = max(local["others_cores"], remote["others_cores"], echo["others_cores"], f_others)
        run = {"at": at, "in_process": {**ls, "gc": local["gc"], "others_cores": local["others_cores"]},
               "ipc": {**rs, "gc": remote["gc"], "late_start_s": remote["late_start_s"], "channel_messages": remote["channel_messages"], "others_cores": remote["others_cores"]},
               "echo": {**es, "others_cores": echo["others_cores"]}, "floor": pct(fl), "books": books, "others_cores": others, "steal_s": remote["steal_s"], "quiet": quiet, "attempt": attempt, "k": k}
        runs.append(run)
        for name, sm in (("in process (LocalDoor)", ls), ("over the channel (RemoteDoor -> WorkerSession)", rs),
                         ("over the channel, an authority that decides nothing (bare Channel answering at once)", es)):
            for what in ("arrive", "admit", "both"):
                q = sm[what]
                rows.append([f"#{k + 1}{'' if attempt == 0 else f'.{attempt + 1}'} ({at})", name, what, us(q["p50"]), us(q["p90"]), us(q["p99"]), us(q["max"]), f"{sm['achieved_per_s']:,.0f}",
                             us(sm["lag"]["p99"])])
        q = run["floor"]
        rows.append([f"#{k + 1}{'' if attempt == 0 else f'.{attempt + 1}'}", "floor: bare echo over a socket pair, CPU 0 <-> 1", "one message each way", us(q["p50"]), us(q["p90"]), us(q["p99"]), us(q["max"]),
                     f"{rate:,.0f}", "—"])
        print(f"  decisions #{k + 1}: channel arrive p50/p99 {us(rs['arrive']['p50'])}/{us(rs['arrive']['p99'])} µs, admit {us(rs['admit']['p50'])}/"
              f"{us(rs['admit']['p99'])} µs, both {us(rs['both']['p50'])}/{us(rs['both']['p99'])} µs; no-decision echo arrive {us(es['arrive']['p50'])}/{us(es['arrive']['p99'])} µs; floor {us(q['p50'])}/{us(q['p99'])} µs; "
              f"others {others:.2f} cores", flush=True)
    rep.data["decisions"] = {"rate": rate, "warm_s": warm_s, "window_s": window_s, "engines": engines, "mode": mode, "cycle": cycle, "runs": runs,
                             "pinning": f"authority (this process) on CPU {sorted(rcpu or ())}, the client process on CPU {sorted(lcpu or ())}"}
    rep.add(f"**Decision round trip** at {rate:,.0f} decisions/s (uniform, open loop; a decision = one admit), {window_s:g} s after {warm_s:g} s of warm-up, "
            f"{engines} fake unified engines, admission mode {mode}, cycle {cycle}; {repeats} runs, each: in process, then over the channel, then over the channel to an "
            f"authority that decides nothing (the same client, RemoteDoor and Channel; the authority's end a bare ipc.Channel answering Arrive and Admit at once with a "
            f"fixed answer), then the floor (a bare blocking echo over a socket pair, no event loop). "
            f"Authority (this process) pinned to CPU {sorted(rcpu or ())}; the client process (uvloop) and the echo on CPU {sorted(lcpu or ())}.")
    rep.add(markdown_table(["run", "arm", "round trip", "p50 µs", "p90 µs", "p99 µs", "max µs", "achieved decisions/s", "send lag p99 µs"], rows))
    crow = [[f"#{r['k'] + 1}{'' if r['attempt'] == 0 else '.' + str(r['attempt'] + 1)}", f"{r['ipc']['authority_cpu_us_per_cycle']:.1f} ({r['ipc']['authority_cpu_us_per_cycle_precise']:.1f})",
             f"{r['echo']['authority_cpu_us_per_cycle']:.1f}", f"{r['ipc']['client_cpu_us_per_cycle']:.1f}",
             f"{r['in_process']['process_cpu_us_per_cycle']:.1f}", f"{r['in_process']['others_cores']:.2f} / {r['ipc']['others_cores']:.2f}", f"{r['steal_s']:.2f}",
             f"{r['books']['offered']} / {r['books']['open']} / {r['books']['double_ends']}", _other(r["ipc"]["counts"]), json.dumps(r["ipc"]["gc"]) if r["ipc"]["gc"] else "none"]
            for r in runs]
    rep.add(markdown_table(["run", "authority CPU µs / cycle over the channel, /proc (process_time)", "the no-decision authority's CPU µs / cycle", "client CPU µs / cycle", "in process: CPU µs / cycle, both sides + pacing",
                            "other processes' cores busy (in-process / channel window)", "steal s (channel window)", "books offered / open / double ends", "refused / unanswered", "GC in the authority (channel window)"], crow))
    worst = max(max(r["ipc"]["arrive"]["p99"] or 1e9, r["ipc"]["admit"]["p99"] or 1e9) for r in runs)
    best = min(max(r["ipc"]["arrive"]["p99"] or 1e9, r["ipc"]["admit"]["p99"] or 1e9) for r in runs)
    rep.data["decisions"]["worst_p99_us"], rep.data["decisions"]["best_p99_us"] = worst, best
    rep.add(f"Target (issue 13): p99 ≤ 250 µs at 2,000 decisions/s over the channel: the larger of the two round trips' p99 was {us(best)} µs in the best run, "
            f"{us(worst)} µs in the worst ({'met' if worst <= 250 else 'met in some runs' if best <= 250 else 'NOT met'}). A run during which other processes kept "
            f"> {RETRY_OTHERS:g} core busy was repeated (at most {retries} times; numbered #k.2, #k.3).")
    return rep


# Prefill slots per engine for the relay and TTFT parts (the harness's default is 4): with
# worker processes a queued request can lose its grant (docs/performance.md, the split
# section), so both parts keep requests from queueing and measure the split itself.
PREFILL_SLOTS = 256

RETRY_OTHERS = 0.25  # a measurement during which other processes kept more than this busy is repeated
_quiet_wait_s = 60.0  # split(quiet_wait=...)


def await_quiet(exclude: Sequence[int] = (), *, max_wait_s: float | None = None, sample_s: float = 1.0) -> dict[str, float]:
    """harness.quiet.await_quiet with this run's --quiet-wait and its SIGTERM check."""
    return Q.await_quiet(exclude, max_wait_s=_quiet_wait_s if max_wait_s is None else max_wait_s, sample_s=sample_s, check=_check)


def _other(c: dict[str, int]) -> str:
    o = {k: v for k, v in c.items() if k != "completed" and v}
    return json.dumps(o) if o else "none"


def saturation(*, rates: Sequence[float] = (2000, 3000, 4000, 5000, 6000, 8000, 10000, 12000, 14000, 16000, 20000), warm_s: float = 1.0, window_s: float = 5.0,
               engines: int = 4, mode: str = "predictive", cycle: str = "full", clients: int = 1, p99_limit_us: float = 1000.0, retries: int = 2,
               rep: Report | None = None) -> Report:
    """Part 1b: raise the rate of cycles; a step passes while both round trips' p99 stay
    within p99_limit_us; the steps go on past that (to map the authority's CPU per request
    and its throughput) until the cycles no longer all complete at the offered rate. A
    step that fails while other processes kept more than 0.1 core busy is run again (at
    most `retries` times; every attempt is reported)."""
    rep = rep or Report("split: one authority, N workers")
    rcpu, lcpu = _layout()
    pin_self(rcpu)
    steps: list[dict[str, Any]] = []

    async def go() -> dict[str, Any]:
        controls = authority(engines, mode)
        with tempfile.TemporaryDirectory(prefix="narwhal-split-") as tmp:
            # warm the authority's code paths and the learners once
            await ipc_arm(controls, {"rate": 1000.0, "warm_s": 0.5, "window_s": 0.5, "cycle": cycle, "drain_s": 2.0}, 1, lcpu, Path(tmp))
            for rate in rates:
                for attempt in range(retries + 1):
                    _check()
                    quiet = await_quiet()  # blocks this loop: nothing else runs between steps
                    r = await ipc_arm(controls, {"rate": float(rate), "warm_s": warm_s, "window_s": window_s, "cycle": cycle, "drain_s": 3.0}, clients, lcpu, Path(tmp))
                    s = summ(r)
                    s.update(rate=rate, attempt=attempt, at=time.strftime("%H:%M:%S", time.gmtime()), authority_busy=r["authority_cpu_s"] / r["window_s"],
                             authority_cpu_us=r["authority_cpu_s"] / max(1, s["completed"]) * 1e6,
                             authority_cpu_us_precise=r["authority_cpu_s_precise"] / max(1, s["completed"]) * 1e6,
                             client_busy=[c / r["window_s"] for c in r["client_cpu_s"]], gc=r["gc"], steal_s=r["steal_s"], others_cores=r["others_cores"], quiet=quiet)
                    s["kept_up"] = s["achieved_per_s"] >= 0.97 * rate and not any(v for k, v in s["counts"].items() if k != "completed")
                    s["ok"] = s["kept_up"] and max(s["arrive"]["p99"] or 1e9, s["admit"]["p99"] or 1e9) <= p99_limit_us
                    steps.append(s)
                    print(f"  saturation {rate:,.0f}/s (attempt {attempt + 1}): achieved {s['achieved_per_s']:,.0f}/s, arrive p99 {us(s['arrive']['p99'])} µs, "
                          f"admit p99 {us(s['admit']['p99'])} µs, authority busy {s['authority_busy']:.2f} ({s['authority_cpu_us']:.1f} µs/request), "
                          f"clients busy {', '.join(f'{c:.2f}' for c in s['client_busy'])}, others ~{s['others_cores']:.2f} cores{'' if s['ok'] else '  <- over'}", flush=True)
                    if s["ok"] or s["others_cores"] <= RETRY_OTHERS:
                        break
                if not s["kept_up"]:
                    break  # past the authority's throughput: stop
        books: dict[str, Any] = controls.control.books.snapshot()
        await controls.control.stop()
        return books

    books = run_loop(go())
    best = None
    for s in sorted(steps, key=lambda s: (s["rate"], -s["attempt"])):  # the highest rate before the first step that failed (its last attempt)
        last = [x for x in steps if x["rate"] == s["rate"]][-1]
        if not last["ok"]:
            break
        best = last
    top = max((s for s in steps if s["kept_up"]), key=lambda s: s["achieved_per_s"], default=None)
    rep.data["saturation"] = {"steps": steps, "books": books, "clients": clients, "cycle": cycle, "mode": mode, "engines": engines, "p99_limit_us": p99_limit_us,
                              "best_rate": best["rate"] if best else None, "best": best, "throughput": top}
    rows = [[f"{s['rate']:,.0f}" + (f" (again, {s['attempt'] + 1})" if s["attempt"] else ""), s["at"], f"{s['achieved_per_s']:,.0f}", us(s["arrive"]["p50"]),
             us(s["arrive"]["p99"]), us(s["admit"]["p50"]), us(s["admit"]["p99"]), us(s["admit"]["max"]), f"{s['authority_busy']:.2f}", f"{s['authority_cpu_us']:.1f}",
             " + ".join(f"{c:.2f}" for c in s["client_busy"]), f"{s['others_cores']:.2f}", us(s["lag"]["p99"]), "yes" if s["ok"] else "**no**"] for s in steps]
    rep.add(f"**Authority saturation**: request cycles ({cycle}) at rising rates from {clients} client process(es) (each its own channel and WorkerSession, "
            f"as a worker has) on CPU {sorted(lcpu or ())}, the authority alone on CPU {sorted(rcpu or ())}; {window_s:g} s per step after {warm_s:g} s. "
            f"A step passes when both round trips' p99 ≤ {p99_limit_us:,.0f} µs, the client(s) achieved ≥ 97 % of the rate and nothing was refused; the "
            f"steps go on past the first miss until the cycles no longer complete at the offered rate; a step that failed while other processes kept > {RETRY_OTHERS:g} core "
            f"busy ran again (at most {retries} times).")
    rep.add(markdown_table(["offered cycles/s", "at", "achieved/s", "arrive p50 µs", "arrive p99 µs", "admit p50 µs", "admit p99 µs", "admit max µs",
                            "authority cores busy", "**authority CPU µs / request**", "client cores busy", "others' cores busy", "send lag p99 µs", "passes"], rows))
    words = [f"Highest rate before the first miss: **{best['rate']:,.0f} requests/s** at {best['authority_cpu_us']:.1f} µs of authority CPU per request "
             f"(authority core {best['authority_busy']:.0%} busy)." if best else "No step passed."]
    if top:
        words.append(f"Highest rate completed in full: {top['achieved_per_s']:,.0f} requests/s at {top['authority_cpu_us']:.1f} µs of authority CPU per request "
                     f"(authority core {top['authority_busy']:.0%} busy; admit p99 {us(top['admit']['p99'])} µs).")
    words.append(f"Books: {books['offered']} offered, open {books['open']}, double ends {books['double_ends']}.")
    rep.add(" ".join(words))
    return rep


# -- part 2: relay cost over every router process ------------------------------------------------


async def _relay_window(url: str, streams: int, tokens: int, root: int, warm_s: float, window_s: float, engine_pid: int) -> dict[str, Any]:
    from .harness.client import SSERecorder, make_client
    from .harness.load import run_closed_loop

    c = make_client(url, "1")
    total = warm_s + window_s + 1.0
    load = asyncio.create_task(run_closed_loop(c, RequestShape(stream=True), concurrency=streams, duration_s=total, prompt_tokens=32, output_tokens=tokens,
                                               ramp_s=min(2.0, warm_s)))
    await asyncio.sleep(warm_s)
    t0, k0, c0 = time.perf_counter(), SSERecorder.tokens_seen, tree_cpu(root)
    oth = Others([root, engine_pid])
    await asyncio.sleep(window_s)
    t1, k1, c1 = time.perf_counter(), SSERecorder.tokens_seen, tree_cpu(root)
    others = oth.cores()
    res = await load
    await c.aclose()
    per = {p: c1[p] - c0.get(p, 0.0) for p in c1}
    roles = {p: _role(p, root) for p in c1}
    gone = [p for p in c0 if p not in c1]
    tp = [r.tpot for r in res if r.tpot is not None]
    s = summarize(res)
    return {"seconds": t1 - t0, "events": float(k1 - k0), "cpu_s": sum(per.values()), "per_process": [{"pid": p, "role": roles[p], "cpu_s": v} for p, v in per.items()],
            "processes_gone": gone, "others_cores": others, "tpot_p50": percentile(tp, 50), "tpot_p99": percentile(tp, 99), "statuses": s["statuses"],
            "errors": sum(1 for x in res if x.error and x.error != "cut at end of run")}


def _share(x: dict[str, Any], seconds: float) -> str:
    return f"{x['role']} {x['cpu_s'] / seconds:.2f}"


def relay_split(*, streams: int = 200, interval_ms: float = 20.0, tokens: int = 250, warm_s: float = 4.0, window_s: float = 15.0, workers: Sequence[int] = (1, 2),
                alternations: int = 2, mode: str = "open", retries: int = 2, rep: Report | None = None) -> Report:
    rep = rep or Report("split: one authority, N workers")
    rcpu, lcpu = _layout()
    pin_self(lcpu)
    runs: list[dict[str, Any]] = []
    things: list[Any] = []
    try:
        tk = H.ticker_engine("t0", interval_ms=interval_ms, cpus=lcpu)
        things.append(tk.proc)
        for a in range(alternations):
            for n in (workers if a % 2 == 0 else list(reversed(workers))):
                for attempt in range(retries + 1):
                    _check()
                    cfg = H.narwhal_config([tk], admission={"mode": mode, "phase_concurrency": {"prefill": PREFILL_SLOTS, "decode": 8192}})
                    cfg["serving"]["workers"] = n
                    r = H.start_narwhal(cfg, cpus=rcpu, name=f"narwhal-split-w{n}")
                    things.append(r.proc)
                    try:
                        quiet = await_quiet([*tree_pids(r.proc.pid), tk.proc.pid])
                        win = run_loop(_relay_window(r.url, streams, tokens, r.proc.pid, warm_s, window_s, tk.proc.pid))
                        win["quiet"] = quiet
                    finally:
                        r.stop()
                        things.remove(r.proc)
                    win.update(workers=n, alternation=a, attempt=attempt, at=time.strftime("%H:%M:%S", time.gmtime()))
                    win["events_per_cpu_s"] = win["events"] / win["cpu_s"] if win["cpu_s"] > 0 else math.inf
                    win["cpu_us_per_event"] = 1e6 * win["cpu_s"] / max(1.0, win["events"])
                    win["superseded"] = win["others_cores"] > RETRY_OTHERS and attempt < retries
                    runs.append(win)
                    print(f"  relay workers={n} (#{a + 1}): {win['events'] / win['seconds']:,.0f} events/s, {win['cpu_s'] / win['seconds']:.2f} cores, "
                          f"{win['events_per_cpu_s']:,.0f} events/CPU-s ({win['cpu_us_per_event']:.1f} µs) "
                          f"[{', '.join(_share(x, win['seconds']) for x in win['per_process'])}], others {win['others_cores']:.2f} cores"
                          f"{'  <- busy machine: again' if win['superseded'] else ''}", flush=True)
                    if not win["superseded"]:
                        break
    finally:
        for p in reversed(things):
            with contextlib.suppress(Exception):
                p.stop()
    ideal = streams * 1000.0 / interval_ms
    rows = []
    for w in runs:
        split_ = " + ".join(_share(x, w["seconds"]) for x in sorted(w["per_process"], key=lambda x: x["role"] != "authority"))
        rows.append([f"workers {w['workers']} (#{w['alternation'] + 1}, {w['at']})" + (" — busy machine, repeated" if w["superseded"] else ""),
                     f"{w['events'] / w['seconds']:,.0f}", f"{w['cpu_s'] / w['seconds']:.2f}", split_,
                     f"{w['events_per_cpu_s']:,.0f}", f"{w['cpu_us_per_event']:.1f}", fmt_ms(w["tpot_p50"]), fmt_ms(w["tpot_p99"]), f"{w['others_cores']:.2f}",
                     f"{w['statuses']}".replace("'", "")])
    kept = [w for w in runs if not w["superseded"]]
    mean = {n: sum(w["cpu_us_per_event"] for w in kept if w["workers"] == n) / max(1, sum(1 for w in kept if w["workers"] == n)) for n in workers}
    rep.data["relay"] = {"streams": streams, "interval_ms": interval_ms, "tokens": tokens, "warm_s": warm_s, "window_s": window_s, "mode": mode, "runs": runs,
                         "mean_cpu_us_per_event": mean, "prefill_slots": PREFILL_SLOTS,
                         "pinning": f"every router process on CPU {sorted(rcpu or ())}; load tool and ticker on CPU {sorted(lcpu or ())}"}
    rep.add(f"**Relay cost per event, workers 1 vs 2**: {streams} concurrent streams (closed loop, {tokens} tokens each), one token every {interval_ms:g} ms "
            f"from the ticker = {ideal:,.0f} events/s offered, admission mode {mode}, HTTP/1.1; CPU = utime+stime of every process of the router "
            f"(the `narwhal serve` process and its children, found through /proc/<pid>/task/*/children) over {window_s:g} s after {warm_s:g} s; the two worker "
            f"counts alternate, {alternations} runs each (a run during which other processes kept > {RETRY_OTHERS:g} core busy is repeated, at most {retries} times). "
            f"All router processes on CPU {sorted(rcpu or ())}, load tool and ticker on CPU {sorted(lcpu or ())}.")
    rep.add(markdown_table(["run", "events/s at the client", "router cores busy", "by process (cores)", "**events / router CPU-s**", "µs / event", "TPOT p50 ms", "TPOT p99 ms",
                            "others' cores busy", "statuses"], rows))
    if 1 in mean and 2 in mean and mean[1] > 0:
        ratio = mean[2] / mean[1]
        rep.data["relay"]["ratio"] = ratio
        rep.add(f"Mean µs per event (runs kept): workers 1 {mean[1]:.1f}, workers 2 {mean[2]:.1f}: ratio **{ratio:.2f}** (target ≤ 1.15: {'met' if ratio <= 1.15 else 'NOT met'}).")
    return rep


# -- part 3: sustained streaming rate at router-added TTFT p99 <= 5 ms ---------------------------


def _added(s: dict[str, Any], d: dict[str, Any], q: str) -> float | None:
    return None if s["ttft"][q] is None or d["ttft"][q] is None else s["ttft"][q] - d["ttft"][q]


def ttft_split(*, rates: Sequence[float] = (50, 100, 150, 200, 300, 400, 600), duration_s: float = 8.0, rounds: int = 2, workers: Sequence[int] = (1, 2),
               layouts: Sequence[str] = ("pinned", "spread"), limit_ms: float = 5.0, output_tokens: int = 16, tpot_ms: float = 10.0, misses: int = 2,
               retries: int = 2, rep: Report | None = None) -> Report:
    rep = rep or Report("split: one authority, N workers")
    rcpu, lcpu = _layout()
    pin_self(lcpu)
    shape = RequestShape(stream=True, mock={"prefill_ms": 0, "tpot_ms": tpot_ms})
    points: list[dict[str, Any]] = []
    for lay in layouts:
        router_cpus = rcpu if lay == "pinned" else None
        things: list[Any] = []
        try:
            tk = H.ticker_engine(f"tt-{lay}", interval_ms=tpot_ms, cpus=lcpu)
            things.append(tk.proc)
            routers = {}
            for n in workers:
                cfg = H.narwhal_config([tk], admission={"mode": "open", "phase_concurrency": {"prefill": PREFILL_SLOTS, "decode": 8192}})
                cfg["serving"]["workers"] = n
                r = H.start_narwhal(cfg, cpus=router_cpus, name=f"narwhal-ttft-{lay}-w{n}")
                things.append(r.proc)
                routers[n] = r
            roots = [tk.proc.pid, *(x.proc.pid for x in routers.values())]
            for r in routers.values():  # warm-up: connections (every worker), caches, the sizer
                phase(r.url, {}, "1", fixed_rate(100, 3.0, output_tokens=output_tokens, seed=99), shape)
            phase(tk.url, {}, "1", fixed_rate(100, 1.0, output_tokens=output_tokens, seed=98), shape)
            for rd in range(rounds):
                missed = dict.fromkeys(workers, 0)
                for rate in rates:
                    active = [n for n in workers if missed[n] < misses]
                    if not active:
                        break
                    for attempt in range(retries + 1):
                        _check()
                        quiet = await_quiet([q for x in roots for q in tree_pids(x)])
                        arr = fixed_rate(rate, duration_s, output_tokens=output_tokens, seed=1000 * rd + int(rate))
                        oth = Others(roots)
                        d = summarize(phase(tk.url, {}, "1", arr, shape, drain_s=10.0))
                        d_others = oth.cores()
                        pts = []
                        for n in (active if rd % 2 == 0 else list(reversed(active))):
                            _check()
                            r = routers[n]
                            c0 = sum(tree_cpu(r.proc.pid).values())
                            t0 = time.perf_counter()
                            oth = Others(roots)
                            s = summarize(phase(r.url, {}, "1", arr, shape, drain_s=10.0))
                            others = oth.cores()
                            wall = time.perf_counter() - t0
                            cpu = sum(tree_cpu(r.proc.pid).values()) - c0
                            add50, add99 = _added(s, d, "p50"), _added(s, d, "p99")
                            ok = add99 is not None and add99 * 1000.0 <= limit_ms and s["ok"] == s["offered"]
                            pt = {"layout": lay, "round": rd, "rate": rate, "workers": n, "attempt": attempt, "offered": s["offered"], "ok": s["ok"], "refused": s["refused"],
                                  "errors": s["errors"], "direct_p50": d["ttft"]["p50"], "direct_p99": d["ttft"]["p99"], "routed_p50": s["ttft"]["p50"],
                                  "routed_p99": s["ttft"]["p99"], "added_p50": add50, "added_p99": add99, "router_cores": cpu / wall,
                                  "cpu_ms_per_request": cpu / max(1, s["ok"]) * 1000.0, "send_lag_p99": s["send_lag"]["p99"], "direct_send_lag_p99": d["send_lag"]["p99"],
                                  "passes": ok, "at": time.strftime("%H:%M:%S", time.gmtime()), "quiet": quiet, "others_cores": max(others, d_others)}
                            pts.append(pt)
                            print(f"  ttft {lay} round {rd + 1} {rate:g}/s workers={n}: added p50 {fmt_ms(add50)} p99 {fmt_ms(add99)} ms, ok {s['ok']}/{s['offered']}, "
                                  f"router {pt['router_cores']:.2f} cores, send lag p99 {fmt_ms(pt['send_lag_p99'])} ms, others {pt['others_cores']:.2f} cores"
                                  f"{'' if ok else '  <- miss'}", flush=True)
                        busy = max(p["others_cores"] for p in pts) > RETRY_OTHERS and attempt < retries
                        for p in pts:
                            p["superseded"] = busy
                        points.extend(pts)
                        if not busy:
                            break
                        print(f"  ttft {lay} round {rd + 1} {rate:g}/s: busy machine, again", flush=True)
                    for p in pts:
                        missed[p["workers"]] = 0 if p["passes"] else missed[p["workers"]] + 1
        finally:
            for p in reversed(things):
                with contextlib.suppress(Exception):
                    p.stop()
    _ttft_report(rep, points, rates=rates, duration_s=duration_s, rounds=rounds, limit_ms=limit_ms, output_tokens=output_tokens, tpot_ms=tpot_ms, workers=workers,
                 layouts=layouts, misses=misses, retries=retries, rcpu=rcpu, lcpu=lcpu)
    return rep


def _ttft_report(rep: Report, points: list[dict[str, Any]], *, rates: Sequence[float], duration_s: float, rounds: int, limit_ms: float, output_tokens: int,
                 tpot_ms: float, workers: Sequence[int], layouts: Sequence[str], misses: int, retries: int, rcpu: set[int] | None, lcpu: set[int] | None) -> None:
    """ttft_split's data and tables: every point, and per layout and worker count the
    highest rate before the first miss in each round."""
    best: dict[str, dict[int, list[float | None]]] = {}
    for lay in layouts:
        for n in workers:
            for rd in range(rounds):
                pts = sorted((p for p in points if p["layout"] == lay and p["workers"] == n and p["round"] == rd and not p["superseded"]), key=lambda p: p["rate"])
                top = None
                for p in pts:  # the highest rate before the first miss
                    if not p["passes"]:
                        break
                    top = p["rate"]
                best.setdefault(lay, {}).setdefault(n, []).append(top)
    rep.data["ttft"] = {"rates": list(rates), "duration_s": duration_s, "rounds": rounds, "limit_ms": limit_ms, "output_tokens": output_tokens, "tpot_ms": tpot_ms,
                        "points": points, "best": best, "prefill_slots": PREFILL_SLOTS,
                        "layouts": {"pinned": f"every router process on CPU {sorted(rcpu or ())}; load tool and ticker on CPU {sorted(lcpu or ())}",
                                    "spread": f"router processes unpinned (any CPU); load tool and ticker on CPU {sorted(lcpu or ())}"}}
    rep.add(f"**Sustained streaming rate at router-added TTFT p99 ≤ {limit_ms:g} ms**: open-loop Poisson arrivals, {duration_s:g} s per point, streaming chat, prompt 64 tokens, "
            f"{output_tokens} output tokens {tpot_ms:g} ms apart from the ticker (prefill 0 ms), admission mode open; at each rate the same arrivals go direct to the "
            f"ticker, then through each router (both routers run throughout); added = routed minus direct percentile. A point passes when added p99 ≤ {limit_ms:g} ms and "
            f"every request completed; a worker count stops after {misses} misses in a row; a rate measured while other processes kept > {RETRY_OTHERS:g} core busy is "
            f"measured again (at most {retries} times). Layouts: " + "; ".join(f"*{k}*: {v}" for k, v in rep.data["ttft"]["layouts"].items() if k in layouts) + ".")
    rows = [[p["layout"], p["round"] + 1, f"{p['rate']:g}" + (" (busy, repeated)" if p["superseded"] else ""), p["workers"], f"{p['ok']}/{p['offered']}",
             fmt_ms(p["direct_p50"]), fmt_ms(p["direct_p99"]), fmt_ms(p["added_p50"]), fmt_ms(p["added_p99"]), f"{p['router_cores']:.2f}", f"{p['cpu_ms_per_request']:.2f}",
             fmt_ms(p["send_lag_p99"]), f"{p['others_cores']:.2f}", "yes" if p["passes"] else "**no**"] for p in points]
    rep.add(markdown_table(["layout", "round", "req/s", "workers", "ok/offered", "direct TTFT p50", "direct p99", "added p50", "**added p99**", "router cores busy",
                            "router CPU ms / request", "send lag p99", "others' cores busy", "passes"], rows))
    srows = [[lay, n, ", ".join("—" if b is None else f"{b:g}" for b in best[lay][n])] for lay in layouts for n in workers]
    rep.add(markdown_table(["layout", "workers", "highest req/s before the first miss, per round"], srows))


# -- the command -----------------------------------------------------------------------------


PARTS = ("decisions", "saturation", "relay", "ttft")


def split(*, parts: Sequence[str] = PARTS, out: Path | None = None, **kw: Any) -> Report:
    global _quiet_wait_s
    _quiet_wait_s = float(kw.get("quiet_wait", 60.0))
    _layout()
    signal.signal(signal.SIGTERM, _on_sigterm)
    rep = Report("split: one authority, N workers")

    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], capture_output=True, text=True, cwd=H.REPO, timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return "?"

    # NARWHAL_BENCH_COMMIT: the commit of a snapshot this runs from (`git archive`), so
    # that other engineers' edits to the working tree cannot change the code mid-run
    head = os.environ.get("NARWHAL_BENCH_COMMIT") or git("rev-parse", "--short", "HEAD")
    dirty = "" if os.environ.get("NARWHAL_BENCH_COMMIT") else git("status", "--short", "--", "narwhal")
    rep.data["meta"] = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "commit": head, "narwhal_uncommitted": dirty.splitlines(), "argv": sys.argv,
                        "loadavg": os.getloadavg(), "cpus": sorted(os.sched_getaffinity(0)), "quiet_wait_s": _quiet_wait_s}
    rep.add(f"Run at {rep.data['meta']['date_utc']} UTC, commit {head}" + (f" with uncommitted changes to {len(dirty.splitlines())} file(s) under narwhal/" if dirty else "")
            + f", load average {os.getloadavg()[0]:.2f}. Before each measurement the run waited (at most {_quiet_wait_s:g} s) for the rest of the machine to keep "
            f"less than {QUIET_CORES:g} core busy.")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown part(s) {', '.join(unknown)} (known: {', '.join(PARTS)})")
    if "decisions" in parts:
        decisions(rate=kw.get("rate", 2000.0), warm_s=kw.get("warm", 2.0), window_s=kw.get("window", 10.0), engines=kw.get("engines", 4), mode=kw.get("mode", "predictive"),
                  cycle=kw.get("cycle", "full"), repeats=kw.get("repeats", 2), rep=rep)
    if "saturation" in parts:
        saturation(rates=kw.get("sat_rates") or (2000, 3000, 4000, 5000, 6000, 8000, 10000, 12000, 14000, 16000, 20000), window_s=kw.get("sat_window", 5.0),
                   engines=kw.get("engines", 4), mode=kw.get("mode", "predictive"), cycle=kw.get("cycle", "full"), clients=kw.get("clients", 1), rep=rep)
    if "relay" in parts:
        relay_split(streams=kw.get("streams", 200), interval_ms=kw.get("interval_ms", 20.0), window_s=kw.get("relay_window", 15.0), alternations=kw.get("alternations", 2), rep=rep)
    if "ttft" in parts:
        ttft_split(rates=kw.get("ttft_rates") or (50, 100, 150, 200, 300, 400, 600), duration_s=kw.get("ttft_duration", 8.0), rounds=kw.get("ttft_rounds", 2),
                   layouts=kw.get("layouts") or ("pinned", "spread"), rep=rep)
    rep.save(out)
    return rep


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "client":
        sys.exit(client_main(sys.argv[2:]))
    print("usage: narwhal bench split [...]  (python -m narwhal_bench.split client ... is the benchmark's own client process)", file=sys.stderr)
    sys.exit(2)
