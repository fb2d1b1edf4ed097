"""`narwhal bench overload`: Azure-trace replay at multiples of the fleet's capacity,
through Narwhal's admission arms and peer routers: goodput over offered requests,
refusals, TTFT p99, refusal latency.

Every point pins the router under test to one core and the load tool and engines to the
other (harness.processes.layout()), restarts the router, stops every process it started,
and is bounded in time (duration + drain).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import harness as H
from .harness.client import make_client
from .harness.load import (
    Arrival,
    RequestShape,
    _one,
    default_trace,
    load_trace,
    phase,
    run_loop,
    trace_arrivals,
)
from .harness.processes import layout, pin_self
from .harness.report import Report, pinning_note
from .harness.stats import Result, fmt_ms, markdown_table, percentile, summarize

__all__ = ["overload", "capacity", "burst", "prefill_ms", "SCENARIOS", "ARMS"]


SCENARIOS: dict[str, dict[str, Any]] = {
    # prefill-bound: default mock prefill model T(n) = 4 + 0.02 n + 2e-6 n^2 ms, decode 8 + 0.05 B ms, x4 slower
    "prefill": {"timing": {"time_scale": 4.0, "noise_sigma": 0.1}, "output_scale": 0.1, "max_output": 64, "ttft_ms": 1000.0, "tpot_ms": None},
    # decode-bound: decode 8 + 1.0 B ms per token (x4), longer outputs; the TPOT target binds before prefill does
    "decode": {"timing": {"time_scale": 4.0, "noise_sigma": 0.1, "tpot_per_seq_ms": 1.0}, "output_scale": 0.25, "max_output": 160, "ttft_ms": 1000.0, "tpot_ms": 100.0},
}


def prefill_ms(n: int, t: dict[str, float]) -> float:
    from narwhal.mock.timing import Timing

    base = Timing()
    a = t.get("prefill_base_ms", base.prefill_base_ms)
    b = t.get("prefill_per_token_ms", base.prefill_per_token_ms)
    c = t.get("prefill_quadratic_ms", base.prefill_quadratic_ms)
    return (a + b * n + c * n * n) * t.get("time_scale", 1.0)


def capacity(arrivals: Sequence[Arrival], timing: dict[str, float], engines: int, tpot_target_ms: float | None) -> dict[str, Any]:
    """Computed capacity of a unified mock fleet for these requests (req/s).

    Prefill: each engine serves prefills FCFS one at a time, so it sustains 1 / E[T(n)]
    requests/s (T from the mock's timing model, with time_scale). Decode: with B
    sequences in the batch each token takes s*(d0 + d1*B) ms; by Little's law an engine
    admitting lambda req/s with mean output m holds B = lambda * (m - 1) * tpot(B). With a
    TPOT target the largest B allowed is B* = (target/s - d0)/d1, so lambda_dec =
    B* / ((m - 1) * target). The fleet's capacity is the smaller of the two, times engines.
    """
    from narwhal.mock.timing import Timing

    base = Timing()
    s = timing.get("time_scale", 1.0)
    d0 = timing.get("tpot_base_ms", base.tpot_base_ms)
    d1 = timing.get("tpot_per_seq_ms", base.tpot_per_seq_ms)
    mean_t = sum(prefill_ms(a.prompt_tokens, timing) for a in arrivals) / len(arrivals) / 1000.0
    mean_out = sum(a.output_tokens for a in arrivals) / len(arrivals)
    cap_p = 1.0 / mean_t
    cap_d = math.inf
    if tpot_target_ms is not None and mean_out > 1:
        b_star = (tpot_target_ms / s - d0) / d1
        cap_d = max(0.0, b_star) / ((mean_out - 1) * tpot_target_ms / 1000.0)
    return {"mean_prefill_s": mean_t, "mean_output_tokens": mean_out, "prefill_req_s_per_engine": cap_p, "decode_req_s_per_engine": cap_d,
            "engines": engines, "capacity_req_s": engines * min(cap_p, cap_d), "bound": "prefill" if cap_p <= cap_d else "decode"}


async def burst(urls: Sequence[str], arrivals: Sequence[Arrival]) -> float:
    """Send these requests at once, round-robin over the engines; prefills per second."""
    clients = [make_client(u, "1") for u in urls]
    shape = RequestShape(stream=True)
    res: list[Result] = []
    t0 = time.perf_counter()
    await asyncio.gather(*(_one(clients[i % len(clients)], shape, a, t0, 120.0, res) for i, a in enumerate(arrivals)))
    for c in clients:
        await c.aclose()
    firsts = [r.first_token_at for r in res if r.first_token_at is not None]
    return len(firsts) / (max(firsts) - t0) if firsts else 0.0


ARMS = {
    "narwhal: no limits": {"mode": "open", "queue_limit": 1_000_000, "http_retention_limit": 1_000_000, "max_wait_ms": 600_000},
    "narwhal: queue limit": {"mode": "open", "queue_limit": 8},
    "narwhal: predictive": {"mode": "predictive"},
    # + R14, the decode-side check: prediction.tpot_budget_ms = the scenario's TPOT target
    "narwhal: predictive + TPOT check": {"mode": "predictive", "prediction": {"tpot_budget_ms": None}},
}


def overload(*, scenario: str = "prefill", loads: Sequence[float] = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0), arms: Sequence[str] = tuple(ARMS)[:3], peer_names: Sequence[str] = ("vllm-router", "litellm", "xpyd-proxy"),
             engines: int = 2, duration_s: float = 20.0, drain_s: float = 8.0, start_s: float = 60.0, trace: str = "conv", queue_limit: int | None = None,
             out: Path | None = None, img: Path | None = None) -> Report:
    sc = SCENARIOS[scenario]
    rcpu, lcpu = layout()
    pin_self(lcpu)
    rep = Report(f"overload_{scenario}: goodput over offered requests, {scenario}-bound fleet")
    rows_trace = load_trace(default_trace(trace))
    shape_kw = {"output_scale": sc["output_scale"], "max_output": sc["max_output"], "max_prompt": 8192, "start_s": start_s}
    probe, _ = trace_arrivals(rows_trace, duration_s=1e9, speedup=1.0, **shape_kw)
    probe = probe[:2000]
    cap = capacity(probe, sc["timing"], engines, sc["tpot_ms"])
    arms_cfg = {k: dict(v) for k, v in ARMS.items() if k in arms}
    if queue_limit is not None and "narwhal: queue limit" in arms_cfg:
        arms_cfg["narwhal: queue limit"]["queue_limit"] = queue_limit
    data: dict[str, Any] = {"scenario": scenario, "capacity": cap, "loads": list(loads), "duration_s": duration_s, "drain_s": drain_s, "ttft_target_ms": sc["ttft_ms"],
                            "tpot_target_ms": sc["tpot_ms"], "timing": sc["timing"], "arms": arms_cfg, "points": [], "unavailable": {}, "pinning": pinning_note(rcpu, lcpu)}
    with H.stopping() as things:
        fleet = [H.mock_engine(f"u{i}", cpus=lcpu, timing={**sc["timing"], "seed": i + 1}) for i in range(engines)]
        things.extend(fleet)
        # measured check of the computed prefill capacity: 40 trace requests at once, direct
        measured = run_loop(burst([e.url for e in fleet], probe[:40]))
        cap40 = capacity(probe[:40], sc["timing"], engines, None)["capacity_req_s"]
        data["capacity"]["measured_prefill_req_s_burst40"] = measured
        data["capacity"]["computed_prefill_req_s_burst40"] = cap40
        rep.add(f"Capacity ({scenario}-bound): {cap['capacity_req_s']:.2f} req/s for {engines} unified mock engines — prefill {cap['prefill_req_s_per_engine']:.2f} req/s per engine "
                f"(1 / mean T(n) = 1 / {cap['mean_prefill_s'] * 1000:.0f} ms over the replayed requests), decode {cap['decode_req_s_per_engine']:.2f} req/s per engine "
                f"(TPOT target {sc['tpot_ms']} ms, mean output {cap['mean_output_tokens']:.1f} tokens). Check: 40 trace requests sent at once directly to the engines "
                f"completed their prefills at {measured:.2f} req/s (computed for those 40: {cap40:.2f}).")
        H.engines_idle(fleet)
        contenders: list[tuple[str, dict[str, Any] | None]] = [(a, arms_cfg[a]) for a in arms_cfg] + [(p, None) for p in peer_names]
        for load in loads:
            rate = load * cap["capacity_req_s"]
            arrivals, speedup = trace_arrivals(rows_trace, duration_s=duration_s, rate=rate, **shape_kw)
            # the prefill utilisation these very requests offer: sum T(n) / (engines x duration)
            rho = sum(prefill_ms(a.prompt_tokens, sc["timing"]) for a in arrivals) / 1000.0 / (engines * duration_s)
            for name, adm in contenders:
                if name in data["unavailable"]:
                    continue
                if not H.engines_idle(fleet):  # a router that does not pass aborts upstream left work behind
                    print(f"  engines still busy before {name} at {load:g}x: restarting them", flush=True)
                    data.setdefault("engine_restarts", []).append(f"{load:g}x before {name}")
                    for e in fleet:
                        e.proc.stop()
                        things.remove(e)
                    fleet = [H.mock_engine(f"u{i}", cpus=lcpu, timing={**sc["timing"], "seed": i + 1}) for i in range(engines)]
                    things.extend(fleet)
                pt = _point(name, adm, fleet, rcpu, sc, data, arrivals, load=load, rho=rho, rate=rate, speedup=speedup, duration_s=duration_s, drain_s=drain_s)
                if pt is None:
                    continue
                data["points"].append(pt)
                print(f"  {scenario} {load:g}x {name}: goodput {pt['goodput']:.3f} refused {pt['refusal_rate']:.3f} errors {pt['error_rate']:.3f} "
                      f"TTFT p99 {fmt_ms(pt['ttft_p99_admitted'], 0)} ms TPOT p99 {fmt_ms(pt['tpot_p99'], 0)} ms refusal p99 {fmt_ms(pt['refusal_latency_p99'])} ms", flush=True)
    rep.data = data
    _overload_tables(rep, data)
    if img is not None:
        from .plots import overload_plot

        path = overload_plot(data, img / f"overload_{scenario}.png")
        rep.add(f"![overload {scenario}]({path.name})")
    rep.save(out)
    return rep


def _point(name: str, adm: dict[str, Any] | None, fleet: list[H.Engine], rcpu: set[int] | None, sc: dict[str, Any], data: dict[str, Any],
           arrivals: Sequence[Arrival], *, load: float, rho: float, rate: float, speedup: float, duration_s: float, drain_s: float) -> dict[str, Any] | None:
    """One arm (adm: Narwhal's admission section) or peer (adm None) at one load, started
    and stopped here; None (and the reason in data["unavailable"]) when it cannot run."""
    ttft_s = sc["ttft_ms"] / 1000.0
    tpot_s = sc["tpot_ms"] / 1000.0 if sc["tpot_ms"] else None

    try:
        if adm is not None:
            adm = dict(adm)
            if "prediction" in adm:  # the TPOT check's budget is the scenario's TPOT target
                adm["prediction"] = {**adm["prediction"], "tpot_budget_ms": sc["tpot_ms"] or 100.0}
            ov = {"admission": {**adm, "ttft_budget_ms": int(sc["ttft_ms"])}}
            r = H.start_narwhal(H.narwhal_config(fleet, **ov), cpus=rcpu, name="narwhal-overload")
        else:
            r = H.start_peer(name, fleet, cpus=rcpu)
    except H.PeerUnavailable as e:
        data["unavailable"][name] = str(e)
        return None
    try:
        c0 = r.proc.cpu()
        res = phase(r.url, r.headers, "1", arrivals, RequestShape(stream=True), timeout_s=duration_s + drain_s + 5, drain_s=drain_s)
        cpu = r.proc.cpu() - c0
    finally:
        r.stop()
    s = summarize(res, duration_s=duration_s, ttft_target_s=ttft_s, tpot_target_s=tpot_s)
    tp_ok = [x.tpot for x in res if x.ok and x.tpot is not None]
    return {"arm": name, "load": load, "prefill_utilisation": rho, "offered_rate": len(arrivals) / duration_s, "target_rate": rate, "speedup": speedup, "offered": s["offered"],
            "goodput": s["goodput"], "refusal_rate": s["refusal_rate"], "error_rate": s["error_rate"], "ttft_p99_admitted": s["ttft"]["p99"],
            "ttft_p50_admitted": s["ttft"]["p50"], "tpot_p99": percentile(tp_ok, 99), "tpot_p50": percentile(tp_ok, 50), "refusal_latency_p99": s["refusal_latency"]["p99"],
            "refusal_latency_p50": s["refusal_latency"]["p50"], "refusal_codes": s["refusal_codes"], "statuses": s["statuses"], "error_samples": s["error_samples"],
            "ttft_met_admitted": _met(res, ttft_s, tpot_s), "router_cpu_s": cpu, "send_lag_p99": s["send_lag"]["p99"]}


def _met(res: Sequence[Result], ttft_s: float, tpot_s: float | None) -> float | None:
    ok = [r for r in res if r.ok]
    if not ok:
        return None
    good = sum(1 for r in ok if r.ttft is not None and r.ttft <= ttft_s and (tpot_s is None or r.tpot is None or r.tpot <= tpot_s))
    return good / len(ok)


def _overload_tables(rep: Report, data: dict[str, Any]) -> None:
    sc = data["scenario"]
    tgt = f"TTFT ≤ {data['ttft_target_ms']:g} ms" + (f" and TPOT ≤ {data['tpot_target_ms']:g} ms" if data["tpot_target_ms"] else "")
    rep.add(f"Azure 2023 conversation trace from t = 60 s, time-compressed to each offered load; token counts: prompts as in the trace (capped at 8192), outputs x "
            f"{SCENARIOS[sc]['output_scale']} (cap {SCENARIOS[sc]['max_output']}). {data['duration_s']:g} s of arrivals per point, then at most {data['drain_s']:g} s to finish "
            f"(requests still open then are cut and count as misses); ρ = the prefill work those very requests bring / (engines x duration). Goodput = share of OFFERED requests that completed with {tgt}; a refusal is a miss. "
            f"Router restarted for every point; engines shared and idle at each start. {data['pinning']}")
    pts = data["points"]
    arms = list(dict.fromkeys(p["arm"] for p in pts))
    rows = []
    for p in pts:
        rho = f", ρ {p['prefill_utilisation']:.2f}" if "prefill_utilisation" in p else ""
        rows.append([f"{p['load']:g}x ({p['offered_rate']:.1f}/s{rho})", p["arm"], p["offered"], f"{p['goodput']:.3f}", f"{p['refusal_rate']:.3f}", f"{p['error_rate']:.3f}",
                     "—" if p["ttft_met_admitted"] is None else f"{p['ttft_met_admitted']:.3f}", fmt_ms(p["ttft_p99_admitted"], 0), fmt_ms(p["tpot_p99"], 0), fmt_ms(p["refusal_latency_p99"])])
    rows.sort(key=lambda r: (float(r[0].split("x")[0]), arms.index(r[1])))
    rep.add(markdown_table(["load", "router / arm", "offered", "goodput", "refused", "errors/cut", "SLO met (completed)", "TTFT p99 ms (completed)", "TPOT p99 ms", "refusal latency p99 ms"], rows))
    for name, why in data["unavailable"].items():
        rep.add(f"- **{name}** did not run: {why}")
    two = [p for p in pts if p["load"] == 2.0]
    if two:
        nw = max((p["goodput"] for p in two if p["arm"].startswith("narwhal")), default=None)
        peer = max((p["goodput"] for p in two if not p["arm"].startswith("narwhal")), default=None)
        if nw is not None and peer is not None:
            ratio = nw / peer if peer > 0 else math.inf
            rep.add(f"At 2x load: Narwhal's best goodput {nw:.3f}, best peer {peer:.3f}: ratio {ratio:.2f} (target ≥ 1.5).")
