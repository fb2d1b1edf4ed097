"""`narwhal bench prefix-model` (also `python -m narwhal_bench.prefix_model`): what ANY
placement rule could get out of the prefix bench's workload, from a queueing model of it
(seconds to run, no processes). It bounds the targets of `narwhal bench prefix`: a
rule the model cannot make reach a target on this trace will not reach it on the mocks.

The model (the mocks' rules, narwhal/mock/cache.py and the bench's timing)
  * The same requests as `narwhal bench prefix` (prefix.select / prefix.scale, the same
    arguments), arriving at their replay times.
  * N engines, each FCFS one prefill at a time; a prefill of u uncached tokens takes
    T(u) = base + per_token u + quadratic u^2 ms, times lognormal noise (sigma), seeded.
    TTFT = wait + prefill (decode and the router's own time are left out).
  * Each engine caches whole trace blocks (tokens_per_block tokens) with LRU eviction of
    cache_tokens / tokens_per_block blocks; a request's prompt is its leading hash IDs
    and finds the longest cached run of them (at most n - 1 tokens); its blocks are
    stored when it is placed. The prompt carries the mock's 3 template tokens.
  * Routers know every engine's cache and backlog exactly (an upper bound on any index).
    Admission (R10 as Narwhal: refuse when the chosen engine's projected TTFT exceeds the
    budget) is on for Narwhal's rules, off for vllm-router's.

Rules
  blind       lowest backlog + T(n) (prefix_cache off)
  ttft        lowest backlog + T(n - cached) (the projected TTFT alone: Narwhal before e918bce)
  cost        ttft - (T(n) - T(n - cached)) x (1 + the mean depth per engine): Narwhal's
              placement cost (refusals.yaml R10 note)
  affinity    vllm-router cache_aware: the engine with the longest match when it covers
              > 30 % of the prompt and the engines' loads differ by at most 64 requests,
              else the least loaded (no admission)
  oracle      cost with an unbounded cache on every engine (the trace's reuse ceiling)

Validated against the measured arms of docs/performance.md (hit rate within 0.01, TTFT
p50 within 5 %, goodput within 0.01 at rho 1.21); the model's TTFT p90 runs higher than
the mocks' by up to 15 %.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from narwhal.mock.timing import Timing

from . import prefix as P
from . import prefix_workload as W
from .harness import options as O
from .harness.options import opt

__all__ = ["RULES", "BENCH_TIMING", "simulate", "add_arguments", "run", "main"]

RULES = ("blind", "ttft", "cost", "affinity", "oracle")
TEMPLATE_TOKENS = 3  # the mock's chat template tokens around one user message


# the bench's mock timing (narwhal bench prefix defaults: --prefill-*-ms, --noise-sigma)
BENCH_TIMING = Timing(prefill_base_ms=10.0, prefill_per_token_ms=0.4, prefill_quadratic_ms=0.00002, noise_sigma=0.1)


class _Lru:
    """Whole blocks by hash ID, least recent evicted first (a prompt's blocks are touched
    last to first, so a parent outlives its children, as in the mock)."""

    def __init__(self, blocks: int | None) -> None:
        self.cap = blocks
        self.d: OrderedDict[int, None] = OrderedDict()

    def match(self, hs: Sequence[int]) -> int:
        k = 0
        for h in hs:
            if h not in self.d:
                break
            k += 1
        return k

    def insert(self, hs: Sequence[int]) -> None:
        for h in reversed(hs):
            self.d[h] = None
            self.d.move_to_end(h)
        if self.cap is not None:
            while len(self.d) > self.cap:
                self.d.popitem(last=False)


def _q(xs: list[float], p: float) -> float:
    return xs[min(len(xs) - 1, int(p * len(xs)))] if xs else 0.0


def simulate(reqs: Sequence[W.TraceRequest], rule: str, *, engines: int = 4, cache_tokens: int = 65536, tokens_per_block: int = 64,
             budget_ms: float = 3000.0, timing: Timing = BENCH_TIMING, seed: int = 7) -> dict[str, Any]:
    """One rule over the requests: hit rate, TTFT p50/p90/p99 ms, goodput, refusals,
    follow-ups on their conversation's last engine."""
    if rule not in RULES:
        raise ValueError(f"unknown rule {rule!r}")
    rnd = random.Random(seed)
    bpt = tokens_per_block
    caches = [_Lru(None if rule == "oracle" else cache_tokens // bpt) for _ in range(engines)]
    free_at = [0.0] * engines  # ms: when each engine's FCFS queue drains
    ends: list[list[float]] = [[] for _ in range(engines)]  # prefill ends of requests there
    admit = rule != "affinity"
    hit = tot = refused = good = 0
    ttfts: list[float] = []
    last: dict[tuple[int, ...], int] = {}
    same = follow = 0
    for r in sorted(reqs, key=lambda x: x.at):
        now = r.at * 1000.0
        n = r.prompt_tokens + TEMPLATE_TOKENS
        hs = r.hash_ids[: min(len(r.hash_ids), n // bpt)]
        opts = []
        for e in range(engines):
            c = min(n - 1, caches[e].match(hs) * bpt)
            opts.append((max(0.0, free_at[e] - now), timing.prefill_ms(n - c), c, e))
        if rule == "blind":
            full = timing.prefill_ms(n)
            ch = min(opts, key=lambda o: o[0] + full)
        elif rule == "ttft":
            ch = min(opts, key=lambda o: o[0] + o[1])
        elif rule in ("cost", "oracle"):
            behind = 1.0 + sum(sum(1 for f in ends[x] if f > now) for x in range(engines)) / engines
            full = timing.prefill_ms(n)
            ch = min(opts, key=lambda o: o[0] + o[1] - (full - o[1]) * behind)
        else:  # affinity: vllm-router cache_aware (threshold 0.3, balance 64 requests)
            loads = [sum(1 for f in ends[x] if f > now) for x in range(engines)]
            best = max(opts, key=lambda o: o[2])
            ch = best if best[2] / n > 0.3 and max(loads) - min(loads) <= 64 else min(opts, key=lambda o: loads[o[3]])
        back, pf, c, e = ch
        proj = back + (timing.prefill_ms(n) if rule == "blind" else pf)
        key = r.hash_ids[:2]
        if len(r.hash_ids) >= 2 and key in last:
            follow += 1
            same += last[key] == e
        if admit and proj > budget_ms:
            refused += 1
            continue
        if len(r.hash_ids) >= 2:
            last[key] = e
        start = max(now, free_at[e])
        free_at[e] = start + pf * math.exp(rnd.gauss(0.0, timing.noise_sigma))
        ends[e] = [f for f in ends[e] if f > now] + [free_at[e]]
        caches[e].insert(hs)
        hit += c
        tot += n
        t = free_at[e] - now
        ttfts.append(t)
        good += t <= budget_ms
    ttfts.sort()
    return {"rule": rule, "hit_rate": hit / tot if tot else 0.0, "p50": _q(ttfts, 0.5), "p90": _q(ttfts, 0.9), "p99": _q(ttfts, 0.99),
            "goodput": good / len(reqs) if reqs else 0.0, "refused": refused, "same_engine": same / follow if follow else None}


OPTIONS = (
    opt("--durations", default="220,180,160,140,110", help="seconds the window is compressed onto, one load point each (prefix --duration)"),
    opt("--seeds", type=int, default=3, help="noise seeds per point (default 3)"),
)


add_arguments = O.adder(P.WORKLOAD, OPTIONS)


def run(args: argparse.Namespace) -> int:
    rows = W.select(W.load_mooncake(args.trace), start_s=args.start, window_s=args.window, sample=args.sample, seed=args.seed)
    print("| duration s (rho uncached) | rule | hit rate | TTFT p50 / p90 / p99 ms | goodput | refused | follow-ups on their engine | p90 blind / p90 rule |")
    print("|---|---|---|---|---|---|---|---|")
    tm = Timing(prefill_base_ms=args.prefill_base_ms, prefill_per_token_ms=args.prefill_per_token_ms, prefill_quadratic_ms=args.prefill_quadratic_ms,
                noise_sigma=args.noise_sigma)
    for d in [float(x) for x in args.durations.split(",") if x]:
        reqs = W.scale(rows, start_s=args.start, speedup=args.window / d, tokens_per_block=args.tokens_per_block, max_blocks=args.max_blocks,
                       output_scale=args.output_scale, max_output=args.max_output)
        rho = sum(tm.prefill_ms(r.prompt_tokens + TEMPLATE_TOKENS) for r in reqs) / 1000.0 / (args.engines * max(reqs[-1].at, 1e-9))
        res = {rule: [simulate(reqs, rule, engines=args.engines, cache_tokens=args.cache_tokens, tokens_per_block=args.tokens_per_block,
                               budget_ms=args.budget_ms, timing=tm, seed=7 + s) for s in range(args.seeds)] for rule in RULES}

        def mean(rule: str, k: str, res: dict[str, list[dict[str, Any]]] = res) -> float:
            return float(sum(x[k] for x in res[rule]) / len(res[rule]))

        for rule in RULES:
            same = [x["same_engine"] for x in res[rule] if x["same_engine"] is not None]
            print(f"| {d:.0f} ({rho:.2f}) | {rule} | {mean(rule, 'hit_rate'):.3f} | {mean(rule, 'p50'):,.0f} / {mean(rule, 'p90'):,.0f} / {mean(rule, 'p99'):,.0f} "
                  f"| {mean(rule, 'goodput'):.3f} | {mean(rule, 'refused'):.0f} | {sum(same) / len(same) if same else 0:.2f} "
                  f"| {mean('blind', 'p90') / max(mean(rule, 'p90'), 1e-9):.2f} |", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return O.main("narwhal_bench.prefix_model", "A queueing model of the prefix bench: what any placement rule could get.", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
