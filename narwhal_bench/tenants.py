"""`narwhal bench tenants`: one tenant's overload (issue 22 item 4), Narwhal side by side
with SMG 1.13 and LiteLLM.

    narwhal bench tenants [--arms narwhal-alone,narwhal,smg-alone,smg,smg-priority,litellm-alone,litellm,litellm-parallel]
                          [--duration 90] [--engines 4] [--load 2] [--noisy-factor 10] [--quick] [--from-json FILE]
    python -m narwhal_bench.tenants ...                (the same, without the `narwhal bench` entry)

The run
  * A fleet of `--engines` unified mock vLLM engines (`narwhal mock-engine` processes,
    timing x`--time-scale`, lognormal noise 0.1), shared by every arm and idle at the
    start of each. Every request is the same: a streaming chat completion of
    `--prompt-tokens` prompt tokens and `--output-tokens` output tokens.
  * Capacity: the mock serves prefills FCFS one at a time per engine (its decode batch
    runs beside the prefill), so with one request shape the fleet sustains engines / T(n)
    requests/s, T(n) = (a + b n + c n^2) x time_scale from narwhal/mock/timing.py
    (experiments.capacity). Checked before the arms: `--engines` x 10 requests sent at
    once directly to the engines, prefills completed per second (overload.burst).
  * Two tenants of equal weight, each with its own API key: the offered total is `--load`
    x capacity, split 1 : `--noisy-factor` (defaults: 2x, 10: quiet 0.18x, noisy 1.82x of
    capacity). Poisson arrivals, seeded: every arm replays the same arrivals.
  * Arms (each router restarted, pinned to the router CPU; the load tool and the engines
    on the other): `*-alone` sends the quiet tenant's arrivals only, the others both.
      narwhal   `narwhal serve`, workers 1, admission predictive (its defaults), auth.keys_file
                with the two keys, `tenants: {quiet: {weight: 1}, noisy: {weight: 1}}`
                with ttft_budget_ms = `--ttft-budget-ms`, admission.phase_concurrency
                prefill 1 per engine (the router, not the engine's FCFS queue, orders
                the waiting prefills: that is where fairness can act).
      smg       SMG 1.13 (`smg launch`, round_robin) with `--tenant-api-key` per tenant,
                `--tenant-rate-limit-enabled` with each tenant's requests_per_minute at its
                equal share of capacity (capacity / 2), and `--priority-scheduler-enabled`
                with both tenants in the same class (equal weight has no other expression
                there). SMG 1.13 enforces its tenant rate limits on its gRPC router only
                (its reference docs say so; checked here: a tenant at 2 requests/minute
                got five 200s in a row through the HTTP router), so with HTTP engines
                this arm is plain round-robin routing with identity.
      smg-priority  the same, but the noisy tenant clamped to the priority class bulk
                (the quiet one stays in default): priority, not equal weights - what SMG
                offers to protect one tenant from another.
      litellm   LiteLLM proxy 1.108.7, no database: the two keys through
                `general_settings.custom_auth` (a module written here that maps each key
                to a `UserAPIKeyAuth` with `rpm_limit` = its equal share x 60), and
                the deployments without rpm limits; the per-key RPM limit is LiteLLM's
                own in-memory limiter.
      litellm-parallel  the same, and each key's `max_parallel_requests` = the number
                of engines (LiteLLM's per-key concurrency bound, the nearest it has to
                Narwhal's one prefill per engine: a tenant alone can keep every engine
                busy but queue no more than that).
  * Per tenant and arm: offered, answered 200 whole, refused (status, code, with or
    without Retry-After), failed (5xx, other status, transport error, cut stream),
    cancelled (still open at the end of the drain), TTFT p50/p99 of the 200s, goodput.
    For Narwhal the books at rest from /metrics: per tenant and for the fleet, offered
    == the sum of the terminal classes.

Goodput (quiet tenant): the share of its OFFERED requests answered 200, streamed whole
(`data: [DONE]`, no error event) with TTFT (from its first byte sent to its first token)
<= `--ttft-budget-ms`; a refusal, a failure or a late first token is a miss.

Targets (issue 22 item 4): quiet goodput >= 0.95; quiet TTFT p99 <= 1.25 x the same load
alone (narwhal vs narwhal-alone); the noisy tenant refused with Retry-After; nothing
failed; books balanced.

Every loop is bounded in time and count; every process is stopped by its PID / process
group in a `finally` (harness.processes.Proc). Output: Markdown on stdout and, with --out (default
out/bench/tenants), tenants.md and tenants.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from . import harness as H
from . import tenants_retention as retention
from .harness import options as O
from .harness.client import make_client
from .harness.load import Arrival, RequestShape, fixed_rate, run_loop, run_open_loop
from .harness.options import opt
from .harness.processes import Proc, command_line, free_port, layout, log_dir, pin_self, run_bench
from .harness.report import pinning_note, save
from .harness.stats import Result, fmt_ms, markdown_table
from .overload import burst, capacity, prefill_ms
from .tenants_books import KEYS, keys_file, narwhal_books, outcome, tenant_summary

__all__ = ["add_arguments", "run", "main", "outcome", "tenant_summary", "narwhal_books", "ARMS"]

MODEL = "narwhal-demo"
ARMS = ("narwhal-alone", "narwhal", "smg-alone", "smg", "smg-priority", "litellm-alone", "litellm", "litellm-parallel")
ALL_ARMS = ARMS + retention.ARMS  # engine-bound, then retention-bound (tenants_retention.py)
TERMINAL = ("completed", "rejected", "refused", "invalid_requests", "expired", "unavailable", "failed", "cancelled")


# -- arguments ---------------------------------------------------------------------------------


OPTIONS = (
    opt("--arms", default=",".join(ALL_ARMS), help=f"comma-separated (default all): {', '.join(ALL_ARMS)}"),
    opt("--duration", type=float, default=None, help="seconds of arrivals per arm (default 90; --quick 4)"),
    O.drain(15.0),
    opt("--engines", type=int, default=4, help="unified mock engines (default 4)"),
    opt("--time-scale", type=float, default=4.0, help="the mocks' --time-scale (default 4)"),
    opt("--prompt-tokens", type=int, default=2000, help="prompt tokens per request (default 2000: T = 208 ms at time scale 4)"),
    opt("--output-tokens", type=int, default=8, help="output tokens per request (default 8)"),
    opt("--load", type=float, default=2.0, help="offered total as a multiple of capacity (default 2)"),
    opt("--noisy-factor", type=float, default=10.0, help="noisy rate / quiet rate (default 10)"),
    opt("--ttft-budget-ms", type=float, default=1000.0, help="the tenants' TTFT budget: goodput's target (default 1000)"),
    opt("--seed", type=int, default=1),
    O.quick("4 s per arm, 2 engines"),
    O.out("tenants"),
    O.from_json("tenants"),
    *retention.OPTIONS,
)


add_arguments = O.adder(OPTIONS)


def _defaults(args: argparse.Namespace) -> None:
    if args.duration is None:
        args.duration = 4.0 if args.quick else 90.0
    if args.quick:
        args.engines = min(args.engines, 2)
        args.drain = min(args.drain, 8.0)


# -- the routers -------------------------------------------------------------------------------


def _start_narwhal(fleet: list[H.Engine], budget_ms: float, cpus: set[int] | None) -> tuple[H.Started, dict[str, Any]]:
    cfg = H.narwhal_config(fleet, model=MODEL, admission={"mode": "predictive", "ttft_budget_ms": int(budget_ms), "queue_limit": 256, "http_retention_limit": 4096,
                                                          "phase_concurrency": {"prefill": 1, "decode": 64}})
    cfg["auth"] = {"keys_file": str(keys_file())}
    cfg["tenants"] = {t: {"weight": 1, "ttft_budget_ms": int(budget_ms)} for t in KEYS}
    return H.start_narwhal(cfg, cpus=cpus, name="narwhal-tenants"), cfg


def _start_smg(fleet: list[H.Engine], share_rps: float, cpus: set[int] | None, classes: dict[str, str] | None = None) -> tuple[H.Started, dict[str, Any]]:
    rpm = max(1, round(share_rps * 60))
    rl = {"default_policy": {"tokens_per_minute": 100_000_000, "requests_per_minute": 1_000_000},
          "tenants": [{"tenant_key": f"auth:{t}", "tokens_per_minute": 100_000_000, "requests_per_minute": rpm} for t in KEYS]}
    ps = {"tenant_policies": {f"auth:{t}": {"max_class": (classes or {}).get(t, "default")} for t in KEYS}}
    rl_path = H._write("smg-tenant-rate-limit", ".yaml", rl)
    ps_path = H._write("smg-priority", ".yaml", ps)
    extra = ["--retry-max-retries", "1", "--request-timeout-secs", "120",
             "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", str(rl_path),
             "--priority-scheduler-enabled", "--priority-scheduler-config", str(ps_path)]
    for t, k in KEYS.items():
        extra += ["--tenant-api-key", f"{t}:{k}"]
    st = H.start_smg(fleet, cpus=cpus, name="smg-tenants", extra=extra, timeout_s=60.0)
    return st, {"argv": st.proc.argv[1:], "tenant_rate_limit": rl, "priority_scheduler": ps}


_LITELLM_AUTH = '''"""LiteLLM custom_auth for narwhal bench tenants: two keys, each its tenant's rpm_limit
(no database: the keys live here)."""
from fastapi import HTTPException, Request
from litellm.proxy._types import UserAPIKeyAuth

KEYS = {KEYS!r}
RPM = {RPM!r}
PARALLEL = {PARALLEL!r}


async def user_api_key_auth(request: Request, api_key: str) -> UserAPIKeyAuth:
    key = api_key.removeprefix("Bearer ").strip()
    for tenant, k in KEYS.items():
        if key == k:
            return UserAPIKeyAuth(api_key=key, key_alias=tenant, user_id=tenant, team_id=tenant, rpm_limit=RPM[tenant], max_parallel_requests=PARALLEL.get(tenant))
    raise HTTPException(status_code=401, detail="invalid api key")
'''


def _start_litellm(fleet: list[H.Engine], share_rps: float, cpus: set[int] | None, parallel: int | None = None) -> tuple[H.Started, dict[str, Any]]:
    exe = H._venv_exe("litellm", "litellm")
    rpm = {t: max(1, round(share_rps * 60)) for t in KEYS}
    par = {t: parallel for t in KEYS} if parallel else {}
    d = log_dir() / "litellm-tenants"
    d.mkdir(exist_ok=True)
    (d / "bench_tenants_auth.py").write_text(_LITELLM_AUTH.replace("{KEYS!r}", repr(KEYS)).replace("{RPM!r}", repr(rpm)).replace("{PARALLEL!r}", repr(par)))
    cfg = {
        "model_list": [{"model_name": MODEL, "litellm_params": {"model": f"openai/{MODEL}", "api_base": e.url + "/v1", "api_key": "none"}} for e in fleet],
        "router_settings": {"routing_strategy": "simple-shuffle", "num_retries": 0},
        "litellm_settings": {"num_retries": 0, "request_timeout": 120, "set_verbose": False, "json_logs": False},
        "general_settings": {"master_key": H.MASTER_KEY, "custom_auth": "bench_tenants_auth.user_api_key_auth"},
    }
    path = d / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    port = free_port()
    env = {"LITELLM_MASTER_KEY": H.MASTER_KEY, "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_LOG": "ERROR", "NO_DOCS": "True", "PYTHONPATH": str(d)}
    p = Proc("litellm-tenants", [str(exe), "--config", str(path), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"], cpus=cpus, env=env, cwd=d).start()
    url = f"http://127.0.0.1:{port}"
    st = H._started("litellm", p, url, "/health/liveliness", 90.0, protocols=("1",), notes=f"litellm[proxy] {H._version('litellm', 'litellm')}, 1 worker")
    return st, {"config": cfg, "custom_auth_rpm_limit": rpm, "custom_auth_max_parallel_requests": par}


# -- one arm ---------------------------------------------------------------------------------


async def _drive(url: str, loads: dict[str, list[Arrival]], shape: RequestShape, timeout_s: float, drain_s: float) -> dict[str, list[Result]]:
    clients = {t: make_client(url, "1") for t in loads}
    try:
        shapes = {t: RequestShape(model=shape.model, stream=True, headers={"authorization": f"Bearer {KEYS[t]}"}) for t in loads}
        outs = await asyncio.gather(*(run_open_loop(clients[t], loads[t], shapes[t], timeout_s=timeout_s, drain_s=drain_s) for t in loads))
        return dict(zip(loads, outs, strict=True))
    finally:
        for c in clients.values():
            await c.aclose()


def _arm(name: str, fleet: list[H.Engine], loads: dict[str, list[Arrival]], *, budget_ms: float, share_rps: float, duration_s: float, drain_s: float,
         cpus: set[int] | None) -> dict[str, Any]:
    router = name.split("-")[0]
    if router == "narwhal":
        st, setup = _start_narwhal(fleet, budget_ms, cpus)
    elif name == "smg-priority":  # not equal weights: the quiet tenant's class above the noisy one's
        st, setup = _start_smg(fleet, share_rps, cpus, classes={"quiet": "default", "noisy": "bulk"})
    elif router == "smg":
        st, setup = _start_smg(fleet, share_rps, cpus)
    elif name == "litellm-parallel":  # and at most one request per engine in flight per key
        st, setup = _start_litellm(fleet, share_rps, cpus, parallel=len(fleet))
    elif router == "litellm":
        st, setup = _start_litellm(fleet, share_rps, cpus)
    else:
        raise ValueError(f"unknown arm {name!r} (known: {', '.join(ARMS)})")
    try:
        c0 = st.proc.cpu()
        res = run_loop(_drive(st.url, loads, RequestShape(model=MODEL), timeout_s=duration_s + drain_s + 10, drain_s=drain_s))
        cpu = st.proc.cpu() - c0
        books = narwhal_books(st.url) if router == "narwhal" else None
    finally:
        st.stop()
    budget_s = budget_ms / 1000.0
    out: dict[str, Any] = {"arm": name, "router": router, "notes": st.notes, "setup": setup, "router_cpu_s": cpu, "tenants": {t: tenant_summary(r, budget_s) for t, r in res.items()}}
    if books is not None:
        out["books"] = books
    return out


# -- the run -----------------------------------------------------------------------------------


def tenants(args: argparse.Namespace) -> dict[str, Any]:
    _defaults(args)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    for a in arms:
        if a not in ALL_ARMS:
            raise ValueError(f"unknown arm {a!r} (known: {', '.join(ALL_ARMS)})")
    rcpu, lcpu = layout()
    pin_self(lcpu)
    data: dict[str, Any] = {"command": command_line("narwhal_bench.tenants"), "pinning": pinning_note(rcpu, lcpu), "arms": [], "unavailable": {}}
    engine_bound = [a for a in arms if a in ARMS]
    if engine_bound:
        _engine_bound(args, engine_bound, data, rcpu, lcpu)
    retention_bound = [a for a in retention.ARMS if a in arms]  # alone first: the ratio's denominator
    if retention_bound:
        data["retention"] = retention.retention_bound(args, retention_bound, rcpu, lcpu)
    verdict(data)
    return data


def _engine_bound(args: argparse.Namespace, arms: list[str], data: dict[str, Any], rcpu: set[int] | None, lcpu: set[int] | None) -> None:
    """The engine-bound arms (the module's doc): a fleet of mock engines, the routers."""
    timing = {"time_scale": args.time_scale, "noise_sigma": 0.1}
    probe = [Arrival(0.0, args.prompt_tokens, args.output_tokens)]
    cap = capacity(probe, timing, args.engines, None)
    total = args.load * cap["capacity_req_s"]
    quiet_rps = total / (1.0 + args.noisy_factor)
    noisy_rps = total - quiet_rps
    share_rps = cap["capacity_req_s"] / len(KEYS)
    loads_both = {
        "quiet": fixed_rate(quiet_rps, args.duration, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, seed=args.seed),
        "noisy": fixed_rate(noisy_rps, args.duration, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, seed=args.seed + 1),
    }
    data.update({
        "engines": args.engines, "timing": timing, "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "prefill_ms": prefill_ms(args.prompt_tokens, timing), "capacity": cap, "load": args.load, "noisy_factor": args.noisy_factor,
        "rates": {"quiet": quiet_rps, "noisy": noisy_rps, "total": total}, "offered": {t: len(a) for t, a in loads_both.items()},
        "ttft_budget_ms": args.ttft_budget_ms, "duration_s": args.duration, "drain_s": args.drain, "equal_share_rps": share_rps,
    })
    print(f"capacity: {cap['capacity_req_s']:.2f} req/s = {args.engines} engines / T({args.prompt_tokens}) = {data['prefill_ms']:.0f} ms; offered {total:.2f} req/s "
          f"({args.load:g}x): quiet {quiet_rps:.2f}/s ({quiet_rps / cap['capacity_req_s']:.3f}x), noisy {noisy_rps:.2f}/s ({noisy_rps / cap['capacity_req_s']:.3f}x)", flush=True)
    with H.stopping() as things:
        fleet = [H.mock_engine(f"u{i}", cpus=lcpu, model=MODEL, timing={**timing, "seed": i + 1}, output_tokens=args.output_tokens) for i in range(args.engines)]
        things.extend(fleet)
        at_once = [Arrival(0.0, args.prompt_tokens, args.output_tokens)] * (10 * args.engines)
        measured = run_loop(burst([e.url for e in fleet], at_once))
        data["capacity"]["measured_req_s_burst"] = measured
        print(f"capacity check: {len(at_once)} requests at once directly to the engines: prefills completed at {measured:.2f} req/s (computed {cap['capacity_req_s']:.2f})", flush=True)
        for name in arms:
            if not H.engines_idle(fleet, 20.0):  # a router that does not pass aborts upstream left work behind
                print(f"  engines still busy before {name}: restarting them", flush=True)
                data.setdefault("engine_restarts", []).append(name)
                for e in fleet:
                    e.proc.stop()
                    things.remove(e)
                fleet = [H.mock_engine(f"u{i}", cpus=lcpu, model=MODEL, timing={**timing, "seed": i + 1}, output_tokens=args.output_tokens) for i in range(args.engines)]
                things.extend(fleet)
            loads = {"quiet": loads_both["quiet"]} if name.endswith("-alone") else loads_both
            try:
                a = _arm(name, fleet, loads, budget_ms=args.ttft_budget_ms, share_rps=share_rps, duration_s=args.duration, drain_s=args.drain, cpus=rcpu)
            except H.PeerUnavailable as e:
                data["unavailable"][name] = str(e)
                print(f"  {name}: not run: {e}", flush=True)
                continue
            data["arms"].append(a)
            q = a["tenants"]["quiet"]
            nz = a["tenants"].get("noisy")
            print(f"  {name}: quiet goodput {q['goodput']:.3f} TTFT p50/p99 {fmt_ms(q['ttft_p50'], 0)}/{fmt_ms(q['ttft_p99'], 0)} ms failed {q['failed']}"
                  + (f"; noisy ok {nz['ok']} refused {nz['refused']} ({nz['refused_with_retry_after']} with Retry-After) failed {nz['failed']}" if nz else "")
                  + (f"; books balanced {a['books']['balanced']}" if "books" in a else ""), flush=True)


def verdict(data: dict[str, Any]) -> None:
    """The issue's targets for each router that ran both arms (alone and with the noisy)."""
    by = {a["arm"]: a for a in data["arms"]}
    out = {}
    for router in ("narwhal", "smg", "smg-priority", "litellm", "litellm-parallel"):
        both, alone = by.get(router), by.get(f"{router.split('-')[0]}-alone")
        if both is None:
            continue
        q, n = both["tenants"]["quiet"], both["tenants"].get("noisy", {})
        ratio = None
        if alone is not None and alone["tenants"]["quiet"]["ttft_p99"] and q["ttft_p99"] is not None:
            ratio = q["ttft_p99"] / alone["tenants"]["quiet"]["ttft_p99"]
        failed = sum(t["failed"] for t in both["tenants"].values())
        cut = sum(t["cancelled"] for t in both["tenants"].values())
        out[router] = {
            "quiet_goodput": q["goodput"], "quiet_goodput_ok": q["goodput"] is not None and q["goodput"] >= 0.95,
            "ttft_p99_ratio": ratio, "ttft_p99_ok": ratio is not None and ratio <= 1.25,
            "noisy_refused": n.get("refused", 0), "noisy_refused_with_retry_after": n.get("refused_with_retry_after", 0),
            "noisy_refused_all_with_retry_after": n.get("refused", 0) > 0 and n.get("refused", 0) == n.get("refused_with_retry_after", 0),
            "failed": failed, "nothing_failed": failed == 0, "cut": cut,
            "books_balanced": both["books"]["balanced"] if "books" in both else None,
        }
    data["verdict"] = out


def tables(data: dict[str, Any]) -> str:
    lines = _engine_tables(data) if "capacity" in data else []
    if "retention" in data:
        lines += [retention.tables(data["retention"]), ""]
    lines += [f"Reproduce: `{data['command']}`"]
    return "\n".join(lines)


def _engine_tables(data: dict[str, Any]) -> list[str]:
    cap = data["capacity"]
    lines = [
        f"Fleet: {data['engines']} unified mock vLLM engines (`narwhal mock-engine`, time scale {data['timing']['time_scale']:g}, noise σ {data['timing']['noise_sigma']:g}); "
        f"every request a streaming chat completion of {data['prompt_tokens']} prompt and {data['output_tokens']} output tokens, prefill T = {data['prefill_ms']:.0f} ms. "
        f"Capacity {cap['capacity_req_s']:.2f} req/s (engines / T; {cap.get('measured_req_s_burst', 0):.2f} measured with a burst sent directly). "
        f"Offered {data['rates']['total']:.2f} req/s = {data['load']:g}x capacity for {data['duration_s']:g} s: quiet {data['rates']['quiet']:.2f}/s "
        f"({data['offered']['quiet']} requests), noisy {data['rates']['noisy']:.2f}/s ({data['offered']['noisy']} requests), Poisson, the same arrivals in every arm. "
        f"TTFT budget (goodput target) {data['ttft_budget_ms']:g} ms. {data['pinning']}",
        "",
    ]
    rows = []
    for a in data["arms"]:
        for t, s in a["tenants"].items():
            ref = ", ".join(f"{k} ×{v}" for k, v in s["refusals"].items()) or "—"
            rows.append([a["arm"], t, s["offered"], s["ok"], ref, s["failed"], s["cancelled"], fmt_ms(s["ttft_p50"], 0), fmt_ms(s["ttft_p99"], 0),
                         "—" if s["goodput"] is None else f"{s['goodput']:.3f}", f"{a['router_cpu_s']:.1f}" if t == "quiet" else ""])
    lines.append(markdown_table(["arm", "tenant", "offered", "200", "refused (status code, +RA: with Retry-After)", "failed", "cut (open at the end)", "TTFT p50 ms", "TTFT p99 ms",
                                 "goodput", "router CPU s"], rows))
    books = [a for a in data["arms"] if "books" in a]
    if books:
        lines += ["", "Narwhal's books at rest (/metrics): offered = Σ terminal classes, per tenant and for the fleet", ""]
        brows = []
        for a in books:
            b = a["books"]
            for who, bk in [*b["tenants"].items(), ("fleet", b["fleet"])]:
                brows.append([a["arm"], who, bk["offered"], ", ".join(f"{k} {v}" for k, v in sorted(bk["terminal"].items())), "yes" if bk["balanced"] else "NO"])
        lines.append(markdown_table(["arm", "tenant", "offered", "terminal classes", "balanced"], brows))
    v = data.get("verdict", {})
    if v:
        lines += ["", "Targets (quiet goodput ≥ 0.95; quiet TTFT p99 ≤ 1.25× alone; noisy refused with Retry-After; nothing failed; books balanced)", ""]
        vrows = []
        for r, x in v.items():
            vrows.append([r, f"{x['quiet_goodput']:.3f}" + (" ✓" if x["quiet_goodput_ok"] else " ✗"), "—" if x["ttft_p99_ratio"] is None else f"{x['ttft_p99_ratio']:.2f}" + (" ✓" if x["ttft_p99_ok"] else " ✗"),
                          f"{x['noisy_refused_with_retry_after']} / {x['noisy_refused']}", x["failed"], x.get("cut", 0),
                          "—" if x["books_balanced"] is None else ("yes" if x["books_balanced"] else "NO")])
        lines.append(markdown_table(["router", "quiet goodput", "quiet TTFT p99 / alone", "noisy refusals with Retry-After", "failed", "cut (open at the end)", "books balanced"], vrows))
    for name, why in data["unavailable"].items():
        lines.append(f"- **{name}** did not run: {why}")
    return [*lines, ""]


def run(args: argparse.Namespace) -> int:
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        verdict(data)
        print(tables(data))
        return 0
    rc, data = run_bench("tenants", lambda: tenants(args))
    if rc:
        return rc
    md = tables(data)
    print()
    print(md)
    save(args.out, "tenants", "## Tenants: one tenant's overload\n\n" + md + "\n", data)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return O.main("narwhal_bench.tenants", __doc__.split("\n\n")[0] if __doc__ else None, add_arguments, run, argv)


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
