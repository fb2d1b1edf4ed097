"""The retention-bound arms of `narwhal bench tenants` (issue 40 item 6): tenants configured
with weights only, the global HTTP retention (admission.http_retention_limit, R02) the
binding limit, one engine, a quiet tenant beside a noisy one.

    narwhal bench tenants --arms retention-alone,retention [--retention-duration 25] [--rounds 3]
                          [--fair-reserve F] [--tree PATH] [--quick]

The run
  * One unified mock vLLM engine (`narwhal mock-engine --prefill-base-ms 40
    --tpot-base-ms 5`, its other timing defaults), engines[].max_concurrency
    `--max-concurrency` (2): about 25 requests/s of 100 prompt and 8 output tokens
    (`--retention-output-tokens`),
    streaming chat completions, Poisson arrivals (seeded: every round replays the same).
  * Narwhal: `narwhal serve`, admission open, `http_retention_limit` `--retention-limit`
    (24), queue_limit 1024 (so R02 binds, not R11), `tenants: {quiet: {weight: 1}, noisy:
    {weight: 1}}` with their API keys; admission.fair_reserve `--fair-reserve` (unset: the
    router's default). `--tree PATH` runs the `narwhal` package of another source tree (a
    git worktree of another commit: before and after).
  * Arms: `retention-alone` the quiet tenant's arrivals only (`--quiet-rps`, 4/s);
    `retention` the quiet and the noisy tenant's (`--noisy-rps`, 40/s). A fresh router per
    arm, the engine idle before each; `--rounds` times over, alone then shared.

Reported per round and as the median (min-max) over rounds: quiet answered / offered,
quiet TTFT p50 and p99 (of its 200s, first byte sent to first token), shared p99 / the
same round's alone p99, the noisy tenant's answers and refusals by status and code.
Targets: quiet answered >= 95%, quiet TTFT p99 <= 1.5x alone.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path
from typing import Any

from . import harness as H
from .harness.client import make_client
from .harness.load import Arrival, RequestShape, fixed_rate, run_loop, run_open_loop
from .harness.options import opt
from .harness.stats import Result, fmt_ms, markdown_table
from .tenants_books import KEYS, keys_file, narwhal_books, tenant_summary

__all__ = ["ARMS", "OPTIONS", "defaults", "retention_bound", "summarise", "tables"]

MODEL = "narwhal-demo"
ARMS = ("retention-alone", "retention")
TIMING = {"prefill_base_ms": 40, "tpot_base_ms": 5}
PROMPT_TOKENS = 100
TARGET_ANSWERED, TARGET_RATIO = 0.95, 1.5

OPTIONS = (
    opt("--retention-duration", type=float, default=None, help="retention arms: seconds of arrivals per arm (default 25; --quick 3)"),
    opt("--retention-limit", type=int, default=24, help="retention arms: admission.http_retention_limit, the binding limit (default 24)"),
    opt("--retention-output-tokens", type=int, default=8, help="retention arms: output tokens per request (default 8; longer ones: what fair preemption is for)"),
    opt("--quiet-rps", type=float, default=4.0, help="retention arms: the quiet tenant's rate (default 4)"),
    opt("--noisy-rps", type=float, default=40.0, help="retention arms: the noisy tenant's rate (default 40)"),
    opt("--max-concurrency", type=int, default=2, help="retention arms: the engine's engines[].max_concurrency (default 2; 0: unset)"),
    opt("--fair-reserve", type=float, default=None, help="retention arms: admission.fair_reserve (default: the router's own)"),
    opt("--migration", type=int, default=None, help="retention arms: upstream.migration.max_attempts (default: the router's own, 0); fair preemption needs > 0"),
    opt("--fair-preempt", choices=("on", "off"), default=None, help="retention arms: admission.fair_preempt (default: the router's own)"),
    opt("--rounds", type=int, default=1, help="retention arms: rounds of alone-then-shared (default 1): median and spread"),
    opt("--tree", default=None, help="retention arms: run the narwhal package of this source tree (a git worktree of another commit)"),
)


def defaults(args: argparse.Namespace) -> None:
    if args.retention_duration is None:
        args.retention_duration = 3.0 if args.quick else 25.0
    if args.quick:
        args.rounds = 1


def _config(engine: H.Engine, args: argparse.Namespace) -> dict[str, Any]:
    adm: dict[str, Any] = {"mode": "open", "prediction": {"profile_on_start": False}, "http_retention_limit": args.retention_limit, "queue_limit": 1024}
    if args.fair_reserve is not None:
        adm["fair_reserve"] = args.fair_reserve
    if args.fair_preempt is not None:
        adm["fair_preempt"] = args.fair_preempt == "on"
    cfg = H.narwhal_config([engine], model=MODEL, admission=adm, monitoring={"poll_interval_ms": 500})
    if args.migration is not None:
        cfg.setdefault("upstream", {})["migration"] = {"max_attempts": args.migration}
    cfg["admission"].pop("phase_concurrency")  # the router's defaults: max_concurrency caps them
    cfg["engines"][0]["max_concurrency"] = args.max_concurrency or None
    cfg["auth"] = {"keys_file": str(keys_file())}
    cfg["tenants"] = {t: {"weight": 1} for t in KEYS}
    return cfg


async def _drive(url: str, loads: dict[str, list[Arrival]], timeout_s: float, drain_s: float) -> dict[str, list[Result]]:
    clients = {t: make_client(url, "1") for t in loads}
    try:
        shapes = {t: RequestShape(model=MODEL, stream=True, headers={"authorization": f"Bearer {KEYS[t]}"}) for t in loads}
        outs = await asyncio.gather(*(run_open_loop(clients[t], loads[t], shapes[t], timeout_s=timeout_s, drain_s=drain_s) for t in loads))
        return dict(zip(loads, outs, strict=True))
    finally:
        for c in clients.values():
            await c.aclose()


def _arm(name: str, rnd: int, engine: H.Engine, loads: dict[str, list[Arrival]], args: argparse.Namespace, cpus: set[int] | None) -> dict[str, Any]:
    cfg = _config(engine, args)
    st = H.start_narwhal(cfg, cpus=cpus, name=f"narwhal-{name}", tree=Path(args.tree) if args.tree else None)
    try:
        res = run_loop(_drive(st.url, loads, timeout_s=args.retention_duration + args.drain + 10, drain_s=args.drain))
        books = narwhal_books(st.url)
    finally:
        st.stop()
    return {"arm": name, "round": rnd, "tenants": {t: tenant_summary(r, 1.0) for t, r in res.items()}, "books": books}


def retention_bound(args: argparse.Namespace, arms: list[str], rcpu: set[int] | None, lcpu: set[int] | None) -> dict[str, Any]:
    """Every round of the retention arms asked for, and their summary."""
    defaults(args)
    loads_both = {
        "quiet": fixed_rate(args.quiet_rps, args.retention_duration, prompt_tokens=PROMPT_TOKENS, output_tokens=args.retention_output_tokens, seed=args.seed),
        "noisy": fixed_rate(args.noisy_rps, args.retention_duration, prompt_tokens=PROMPT_TOKENS, output_tokens=args.retention_output_tokens, seed=args.seed + 1),
    }
    data: dict[str, Any] = {
        "timing": TIMING, "prompt_tokens": PROMPT_TOKENS, "output_tokens": args.retention_output_tokens, "duration_s": args.retention_duration,
        "retention_limit": args.retention_limit, "max_concurrency": args.max_concurrency or None, "fair_reserve": args.fair_reserve,
        "migration": args.migration, "fair_preempt": args.fair_preempt,
        "rates": {"quiet": args.quiet_rps, "noisy": args.noisy_rps}, "offered": {t: len(a) for t, a in loads_both.items()},
        "tree": args.tree or "this tree", "rounds": [],
    }
    with H.stopping() as things:
        engine = H.mock_engine("r0", cpus=lcpu, model=MODEL, timing=dict(TIMING), output_tokens=args.retention_output_tokens)
        things.append(engine)
        for rnd in range(args.rounds):
            for name in arms:
                if not H.engines_idle([engine], 20.0):
                    raise RuntimeError(f"the engine is still busy before {name} (round {rnd + 1})")
                loads = {"quiet": loads_both["quiet"]} if name.endswith("-alone") else loads_both
                a = _arm(name, rnd + 1, engine, loads, args, rcpu)
                data["rounds"].append(a)
                q = a["tenants"]["quiet"]
                nz = a["tenants"].get("noisy")
                print(f"  {name} (round {rnd + 1}): quiet {q['ok']}/{q['offered']} TTFT p50/p99 {fmt_ms(q['ttft_p50'], 0)}/{fmt_ms(q['ttft_p99'], 0)} ms"
                      + (f"; noisy ok {nz['ok']} refused {nz['refused']}" if nz else "") + f"; preempted {a['books'].get('preemptions', 0)}, carried on {a['books'].get('migrations', 0)}; books balanced {a['books']['balanced']}", flush=True)
    data["summary"] = summarise(data["rounds"])
    return data


def _spread(xs: list[float]) -> dict[str, float] | None:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)} if xs else None


def summarise(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Median (min-max) over rounds, per arm, and the shared p99 over the same round's alone."""
    out: dict[str, Any] = {}
    by_round: dict[int, dict[str, Any]] = {}
    for a in rounds:
        by_round.setdefault(a["round"], {})[a["arm"]] = a
        q = a["tenants"]["quiet"]
        s = out.setdefault(a["arm"], {"answered": [], "p50": [], "p99": [], "noisy_ok": [], "noisy_refused": []})
        s["answered"].append(q["ok"] / q["offered"] if q["offered"] else 0.0)
        for k, src in (("p50", "ttft_p50"), ("p99", "ttft_p99")):
            if q[src] is not None:
                s[k].append(q[src] * 1000.0)
        if "noisy" in a["tenants"]:
            s["noisy_ok"].append(a["tenants"]["noisy"]["ok"])
            s["noisy_refused"].append(a["tenants"]["noisy"]["refused"])
    ratios = [r["retention"]["tenants"]["quiet"]["ttft_p99"] / r["retention-alone"]["tenants"]["quiet"]["ttft_p99"]
              for r in by_round.values() if "retention" in r and "retention-alone" in r
              and r["retention"]["tenants"]["quiet"]["ttft_p99"] and r["retention-alone"]["tenants"]["quiet"]["ttft_p99"]]
    summary: dict[str, Any] = {arm: {k: _spread(v) for k, v in s.items()} for arm, s in out.items()}
    summary["p99_vs_alone"] = _spread(ratios)
    shared = summary.get("retention")
    if shared is not None:
        ratio = summary["p99_vs_alone"]
        summary["verdict"] = {
            "answered_ok": shared["answered"] is not None and shared["answered"]["median"] >= TARGET_ANSWERED,
            "p99_ok": ratio is not None and ratio["median"] <= TARGET_RATIO,
        }
    return summary


def _cell(s: dict[str, float] | None, fmt: str, scale: float = 1.0) -> str:
    if s is None:
        return "—"
    med, lo, hi = (s[k] * scale for k in ("median", "min", "max"))
    return format(med, fmt) if s["n"] == 1 else f"{format(med, fmt)} ({format(lo, fmt)}–{format(hi, fmt)})"


def tables(data: dict[str, Any]) -> str:
    fr = "the router's default" if data["fair_reserve"] is None else f"{data['fair_reserve']:g}"
    lines = [
        f"Retention-bound: one unified mock vLLM engine (prefill base {data['timing']['prefill_base_ms']} ms, TPOT base {data['timing']['tpot_base_ms']} ms), "
        f"max_concurrency {data['max_concurrency']}, {data['prompt_tokens']} prompt and {data['output_tokens']} output tokens, streaming; "
        f"http_retention_limit {data['retention_limit']} (R02 binds), queue_limit 1024, admission.fair_reserve {fr}, "
        f"fair_preempt {data.get('fair_preempt') or 'default'}, upstream.migration.max_attempts {data.get('migration') if data.get('migration') is not None else 'default'}; "
        f"quiet {data['rates']['quiet']:g}/s ({data['offered']['quiet']} requests), noisy {data['rates']['noisy']:g}/s ({data['offered']['noisy']}), "
        f"Poisson, {data['duration_s']:g} s per arm; router: {data['tree']}.",
        "",
    ]
    rows = []
    for a in data["rounds"]:
        q, nz = a["tenants"]["quiet"], a["tenants"].get("noisy")
        ref = ", ".join(f"{k} ×{v}" for k, v in nz["refusals"].items()) if nz and nz["refusals"] else "—"
        rows.append([a["arm"], a["round"], f"{q['ok']}/{q['offered']}", fmt_ms(q["ttft_p50"], 0), fmt_ms(q["ttft_p99"], 0),
                     f"{nz['ok']}/{nz['offered']}" if nz else "", ref, a["books"].get("preemptions", 0), "yes" if a["books"]["balanced"] else "NO"])
    lines.append(markdown_table(["arm", "round", "quiet 200", "quiet TTFT p50 ms", "quiet TTFT p99 ms", "noisy 200", "noisy refused (status code)", "preempted",
                                 "books balanced"], rows))
    sm = data["summary"]
    srows = []
    for arm in ARMS:
        if arm in sm:
            s = sm[arm]
            srows.append([arm, _cell(s["answered"], ".1f", 100.0) + " %", _cell(s["p50"], ".0f"), _cell(s["p99"], ".0f"),
                          _cell(sm["p99_vs_alone"], ".2f") if arm == "retention" else "1", _cell(s["noisy_ok"], ".0f") if s["noisy_ok"] else ""])
    lines += ["", "Median (min–max) over rounds", "",
              markdown_table(["arm", "quiet answered", "quiet TTFT p50 ms", "quiet TTFT p99 ms", "p99 vs alone (same round)", "noisy 200"], srows)]
    v = sm.get("verdict")
    if v:
        lines += ["", f"Targets: quiet answered ≥ {TARGET_ANSWERED:.0%} {'✓' if v['answered_ok'] else '✗'}; "
                      f"quiet TTFT p99 ≤ {TARGET_RATIO:g}× alone {'✓' if v['p99_ok'] else '✗'} (medians)."]
    return "\n".join(lines)
