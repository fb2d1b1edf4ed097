"""`narwhal bench prefix` (also `python -m narwhal_bench.prefix`): prefix-cache-aware
placement, measured (issue 15 item 4). The Mooncake conversation trace replayed against a
fleet of caching mock engines, in front of which each arm's router runs in turn.

    python -m narwhal_bench.prefix [--arms narwhal-auto,narwhal-events,narwhal-off,vllm-cache-aware,vllm-round-robin]
        [--duration 140] [--start 600] [--window 1200] [--sample 0.35] [--tokens-per-block 64]
        [--max-blocks 32] [--cache-tokens 65536] [--budget-ms 3000] [--out DIR] [--img docs]
    python -m narwhal_bench.prefix --plot-load RUN1/prefix.json RUN2/prefix.json ... [--img docs]

Results and the reading: docs/performance.md, "Prefix cache (`narwhal bench prefix`)".

Workload (module rules, all pure functions below)
  * Trace: /work/shared/data/traces/mooncake_conversation.jsonl (timestamp ms,
    input_length, output_length, hash_ids: one ID per 512-token block; requests that
    share leading IDs share that prefix). Every request starts with ID 0 (a common
    system prompt); a conversation is the requests sharing hash_ids[:2].
  * Selection (`select`): the requests with timestamp in [start, start + window) s, and
    of those only the conversations whose hash_ids[1] passes a seeded coin of
    probability `sample` (all turns of a conversation are kept or dropped together, so
    the trace's reuse survives the subsampling).
  * Time: the window is compressed onto `duration` s (speed-up = window / duration);
    arrivals keep the trace's order and relative gaps.
  * Size: each 512-token block becomes `tokens_per_block` tokens; a prompt keeps at most
    `max_blocks` blocks (its first ones: the shared prefix survives the cap); its length
    is round(input_length x tokens_per_block / 512), capped at max_blocks x
    tokens_per_block. Outputs: round(output_length x output_scale), 1 .. max_output.
  * Text (`block_text`): each hash ID renders as one deterministic ASCII text of
    tokens_per_block x 4 bytes (the mock counts 4 bytes a token), the same every time;
    a prompt is one user message whose content is its blocks' texts concatenated and cut
    at its length (the last block partial), so shared hash prefixes are shared prompt
    prefixes, byte for byte and token for token.
  * Request: a streaming chat completion with stream_options.include_usage, max_tokens =
    the scaled output, and the TTFT budget as x-narwhal-ttft-target-ms (Narwhal reads it;
    the peers ignore it).

Arms (each in front of a FRESH fleet: the mocks are restarted so every cache starts cold)
  narwhal-auto       Narwhal predictive, admission.prediction.prefix_cache auto (the
                     mocks report cached_tokens, so the approximate index is trusted
                     after the first report)
  narwhal-events     Narwhal predictive, prefix_cache auto with engines[].kv_events (the
                     mocks publish vLLM KV events): the exact index
  narwhal-off        Narwhal predictive, prefix_cache off (cache-blind)
  vllm-cache-aware   vllm-router --policy cache_aware (its defaults)
  vllm-round-robin   vllm-router --policy round_robin

Per arm: the mocks' hit rate (sum cached_tokens / sum prompt_tokens over /mock/stats,
differences across the replay, so Narwhal's start-up profiling is not counted), TTFT
p50/p90/p99 of answered requests, goodput (share of OFFERED requests answered with TTFT
<= budget), refusals (429/503/504 before a token), errors, the requests each engine took,
and for Narwhal arms how often x-narwhal-expected-cached-tokens is within one block of the
engine's usage.prompt_tokens_details.cached_tokens (absent = 0 on the vllm dialect).
Every process is started here and stopped by its own process group; every wait is bounded.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from . import harness as H
from .harness import options as O
from .harness.client import SSERecorder, make_client
from .harness.load import open_loop, post, run_loop
from .harness.options import opt
from .harness.processes import Proc, free_port, layout, log_dir, pin_self, wait_http
from .harness.quiet import busy_cpu_s, quiet_wait
from .harness.report import commit
from .harness.stats import Result, fmt_ms, markdown_table, percentile, summarize
from .plots import prefix_load_plot, prefix_ttft_plot
from .prefix_workload import (
    APPROX_BLOCK_TOKENS,
    DEFAULT_TRACE,
    MOCK_BLOCK,
    TraceRequest,
    ideal_hit_rate,
    load_mooncake,
    request_body,
    scale,
    select,
)

__all__ = ["PrefixRecorder", "header_accuracy", "replay", "run_arm", "ARMS", "WORKLOAD", "add_workload_arguments", "add_arguments", "run", "main"]


ARMS: dict[str, str] = {
    "narwhal-auto": "Narwhal predictive, prefix_cache auto (approximate index)",
    "narwhal-events": "Narwhal predictive, prefix_cache auto + engines[].kv_events (exact index)",
    "narwhal-off": "Narwhal predictive, prefix_cache off (cache-blind)",
    "vllm-cache-aware": "vllm-router --policy cache_aware",
    "vllm-round-robin": "vllm-router --policy round_robin",
}

# -- the client -----------------------------------------------------------------------------


class PrefixRecorder(SSERecorder):
    """SSERecorder that also keeps Narwhal's x-narwhal-* headers and the usage chunk
    (prompt_tokens, prompt_tokens_details.cached_tokens: absent = 0 on the vllm dialect)."""

    def on_headers(self, status: int, headers: dict[bytes, bytes], now: float) -> None:
        super().on_headers(status, headers, now)
        for k, name in ((b"x-narwhal-expected-cached-tokens", "expected_cached"), (b"x-narwhal-projected-ttft-ms", "projected_ttft_ms")):
            v = headers.get(k)
            if v is not None:
                with contextlib.suppress(ValueError):
                    self.r.extra[name] = int(v)

    def _event(self, ev: bytes, now: float) -> None:
        super()._event(ev, now)
        if b'"usage"' not in ev:
            return
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            try:
                obj = orjson.loads(line[5:].strip())
            except orjson.JSONDecodeError:
                continue
            u = obj.get("usage") if isinstance(obj, dict) else None
            if isinstance(u, dict):
                self.r.extra["usage_prompt_tokens"] = u.get("prompt_tokens")
                d = u.get("prompt_tokens_details")
                c = d.get("cached_tokens") if isinstance(d, dict) else None
                self.r.extra["cached_tokens"] = int(c) if isinstance(c, int) else 0
                self.r.extra["cached_reported"] = isinstance(c, int)


async def _one(client: Any, body: bytes, headers: dict[str, str], scheduled: float, timeout_s: float, req: TraceRequest, out: list[Result]) -> None:
    r = Result(scheduled=scheduled, prompt_tokens=req.prompt_tokens, output_tokens=req.output_tokens)
    out.append(r)
    await post(client, "/v1/chat/completions", body, PrefixRecorder(r), headers=headers, timeout_s=timeout_s)


async def replay(url: str, reqs: Sequence[TraceRequest], bodies: Sequence[bytes], *, budget_ms: int, timeout_s: float, drain_s: float, headers: dict[str, str] | None = None) -> list[Result]:
    """Open loop: request i leaves at t0 + reqs[i].at; open requests drain_s after the last
    arrival are cut (errors)."""
    client = make_client(url, "1", headers=headers)
    hdr = {"x-narwhal-ttft-target-ms": str(budget_ms)}
    out: list[Result] = []
    if len(bodies) != len(reqs):
        raise ValueError(f"{len(reqs)} requests and {len(bodies)} bodies")
    try:
        await open_loop([r.at for r in reqs], lambda i, target: _one(client, bodies[i], hdr, target, timeout_s, reqs[i], out), drain_s=drain_s)
    finally:
        await client.aclose()
    return out


def header_accuracy(results: Sequence[Result]) -> dict[str, Any] | None:
    """x-narwhal-expected-cached-tokens against the engine's reported cached_tokens, over
    answered requests that carry both."""
    pairs = [(r.extra["expected_cached"], r.extra["cached_tokens"]) for r in results if r.ok and "expected_cached" in r.extra and "cached_tokens" in r.extra]
    if not pairs:
        return None
    n = len(pairs)
    diff = [e - c for e, c in pairs]
    return {
        "n": n,
        "within_engine_block": sum(1 for d in diff if abs(d) <= MOCK_BLOCK) / n,  # 16 tokens
        "within_index_block": sum(1 for d in diff if abs(d) <= APPROX_BLOCK_TOKENS) / n,  # 64 tokens
        "exact_zero_both": sum(1 for e, c in pairs if e == 0 and c == 0) / n,
        "over": sum(1 for d in diff if d > APPROX_BLOCK_TOKENS) / n,  # expected more than the engine had
        "under": sum(1 for d in diff if d < -APPROX_BLOCK_TOKENS) / n,
        "expected_sum": sum(e for e, _ in pairs),
        "reported_sum": sum(c for _, c in pairs),
        "abs_err_p50": percentile([abs(d) for d in diff], 50),
        "abs_err_p90": percentile([abs(d) for d in diff], 90),
    }


# -- the fleet and the routers --------------------------------------------------------------


@dataclass
class Fleet:
    engines: list[H.Engine]
    kv_endpoints: list[str]

    def stop(self) -> None:
        for e in reversed(self.engines):
            with contextlib.suppress(Exception):
                e.proc.stop()


def start_fleet(n: int, *, timing: dict[str, Any], cache_tokens: int, cpus: set[int] | None) -> Fleet:
    engines: list[H.Engine] = []
    eps: list[str] = []
    try:
        for i in range(n):
            ep = f"tcp://127.0.0.1:{free_port()}"
            flags = {**timing, "seed": i + 1, "prefix_cache_tokens": cache_tokens, "block_size": MOCK_BLOCK, "kv_events": ep}
            engines.append(H.mock_engine(f"u{i}", cpus=cpus, timing=flags, output_tokens=4096))
            eps.append(ep)
    except BaseException:
        Fleet(engines, eps).stop()
        raise
    return Fleet(engines, eps)


def _get_json(url: str) -> Any:
    import httpx

    return httpx.get(url, timeout=5, trust_env=False).json()


def mock_stats(fleet: Fleet) -> list[dict[str, Any]]:
    return [_get_json(e.url + "/mock/stats") for e in fleet.engines]


class Sampler:
    """Once a second during a replay: each mock's prefill queue and requests in flight,
    and (Narwhal) the router's /ready status: a timeline that shows stalls and
    not-ready spells. A daemon thread, stopped by `stop()` (bounded join)."""

    def __init__(self, fleet: Fleet, router_url: str | None, interval_s: float = 1.0) -> None:
        import threading

        self.fleet = fleet
        self.router_url = router_url
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._loop, name="prefix-sampler", daemon=True)
        self.t0 = 0.0

    def start(self) -> Sampler:
        self.t0 = time.monotonic()
        self._t.start()
        return self

    def _loop(self) -> None:
        import httpx

        with httpx.Client(timeout=2.0, trust_env=False) as c:
            while not self._stop.is_set():
                row: dict[str, Any] = {"t": round(time.monotonic() - self.t0, 2)}
                for e in self.fleet.engines:
                    try:
                        st = c.get(e.url + "/mock/stats").json()
                        row[e.name] = (st["prefill_queue"], st["in_flight"])
                    except Exception as ex:  # noqa: BLE001 - recorded as a failed poll
                        row[e.name] = type(ex).__name__
                if self.router_url:
                    try:
                        r = c.get(self.router_url + "/ready")
                        row["ready"] = r.status_code if r.status_code == 200 else f"{r.status_code} {r.text[:120]}"
                    except Exception as ex:  # noqa: BLE001
                        row["ready"] = type(ex).__name__
                self.rows.append(row)
                self._stop.wait(self.interval_s)

    def stop(self) -> list[dict[str, Any]]:
        self._stop.set()
        self._t.join(5.0)
        return self.rows


def _content_key(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=12).digest()


def placements(fleet: Fleet) -> dict[bytes, tuple[str, int | None]]:
    """Which engine served each prompt (the mocks' request records, keyed by the user
    message) and the cached tokens it found: (engine, cached_tokens)."""
    out: dict[bytes, tuple[str, int | None]] = {}
    for e in fleet.engines:
        for rec in _get_json(e.url + "/mock/requests"):
            body = rec.get("body")
            if not isinstance(body, dict):
                continue
            msgs = body.get("messages") or []
            if len(msgs) != 1 or not isinstance(msgs[0].get("content"), str):
                continue
            pf = rec.get("prefill") or {}
            out[_content_key(msgs[0]["content"])] = (e.name, pf.get("cached_tokens"))
    return out


def affinity(reqs: Sequence[TraceRequest], engines: Sequence[str | None]) -> dict[str, Any]:
    """Follow-up requests (sharing at least two leading trace blocks with an earlier one):
    the share placed on the engine of the latest earlier request with the longest shared
    prefix (where its blocks were last computed)."""
    last: dict[tuple[int, ...], str] = {}
    follow = same = 0
    for r, e in sorted(zip(reqs, engines, strict=True), key=lambda x: x[0].at):
        prev = None
        for k in range(len(r.hash_ids), 1, -1):
            prev = last.get(r.hash_ids[:k])
            if prev is not None:
                break
        if prev is not None and e is not None:
            follow += 1
            same += e == prev
        if e is not None:
            for k in range(2, len(r.hash_ids) + 1):
                last[r.hash_ids[:k]] = e
    return {"follow_ups": follow, "same_engine": same / follow if follow else None}


def narwhal_arm_config(fleet: Fleet, arm: str, *, budget_ms: int, cache_tokens: int) -> dict[str, Any]:
    mode = "off" if arm == "narwhal-off" else "auto"
    cfg = H.narwhal_config(fleet.engines, admission={"mode": "predictive", "ttft_budget_ms": budget_ms,
                                                     "prediction": {"prefix_cache": mode, "prefix_cache_tokens": cache_tokens}})
    if arm == "narwhal-events":
        for e, ep in zip(cfg["engines"], fleet.kv_endpoints, strict=True):
            e["kv_events"] = ep
            e["kv_block_size"] = MOCK_BLOCK
    return cfg


def start_vllm_router(fleet: Fleet, policy: str, *, cpus: set[int] | None, timeout_s: float = 60.0) -> H.Started:
    exe = H.peers_dir() / "vllm-router" / "bin" / "vllm-router"
    if not exe.exists():
        raise H.PeerUnavailable(f"vllm-router is not installed ({exe} missing): run scripts/peers/install.sh vllm-router")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [str(exe), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", "--disable-retries", "--log-dir", str(log_dir() / "vllm-router-logs"),
            "--worker-urls", *[e.url for e in fleet.engines], "--policy", policy]
    p = Proc(f"vllm-router-{policy}", argv, cpus=cpus).start()
    try:
        wait_http(url + "/health", proc=p, timeout_s=timeout_s)
    except (TimeoutError, RuntimeError) as e:
        p.stop()
        raise H.PeerUnavailable(f"vllm-router did not start: {e}") from None
    return H.Started("vllm-router", url, p, notes=f"vllm-router {H._version('vllm-router', 'vllm-router')} (Rust), --policy {policy}")


def start_arm(arm: str, fleet: Fleet, *, budget_ms: int, cache_tokens: int, cpus: set[int] | None) -> tuple[H.Started, dict[str, Any] | None]:
    if arm.startswith("narwhal"):
        cfg = narwhal_arm_config(fleet, arm, budget_ms=budget_ms, cache_tokens=cache_tokens)
        return H.start_narwhal(cfg, cpus=cpus, name=f"narwhal-prefix-{arm}"), cfg
    policy = {"vllm-cache-aware": "cache_aware", "vllm-round-robin": "round_robin"}[arm]
    return start_vllm_router(fleet, policy, cpus=cpus), None


# -- one arm --------------------------------------------------------------------------------


def _stats_delta(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    per = []
    for b, a in zip(before, after, strict=True):
        per.append({"name": a["name"], "requests": a["requests"] - b["requests"], "prompt_tokens": a["prompt_tokens"] - b["prompt_tokens"],
                    "cached_tokens": a["cached_tokens"] - b["cached_tokens"], "cancelled": a["cancelled"] - b["cancelled"],
                    "peak_in_flight": a["peak_in_flight"], "cache_blocks": (a.get("prefix_cache") or {}).get("blocks")})
    pt = sum(p["prompt_tokens"] for p in per)
    ct = sum(p["cached_tokens"] for p in per)
    reqs = [p["requests"] for p in per]
    mean = sum(reqs) / len(reqs) if reqs else 0.0
    return {"engines": per, "prompt_tokens": pt, "cached_tokens": ct, "hit_rate": ct / pt if pt else 0.0,
            "requests_max_over_mean": (max(reqs) / mean) if mean else None}


def run_arm(arm: str, reqs: Sequence[TraceRequest], bodies: Sequence[bytes], *, engines: int, timing: dict[str, Any], cache_tokens: int, budget_ms: int,
            drain_s: float, rcpu: set[int] | None, lcpu: set[int] | None) -> dict[str, Any]:
    fleet = start_fleet(engines, timing=timing, cache_tokens=cache_tokens, cpus=lcpu)
    router: H.Started | None = None
    try:
        router, cfg = start_arm(arm, fleet, budget_ms=budget_ms, cache_tokens=cache_tokens, cpus=rcpu)
        if not H.engines_idle(fleet.engines, 30.0):
            raise RuntimeError("engines busy after the router started")
        before = mock_stats(fleet)
        c0 = router.proc.cpu()
        m0 = [e.proc.cpu() for e in fleet.engines]
        me0 = _self_cpu()
        b0 = busy_cpu_s()
        t0 = time.time()
        sampler = Sampler(fleet, router.url if arm.startswith("narwhal") else None).start()
        try:
            res = run_loop(replay(router.url, reqs, bodies, budget_ms=budget_ms, timeout_s=reqs[-1].at + drain_s + 10.0, drain_s=drain_s, headers=router.headers))
        finally:
            timeline = sampler.stop()
        wall = time.time() - t0
        cpu = router.proc.cpu() - c0
        mock_cpu = [e.proc.cpu() - c for e, c in zip(fleet.engines, m0, strict=True)]
        # CPU the machine spent on processes other than this run's (other sessions' benchmarks)
        foreign = busy_cpu_s() - b0 - cpu - sum(mock_cpu) - (_self_cpu() - me0)
        idle = H.engines_idle(fleet.engines, 30.0)
        after = mock_stats(fleet)
        placed = placements(fleet)
        view = None
        if arm.startswith("narwhal"):
            with contextlib.suppress(Exception):
                view = [{"name": e["name"], "prefix_cache": e.get("prefix_cache")} for e in _get_json(router.url + "/v1/engines")["data"]]
    finally:
        if router is not None:
            router.stop()
        fleet.stop()
    s = summarize(res, ttft_target_s=budget_ms / 1000.0)
    keys = [_content_key(orjson.loads(b)["messages"][0]["content"]) for b in bodies]
    where = [placed.get(k, (None, None))[0] for k in keys]
    cached_client = [r.extra.get("cached_tokens", 0) for r in res if r.ok]
    prompt_client = [r.extra.get("usage_prompt_tokens") or 0 for r in res if r.ok]
    out = {
        "arm": arm, "label": ARMS[arm], "router": router.notes if router else "", "wall_s": wall, "router_cpu_s": cpu, "engines_idle_after": idle,
        "summary": s, "mocks": _stats_delta(before, after), "narwhal_engines": view,
        "client_hit_rate": (sum(cached_client) / sum(prompt_client)) if sum(prompt_client) else None,
        "header_accuracy": header_accuracy(res) if arm.startswith("narwhal") else None,
        "affinity": affinity(reqs, where),
        "ttfts": sorted(r.ttft for r in res if r.ok and r.ttft is not None),
        "config": cfg,
        "mock_cpu_s": mock_cpu,
        "foreign_cpu_s": foreign,
        "foreign_cores": foreign / wall if wall > 0 else None,
        "timeline": timeline,
        # per request: offset of its arrival (s), status, refusal/error code, TTFT (s), prompt
        # tokens, reported cached tokens, x-narwhal-expected-cached-tokens, projected TTFT ms, engine
        "records": [[round(q.at, 3), r.status, r.code or (r.error[:60] if r.error else None), None if r.ttft is None else round(r.ttft, 4), r.extra.get("usage_prompt_tokens"),
                     r.extra.get("cached_tokens"), r.extra.get("expected_cached"), r.extra.get("projected_ttft_ms"), w] for (q, r), w in zip(_paired(reqs, res), where, strict=False)],
    }
    return out


def _paired(reqs: Sequence[TraceRequest], res: Sequence[Result]) -> list[tuple[TraceRequest, Result]]:
    """Results are appended in send order, which is the arrival order."""
    return list(zip(reqs, res, strict=False))


def _self_cpu() -> float:
    t = os.times()
    return t.user + t.system


# -- report ---------------------------------------------------------------------------------


def table(points: Sequence[dict[str, Any]]) -> str:
    rows = []
    for p in points:
        s, m = p["summary"], p["mocks"]
        ha = p.get("header_accuracy")
        rows.append([
            p["arm"], s["offered"], s["ok"], f"{m['hit_rate']:.3f}",
            fmt_ms(s["ttft"]["p50"], 0), fmt_ms(s["ttft"]["p90"], 0), fmt_ms(s["ttft"]["p99"], 0),
            f"{s['goodput']:.3f}", s["refused"], s["errors"],
            f"{m['requests_max_over_mean']:.2f}" if m["requests_max_over_mean"] else None,
            f"{p['affinity']['same_engine']:.2f}" if p.get("affinity", {}).get("same_engine") is not None else None,
            f"{ha['within_engine_block']:.3f} / {ha['within_index_block']:.3f}" if ha else None,
        ])
    return markdown_table(["arm", "offered", "answered", "hit rate (mocks)", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "goodput", "refused", "errors",
                           "busiest engine (requests / mean)", "follow-ups on their prefix's engine", "expected cached within 16 / 64 tokens"], rows)


# -- CLI ------------------------------------------------------------------------------------


WORKLOAD = (
    opt("--trace", default=str(DEFAULT_TRACE), help="the Mooncake trace (JSONL: timestamp, input_length, output_length, hash_ids)"),
    opt("--start", type=float, default=600.0, help="trace seconds skipped (default 600)"),
    opt("--window", type=float, default=1200.0, help="trace seconds replayed (default 1200)"),
    opt("--sample", type=float, default=0.35, help="share of conversations kept, seeded (default 0.35)"),
    opt("--seed", type=int, default=1, help="the conversation sample's seed"),
    opt("--tokens-per-block", type=int, default=64, help="tokens a 512-token trace block becomes (default 64)"),
    opt("--max-blocks", type=int, default=32, help="trace blocks kept per prompt, the first ones (default 32)"),
    opt("--output-scale", type=float, default=0.1, help="output_length multiplier (default 0.1)"),
    opt("--max-output", type=int, default=64, help="output cap, tokens (default 64)"),
    opt("--engines", type=int, default=4, help="unified vllm-dialect mock engines (default 4)"),
    opt("--cache-tokens", type=int, default=65536, help="each mock's --prefix-cache-tokens, and Narwhal's prefix_cache_tokens (default 65536)"),
    opt("--prefill-base-ms", type=float, default=10.0),
    opt("--prefill-per-token-ms", type=float, default=0.4),
    opt("--prefill-quadratic-ms", type=float, default=0.00002),
    opt("--noise-sigma", type=float, default=0.1),
    opt("--budget-ms", type=int, default=3000, help="TTFT budget: Narwhal's ttft_budget_ms and x-narwhal-ttft-target-ms; goodput's target (default 3000)"),
)


add_workload_arguments = O.adder(WORKLOAD)  # the workload and fleet (module rules): shared with prefix_model.py


OPTIONS = (
    opt("--arms", default=",".join(ARMS), help=f"comma-separated, from {', '.join(ARMS)} (default all)"),
    opt("--duration", type=float, default=140.0, help="seconds the window is compressed onto (default 140)"),
    opt("--drain", type=float, default=45.0, help="seconds to wait for open requests after the last arrival (default 45)"),
    opt("--limit", type=int, default=None, help="replay only the first N selected requests (smoke runs)"),
    opt("--quiet-wait", type=float, default=300.0, help="before each arm, wait at most this long for the machine to be quiet (< 0.25 cores busy; default 300 s)"),
    opt("--plot-load", nargs="+", metavar="JSON", help="only plot: hit rate, TTFT p90 and goodput against load from these runs' prefix.json, to IMG/prefix-cache-load.png"),
    opt("--out", default="out/bench", help="write prefix.json / prefix.md here (default out/bench)"),
    opt("--img", default="docs", help="write prefix-cache-ttft.png here (default docs)"),
)


add_arguments = O.adder(WORKLOAD, OPTIONS)


def run(args: argparse.Namespace) -> int:
    if args.plot_load:
        path = prefix_load_plot([json.loads(Path(f).read_text()) for f in args.plot_load], Path(args.img or ".") / "prefix-cache-load.png")
        print(f"plot: {path}")
        return 0
    arms = O.names(args.arms)
    bad = [a for a in arms if a not in ARMS]
    if bad:
        print(f"unknown arms {bad} (known: {', '.join(ARMS)})", file=sys.stderr)
        return 2
    rcpu, lcpu = layout()
    pin_self(lcpu)
    rows = select(load_mooncake(args.trace), start_s=args.start, window_s=args.window, sample=args.sample, seed=args.seed)
    speedup = args.window / args.duration
    reqs = scale(rows, start_s=args.start, speedup=speedup, tokens_per_block=args.tokens_per_block, max_blocks=args.max_blocks,
                 output_scale=args.output_scale, max_output=args.max_output)
    if args.limit:
        reqs = reqs[: args.limit]
    if not reqs:
        print("no requests selected", file=sys.stderr)
        return 2
    bodies = [request_body(r, args.tokens_per_block) for r in reqs]
    timing = {"prefill_base_ms": args.prefill_base_ms, "prefill_per_token_ms": args.prefill_per_token_ms, "prefill_quadratic_ms": args.prefill_quadratic_ms,
              "noise_sigma": args.noise_sigma}
    t_ms = [args.prefill_base_ms + args.prefill_per_token_ms * (r.prompt_tokens + 3) + args.prefill_quadratic_ms * (r.prompt_tokens + 3) ** 2 for r in reqs]
    span = reqs[-1].at if len(reqs) > 1 else 1.0
    uniq = len({r.hash_ids[: i + 1] for r in reqs for i in range(r.prompt_tokens // args.tokens_per_block)})
    work = {
        "requests": len(reqs), "offered_rate": len(reqs) / max(span, 1e-9), "speedup": speedup,
        "prompt_tokens_mean": sum(r.prompt_tokens for r in reqs) / len(reqs), "prompt_tokens_max": max(r.prompt_tokens for r in reqs),
        "output_tokens_mean": sum(r.output_tokens for r in reqs) / len(reqs),
        "capped_prompts": sum(1 for r in rows[: len(reqs)] if len(r["hash_ids"]) > args.max_blocks),
        "prefill_ms_mean_uncached": sum(t_ms) / len(t_ms), "prefill_ms_max_uncached": max(t_ms),
        "rho_uncached": sum(t_ms) / 1000.0 / (args.engines * max(span, 1e-9)),
        "ideal_hit_rate": ideal_hit_rate(reqs, args.tokens_per_block),
        "distinct_full_blocks": uniq, "working_set_tokens": uniq * args.tokens_per_block, "fleet_cache_tokens": args.engines * args.cache_tokens,
    }
    started = _dt.datetime.now(_dt.UTC)
    print(f"prefix: {len(reqs)} requests over {span:.0f} s ({work['offered_rate']:.2f} req/s, speed-up {speedup:.2f}); mean prompt {work['prompt_tokens_mean']:.0f} tokens, "
          f"uncached prefill rho {work['rho_uncached']:.2f}; ideal hit rate {work['ideal_hit_rate']:.3f}; working set {work['working_set_tokens']} tokens vs fleet cache "
          f"{work['fleet_cache_tokens']}", flush=True)
    points = []
    unavailable: dict[str, str] = {}
    for arm in arms:
        busy = quiet_wait(args.quiet_wait)
        print(f"  arm {arm}: starting a fresh fleet (machine busy {busy:.2f} cores before)", flush=True)
        try:
            pt = run_arm(arm, reqs, bodies, engines=args.engines, timing=timing, cache_tokens=args.cache_tokens, budget_ms=args.budget_ms,
                         drain_s=args.drain, rcpu=rcpu, lcpu=lcpu)
        except H.PeerUnavailable as e:
            unavailable[arm] = str(e)
            print(f"  arm {arm}: unavailable: {e}", flush=True)
            continue
        points.append(pt)
        s, m = pt["summary"], pt["mocks"]
        ha = pt["header_accuracy"]
        pt["busy_before_cores"] = busy
        print(f"  arm {arm}: other processes used {pt['foreign_cores']:.2f} cores during the replay", flush=True)
        print(f"  arm {arm}: follow-ups on the engine of their prefix: {pt['affinity']['same_engine']}", flush=True)
        print(f"  arm {arm}: hit {m['hit_rate']:.3f} TTFT p50/p90/p99 {fmt_ms(s['ttft']['p50'], 0)}/{fmt_ms(s['ttft']['p90'], 0)}/{fmt_ms(s['ttft']['p99'], 0)} ms "
              f"goodput {s['goodput']:.3f} refused {s['refused']} {s['refusal_codes']} errors {s['errors']} {s['error_samples']} "
              f"engines {[e['requests'] for e in m['engines']]}" + (f" header within 16/64: {ha['within_engine_block']:.3f}/{ha['within_index_block']:.3f}" if ha else ""), flush=True)
    ended = _dt.datetime.now(_dt.UTC)
    data = {"started": started.isoformat(timespec="seconds"), "ended": ended.isoformat(timespec="seconds"), "commit": commit(), "argv": sys.argv,
            "args": vars(args), "workload": work, "timing": timing, "points": points, "unavailable": unavailable,
            "pinning": f"router CPU {sorted(rcpu)}, load tool + mocks CPU {sorted(lcpu or ())}" if rcpu else "not pinned"}
    md = table(points)
    print("\n" + md, flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "prefix.json").write_text(json.dumps(data, indent=1, default=str))
        (out / "prefix.md").write_text(md + "\n")
    if args.img and points:
        path = prefix_ttft_plot(points, Path(args.img) / "prefix-cache-ttft.png", budget_ms=args.budget_ms,
                    title=f"Mooncake conversation trace, {len(reqs)} requests in {span:.0f} s, {args.engines} caching mocks")
        print(f"plot: {path}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    return O.main("narwhal_bench.prefix", "Prefix-cache-aware placement on the Mooncake trace (issue 15 item 4).", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
