"""The experiments behind docs/performance.md, each one function and one command.

  overhead  router-added TTFT (routed minus direct, same mock engine, same run), HTTP/1.1
            and HTTP/2, and router CPU per relayed token event, at a fixed rate.
  relay     relayed token events per router CPU-second: N concurrent streams, one token
            every I ms each, from the ticker source; optional py-spy profile.
  memory    router memory per open stream: N streams held open at once.
  peers     the same load through each peer router in front of the same mock engine.
  overload  (overload.py) Azure-trace replay at multiples of the fleet's capacity.

Every run pins the router under test to one core and the load tool and engines to the
other (harness.processes.layout()), stops every process it started, and is bounded in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import harness as H
from .harness.client import SSERecorder, make_client
from .harness.load import (
    RequestShape,
    fixed_rate,
    phase,
    run_closed_loop,
    run_loop,
)
from .harness.processes import layout, pin_self, raise_nofile
from .harness.report import Report, pinning_note
from .harness.stats import Result, fmt_ms, markdown_table, percentile, summarize
from .hold import PER_HOLDER, hold_spread

__all__ = ["overhead", "relay", "memory", "peers", "narwhal_overrides", "relay_one", "memory_one", "memory_preflight"]


# -- overhead ----------------------------------------------------------------------------


def _start(name: str, engines: list[H.Engine], cpus: set[int] | None, unavailable: dict[str, str], **narwhal: Any) -> H.Started | None:
    """One router of --routers (harness.router_names), or None with the reason kept."""
    try:
        return H.start_peer(name, engines, cpus=cpus, narwhal_overrides=narwhal or None)
    except H.PeerUnavailable as e:
        unavailable[name] = str(e)
        print(f"  {name}: not run: {str(e).splitlines()[0]}", flush=True)
        return None


def _unavailable(rep: Report, unavailable: dict[str, str]) -> None:
    for name, why in unavailable.items():
        rep.add(f"- **{name}** did not run: {why}")


def overhead(*, rate: float = 200.0, duration_s: float = 10.0, rounds: int = 2, protocols: Sequence[str] = ("1", "2"), servers: Sequence[str] = ("hypercorn",),
             prompt_tokens: int = 64, output_tokens: int = 16, tpot_ms: float = 10.0, stream: bool = True, out: Path | None = None,
             routers: Sequence[str] = ("narwhal",)) -> Report:
    rcpu, lcpu = layout()
    pin_self(lcpu)
    rep = Report("overhead: router-added latency, routed minus direct")
    shape = RequestShape(stream=stream, mock={"prefill_ms": 0, "tpot_ms": tpot_ms})
    rows = []
    unavailable: dict[str, str] = {}
    with H.stopping() as things:
        eng = H.mock_engine("u0", cpus=lcpu, timing={"time_scale": 0.1})
        things.append(eng)
        started = []
        for name in H.router_names(routers, servers):
            r = _start(name, [eng], rcpu, unavailable)
            if r is not None:
                things.append(r)
                started.append(r)
        # warm-up: connections, caches, the sizer's learned ratio
        for r in started:
            for http in protocols:
                if http in r.protocols:
                    phase(r.url, r.headers, http, fixed_rate(min(rate, 50), 2.0, prompt_tokens=prompt_tokens, output_tokens=output_tokens, seed=99), shape)
        for http in protocols:
            phase(eng.url, {}, http, fixed_rate(min(rate, 50), 1.0, prompt_tokens=prompt_tokens, output_tokens=output_tokens, seed=98), shape)
        results: dict[tuple[str, str], list[Result]] = {}
        cpu: dict[tuple[str, str], float] = {}
        for k in range(rounds):
            for http in protocols:
                arr = fixed_rate(rate, duration_s, prompt_tokens=prompt_tokens, output_tokens=output_tokens, seed=k + 1)
                results.setdefault(("direct", http), []).extend(phase(eng.url, {}, http, arr, shape))
                for r in started:
                    if http not in r.protocols:
                        unavailable.setdefault(f"{r.name} over HTTP/2", f"{r.name} serves HTTP/1.1 only here")
                        continue
                    c0 = r.proc.cpu()
                    res = phase(r.url, r.headers, http, arr, shape)
                    cpu[(r.name, http)] = cpu.get((r.name, http), 0.0) + r.proc.cpu() - c0
                    results.setdefault((r.name, http), []).extend(res)
        data: dict[str, Any] = {"rate": rate, "duration_s": duration_s, "rounds": rounds, "pinning": pinning_note(rcpu, lcpu), "runs": {}}
        for http in protocols:
            d = summarize(results[("direct", http)])
            data["runs"][f"direct/h{http}"] = d
            for r in started:
                if (r.name, http) not in results:
                    continue
                s = summarize(results[(r.name, http)])
                toks = max(1, s["tokens"])
                s["router_cpu_s"] = cpu[(r.name, http)]
                s["cpu_us_per_token"] = cpu[(r.name, http)] / toks * 1e6
                s["requests_per_cpu_s"] = s["ok"] / max(1e-9, cpu[(r.name, http)])
                s["notes"] = r.notes
                data["runs"][f"{r.name}/h{http}"] = s
                add50 = None if s["ttft"]["p50"] is None or d["ttft"]["p50"] is None else s["ttft"]["p50"] - d["ttft"]["p50"]
                add99 = None if s["ttft"]["p99"] is None or d["ttft"]["p99"] is None else s["ttft"]["p99"] - d["ttft"]["p99"]
                rows.append([r.name, f"HTTP/{'1.1' if http == '1' else '2'}", f"{s['ok']}/{s['offered']}",
                             fmt_ms(d["ttft"]["p50"]), fmt_ms(s["ttft"]["p50"]), fmt_ms(add50), fmt_ms(d["ttft"]["p99"]), fmt_ms(s["ttft"]["p99"]), fmt_ms(add99),
                             fmt_ms(s["e2e"]["p50"]), f"{s['cpu_us_per_token']:.0f}", f"{s['router_cpu_s'] / (rounds * duration_s):.2f}", fmt_ms(s["send_lag"]["p99"])])
    rep.data = data
    rep.add(f"{rate:g} req/s open loop (Poisson), {rounds} x {duration_s:g} s per arm, prompt {prompt_tokens} tokens, {output_tokens} output tokens "
            f"{tpot_ms:g} ms apart, {'streaming' if stream else 'non-streaming'}; one mock engine (vllm dialect, prefill 0 ms). {data['pinning']}")
    rep.add(markdown_table(["router", "HTTP", "ok/offered", "direct TTFT p50", "routed TTFT p50", "added p50", "direct TTFT p99", "routed TTFT p99", "added p99",
                            "routed e2e p50", "router CPU µs / token event", "router cores busy", "load-tool send lag p99"], rows))
    rep.add("Times in ms. *added* = routed minus direct percentile, same engine, same arrivals (seeds), same run. CPU per token event = the router process's "
            "utime+stime over its phases / output tokens relayed (includes each request's admission and HTTP work, amortised over its tokens).")
    data["notes"] = {r.name: r.notes for r in started}
    data["unavailable"] = unavailable
    rep.add("Routers: " + "; ".join(f"{k}: {v}" for k, v in data["notes"].items()))
    _unavailable(rep, unavailable)
    rep.save(out)
    return rep


# -- relay -------------------------------------------------------------------------------


def narwhal_overrides(mode: str = "open", workers: int = 1, streams: int | None = None) -> dict[str, Any]:
    """Narwhal's settings in the relay, memory and versus benches (harness.narwhal_config
    keywords): admission `mode`, `workers` data-plane processes; with `streams`, every
    limit above that many open streams and no profiling on start (memory)."""
    adm: dict[str, Any] = {"mode": mode}
    ov: dict[str, Any] = {"admission": adm}
    if workers != 1:
        ov["serving"] = {"workers": workers}
    if streams is not None:
        room = max(8192, streams + 1024)
        adm.update({"http_retention_limit": room, "phase_concurrency": {"prefill": 4, "decode": room}})
        ov["prediction"] = {"profile_on_start": False}  # at one token per 2 s it would take minutes
        ov["upstream"] = {"max_connections": room}
    return ov


async def _window(proc: Any, warm_s: float, window_s: float) -> dict[str, float]:
    await asyncio.sleep(warm_s)
    t0, k0, c0 = time.perf_counter(), SSERecorder.tokens_seen, proc.cpu() if proc else 0.0
    await asyncio.sleep(window_s)
    t1, k1, c1 = time.perf_counter(), SSERecorder.tokens_seen, proc.cpu() if proc else 0.0
    return {"seconds": t1 - t0, "events": float(k1 - k0), "cpu_s": c1 - c0}


async def _relay_run(url: str, http: str, streams: int, tokens: int, proc: Any, warm_s: float, window_s: float, profile_s: float, profile_out: Path | None, granian: bool,
                     headers: dict[str, str] | None = None) -> tuple[dict[str, float], list[Result], dict[str, Any] | None]:
    c = make_client(url, http, headers=headers)
    shape = RequestShape(stream=True)
    total = warm_s + window_s + profile_s + 1.0
    load = asyncio.create_task(run_closed_loop(c, shape, concurrency=streams, duration_s=total, prompt_tokens=32, output_tokens=tokens, ramp_s=min(2.0, warm_s)))
    win = await _window(proc, warm_s, window_s)
    prof = None
    if profile_s > 0 and profile_out is not None and proc is not None:
        from .profile import pyspy_record, reduce_raw

        spy = pyspy_record(proc.pid, profile_s, profile_out, subprocesses=granian)
        while spy.poll() is None:
            await asyncio.sleep(0.2)
        err = spy.stderr.read().decode(errors="replace") if spy.stderr else ""
        prof = reduce_raw(profile_out) if profile_out.exists() else {"error": err[-500:]}
    res = await load
    await c.aclose()
    return win, res, prof


def relay_one(r: H.Started, *, http: str = "1", streams: int = 200, tokens: int = 250, warm_s: float = 4.0, window_s: float = 15.0, profile_s: float = 0.0,
              profile_out: Path | None = None) -> dict[str, Any]:
    """One router's relay measurement (the ticker behind it): relayed events per router
    CPU-second over the window, the router's whole process tree from /proc."""
    granian = r.name.endswith("granian")
    win, res, prof = run_loop(_relay_run(r.url, http, streams, tokens, r.proc, warm_s, window_s, profile_s if r.name.startswith("narwhal") else 0.0, profile_out, granian,
                                     headers=r.headers))
    tp = [x.tpot for x in res if x.tpot is not None]
    per_cpu = win["events"] / win["cpu_s"] if win["cpu_s"] > 0 else math.inf
    s = summarize(res)
    return {**win, "events_per_s": win["events"] / win["seconds"], "events_per_cpu_s": per_cpu, "cpu_us_per_event": 1e6 / per_cpu,
            "tpot_p50": percentile(tp, 50), "tpot_p99": percentile(tp, 99), "profile": prof, "errors": sum(1 for x in res if x.error and x.error != "cut at end of run"),
            "error_samples": [x.error for x in res if x.error and x.error != "cut at end of run"][:3], "statuses": s["statuses"], "refusal_codes": s["refusal_codes"],
            "notes": r.notes}


def relay(*, streams: int = 200, interval_ms: float = 20.0, tokens: int = 250, warm_s: float = 4.0, window_s: float = 15.0, servers: Sequence[str] = ("hypercorn",),
          http: str = "1", profile_s: float = 0.0, mode: str = "open", out: Path | None = None, tracing: Sequence[str] = (), alternations: int = 1,
          routers: Sequence[str] = ("narwhal",), workers: int = 1) -> Report:
    """`tracing` (issue 23): arms of observability.sample_ratio ("off", "0.01", "1", ...),
    run in turn `alternations` times, every span exported to an OTLP/HTTP sink in this
    (the load's) process; without it, the plain relay run."""
    if tracing:
        return _relay_tracing(streams=streams, interval_ms=interval_ms, tokens=tokens, warm_s=warm_s, window_s=window_s, http=http, mode=mode, out=out,
                              arms=tracing, alternations=alternations)
    rcpu, lcpu = layout()
    pin_self(lcpu)
    rep = Report("relay: relayed token events per router CPU-second")
    rows = []
    data: dict[str, Any] = {"streams": streams, "interval_ms": interval_ms, "tokens_per_stream": tokens, "mode": mode, "pinning": pinning_note(rcpu, lcpu), "runs": {}}
    ideal = streams * 1000.0 / interval_ms
    with H.stopping() as things:
        tk = H.ticker_engine("t0", interval_ms=interval_ms, cpus=lcpu)
        things.append(tk)
        win, res, _ = run_loop(_relay_run(tk.url, http, streams, tokens, None, min(warm_s, 2.0), min(window_s, 6.0), 0, None, False))
        tp = [r.tpot for r in res if r.tpot is not None]
        data["runs"]["direct"] = {**win, "tpot_p50": percentile(tp, 50), "tpot_p99": percentile(tp, 99)}
        rows.append(["direct (ticker, no router)", f"{win['events'] / win['seconds']:,.0f}", "—", "—", fmt_ms(percentile(tp, 50)), fmt_ms(percentile(tp, 99))])
        unavailable: dict[str, str] = data.setdefault("unavailable", {})
        for name in H.router_names(routers, servers):
            r = _start(name, [tk], rcpu, unavailable, **narwhal_overrides(mode, workers))
            if r is None:
                continue
            things.append(r)
            if http not in r.protocols:
                r.stop()
                unavailable[name] = f"{name} serves HTTP/1.1 only here"
                continue
            pout = (out or Path("out/bench")) / f"relay-profile-{name}.txt"
            pout.parent.mkdir(parents=True, exist_ok=True)
            st = data["runs"][name] = relay_one(r, http=http, streams=streams, tokens=tokens, warm_s=warm_s, window_s=window_s, profile_s=profile_s, profile_out=pout)
            r.stop()
            rows.append([name, f"{st['events_per_s']:,.0f}", f"{st['cpu_s'] / st['seconds']:.2f}", f"{st['events_per_cpu_s']:,.0f}", fmt_ms(st["tpot_p50"]), fmt_ms(st["tpot_p99"]),
                         f"{st['statuses']}".replace("'", "")])
            prof = st["profile"]
            if prof and prof.get("self"):
                rep.data.setdefault("profiles", {})[name] = prof
    rep.data = {**data, **rep.data}
    rep.add(f"{streams} concurrent streams (closed loop, {tokens} tokens each, restarted when done), one token per event every {interval_ms:g} ms = "
            f"{ideal:,.0f} events/s offered; vLLM dialect with token_ids on every event (Narwhal validates them); admission mode {mode}; HTTP/{'1.1' if http == '1' else '2'} client side. "
            f"Measured over {window_s:g} s after {warm_s:g} s of ramp. {data['pinning']}")
    rows[0].append("—")
    rep.add(markdown_table(["run", "token events/s at the client", "router cores busy", "relayed events per router CPU-s", "client TPOT p50 ms", "client TPOT p99 ms", "statuses"], rows))
    for name, prof in rep.data.get("profiles", {}).items():
        rep.add(f"py-spy profile of {name} ({prof['samples']} samples over {profile_s:g} s, on-CPU Python stacks). Top self time:")
        rep.add(markdown_table(["function (self)", "share"], [(k, f"{v:.1%}") for k, v in prof["self"][:12]]))
        rep.add("Narwhal's own functions, inclusive:")
        rep.add(markdown_table(["function (inclusive)", "share"], [(k, f"{v:.1%}") for k, v in prof["inclusive_narwhal"][:12]]))
    rep.add("Routers: " + "; ".join(f"{k}: {v['notes']}" for k, v in data["runs"].items() if k != "direct"))
    _unavailable(rep, data["unavailable"])
    rep.save(out)
    return rep


class _OtlpSink:
    """An OTLP/HTTP receiver that answers 200 and keeps only counts (the tracing arm's
    collector; it runs in the load's process, on the load's cores)."""

    def __init__(self) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        sink = self
        self.requests = 0
        self.bytes = 0

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                n = int(self.headers.get("content-length") or 0)
                self.rfile.read(n)
                sink.requests += 1
                sink.bytes += n
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *a: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _trace_counters(url: str) -> dict[str, float]:
    import httpx

    out = {"dropped": 0.0, "failed": 0.0}
    with contextlib.suppress(Exception):
        for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("narwhal_trace_spans_dropped_total"):
                out["dropped"] += float(line.rsplit(" ", 1)[1])
            elif line.startswith("narwhal_trace_spans_export_failed_total"):
                out["failed"] += float(line.rsplit(" ", 1)[1])
    return out


def _relay_tracing(*, streams: int, interval_ms: float, tokens: int, warm_s: float, window_s: float, http: str, mode: str, out: Path | None,
                   arms: Sequence[str], alternations: int) -> Report:
    """The relay's CPU per event with tracing off and at each sampling ratio (issue 23)."""
    rcpu, lcpu = layout()
    pin_self(lcpu)
    rep = Report("relay with tracing: relayed token events per router CPU-second, sampling off / 1% / 100%")
    data: dict[str, Any] = {"streams": streams, "interval_ms": interval_ms, "tokens_per_stream": tokens, "mode": mode, "pinning": pinning_note(rcpu, lcpu),
                            "arms": list(arms), "alternations": alternations, "runs": []}
    per_arm: dict[str, list[float]] = {a: [] for a in arms}
    rows = []
    sink = _OtlpSink()
    try:
        with H.stopping() as things:
            tk = H.ticker_engine("t0", interval_ms=interval_ms, cpus=lcpu)
            things.append(tk)
            for k in range(alternations):
                for arm in arms:
                    cfg = H.narwhal_config([tk], admission={"mode": mode})
                    if arm != "off":
                        cfg["observability"] = {"otlp_endpoint": sink.url, "sample_ratio": float(arm)}
                    name = f"narwhal tracing {arm}"
                    r = H.start_narwhal(cfg, cpus=rcpu, name=f"narwhal-trace-{arm}")
                    things.append(r)
                    before = sink.requests
                    win, res, _ = run_loop(_relay_run(r.url, http, streams, tokens, r.proc, warm_s, window_s, 0.0, None, False))
                    counters = _trace_counters(r.url)
                    r.stop()
                    per_cpu = win["events"] / win["cpu_s"] if win["cpu_s"] > 0 else math.inf
                    per_arm[arm].append(per_cpu)
                    tp = [x.tpot for x in res if x.tpot is not None]
                    st = summarize(res)
                    run = {"arm": arm, "round": k + 1, **win, "events_per_cpu_s": per_cpu, "cpu_us_per_event": 1e6 / per_cpu,
                           "requests": sum(1 for x in res if x.done_at is not None), "exports": sink.requests - before, **counters,
                           "tpot_p50": percentile(tp, 50), "tpot_p99": percentile(tp, 99), "statuses": st["statuses"]}
                    data["runs"].append(run)
                    rows.append([f"{name}, round {k + 1}", f"{win['events'] / win['seconds']:,.0f}", f"{win['cpu_s'] / win['seconds']:.2f}", f"{per_cpu:,.0f}",
                                 f"{1e6 / per_cpu:.1f}", str(run["exports"]), f"{counters['dropped']:.0f}", fmt_ms(percentile(tp, 50)), fmt_ms(percentile(tp, 99))])
    finally:
        sink.stop()
    base = per_arm.get("off") or []
    summary = []
    for arm in arms:
        v = per_arm[arm]
        us = sorted(1e6 / x for x in v)
        more = ""
        if base and arm != "off":
            b = sorted(1e6 / x for x in base)
            lo, hi = us[0] / b[-1] - 1.0, us[-1] / b[0] - 1.0
            mid = (sum(us) / len(us)) / (sum(b) / len(b)) - 1.0
            more = f"{mid:+.1%} (range {lo:+.1%} to {hi:+.1%})"
        summary.append([arm, f"{us[0]:.1f}–{us[-1]:.1f}", f"{sum(us) / len(us):.1f}", more or "—"])
    data["summary"] = {a: per_arm[a] for a in arms}
    rep.data = data
    rep.add(f"{streams} concurrent streams (closed loop, {tokens} tokens each, restarted when done), one token per event every {interval_ms:g} ms; "
            f"admission mode {mode}; HTTP/{'1.1' if http == '1' else '2'}. Every arm is one router process; spans go to an OTLP/HTTP sink in the load's "
            f"process. Arms in turn, {alternations} rounds. Measured over {window_s:g} s after {warm_s:g} s of ramp. {data['pinning']}")
    rep.add(markdown_table(["run", "token events/s at the client", "router cores busy", "relayed events per router CPU-s", "CPU µs / event",
                            "OTLP exports", "spans dropped", "client TPOT p50 ms", "client TPOT p99 ms"], rows))
    rep.add(markdown_table(["sampling", "CPU µs / event (min–max)", "mean", "more CPU per event than off: mean (range over runs)"], summary))
    rep.save(out)
    return rep


# -- memory ------------------------------------------------------------------------------


def memory_preflight(streams: int, *, margin: int = 256) -> dict[str, Any]:
    """Can this machine hold `streams` open HTTP/1.1 streams, and how? A router process
    holds two descriptors per stream (client and engine connections), a holder
    (narwhal_bench.hold) or a ticker engine one; RLIMIT_NOFILE bounds each process (its
    soft limit is raised to the hard one here and in every child, harness.processes.Proc). Past one
    router process's `max_streams`, Narwhal spreads the streams over `narwhal_workers`
    data-plane workers (half of each one's room left for an uneven accept spread: the
    kernel hands each connection to whichever worker accepts first) and a peer, one
    process, holds `peer_streams`, the most it can. Each side's connections to one address
    take one ephemeral port each: `problems` says what does not fit."""
    soft, hard = raise_nofile()
    lim = hard if hard != -1 else 1 << 30
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        ports = hi - lo + 1
    except (OSError, ValueError):
        ports = 28232
    try:
        reuse = int(Path("/proc/sys/net/ipv4/tcp_tw_reuse").read_text())
    except (OSError, ValueError):
        reuse = 0
    # without TIME_WAIT reuse the previous router's engine connections hold their ports for 60 s
    port_need = streams * (1 if reuse else 2) + 1024
    problems = []
    if port_need > ports:
        problems.append(f"ephemeral ports: {ports:,} in net.ipv4.ip_local_port_range, {port_need:,} needed (tcp_tw_reuse {reuse})")
    per_process = max(0, (lim - margin) // 2)
    fit = min(per_process, (ports - 1024) // (1 if reuse else 2))
    workers = 1 if streams <= per_process else -(-streams // max(1, per_process // 2))
    return {"streams": streams, "nofile": [soft, hard], "ephemeral_ports": ports, "tcp_tw_reuse": reuse, "problems": problems, "max_streams": max(0, fit),
            "narwhal_workers": workers, "peer_streams": min(streams, per_process), "spread": -(-streams // PER_HOLDER) if streams else 1}


def memory_one(r: H.Started, *, streams: int, ramp_s: float, tokens: int, hold_s: float) -> dict[str, Any]:
    """One router's RSS (its process tree, /proc) idle and with `streams` open; a warm-up
    first runs every code path once (lazy imports, caches) before the idle reading."""
    phase(r.url, r.headers, "1", fixed_rate(50, 2, output_tokens=2, seed=5), RequestShape(stream=True, mock={"tpot_ms": 1}))
    d: dict[str, Any] = run_loop(hold_spread(r.url, streams, ramp_s, tokens, hold_s, r.proc, headers=r.headers, cpus=layout()[1]))
    d["streams"] = streams
    d["bytes_per_stream"] = (d["rss_open"] - d["rss_idle"]) / max(1, d["open"])
    d["kib_per_stream"] = d["bytes_per_stream"] / 1024
    d["notes"] = r.notes
    return d


def memory(*, streams: int = 5000, interval_ms: float = 2000.0, ramp_s: float = 15.0, hold_s: float = 5.0, servers: Sequence[str] = ("hypercorn",), out: Path | None = None,
           routers: Sequence[str] = ("narwhal",), workers: int = 1) -> Report:
    pre = memory_preflight(streams)
    if pre["problems"]:
        raise RuntimeError(f"{streams:,} open streams do not fit on this machine (at most {pre['max_streams']:,}): " + "; ".join(pre["problems"]))
    rcpu, lcpu = layout()
    pin_self(lcpu)
    rep = Report("memory: router memory per open stream")
    rows = []
    data: dict[str, Any] = {"streams": streams, "interval_ms": interval_ms, "preflight": pre, "runs": {}, "unavailable": {}}
    tokens = int((ramp_s + hold_s + 40) * 1000 / interval_ms) + 5
    with H.stopping() as things:
        tks = [H.ticker_engine(f"t{i}", interval_ms=interval_ms, cpus=lcpu) for i in range(pre["spread"])]
        things.extend(tks)
        for name in H.router_names(routers, servers):
            n = streams if name.startswith("narwhal") else pre["peer_streams"]
            r = _start(name, tks, rcpu, data["unavailable"], **narwhal_overrides("open", max(workers, pre["narwhal_workers"]), streams))
            if r is None:
                continue
            things.append(r)
            d = data["runs"][name] = memory_one(r, streams=n, ramp_s=ramp_s, tokens=tokens, hold_s=hold_s)
            r.stop()
            rows.append([name, f"{d['open']}/{n}", f"{d['rss_idle'] / 2**20:.0f}", f"{d['rss_open'] / 2**20:.0f}", f"{d['kib_per_stream']:.1f}", d["errors"]])
    rep.data = data
    rep.add(f"{streams} streaming requests opened over {ramp_s:g} s over HTTP/1.1 (one connection each), held open (one token every {interval_ms:g} ms from the ticker), "
            f"RSS of the router's process tree read from /proc after {hold_s:g} s with all open, from {pre['spread']} holder process(es) through {pre['spread']} ticker engine(s). "
            f"RLIMIT_NOFILE {pre['nofile'][0]}/{pre['nofile'][1]}: Narwhal with {max(workers, pre['narwhal_workers'])} data-plane worker(s); a peer (one process) holds at most "
            f"{pre['peer_streams']:,}. {pinning_note(rcpu, lcpu)}")
    rep.add(markdown_table(["router", "streams open", "RSS idle MiB", "RSS with streams MiB", "KiB per open stream", "errors"], rows))
    rep.add("Routers: " + "; ".join(f"{k}: {v['notes']}" for k, v in data["runs"].items()))
    _unavailable(rep, data["unavailable"])
    rep.save(out)
    return rep


# -- peers -------------------------------------------------------------------------------


def peers(*, names: Sequence[str] = H.PEERS, rates: Sequence[float] = (20.0, 200.0), duration_s: float = 10.0, prompt_tokens: int = 64, output_tokens: int = 16,
          tpot_ms: float = 10.0, out: Path | None = None, img: Path | None = None) -> Report:
    rcpu, lcpu = layout()
    pin_self(lcpu)
    rep = Report("peers: the same load through each router")
    shape = RequestShape(stream=True, mock={"prefill_ms": 0, "tpot_ms": tpot_ms})
    rows = []
    data: dict[str, Any] = {"rates": list(rates), "duration_s": duration_s, "pinning": pinning_note(rcpu, lcpu), "runs": {}, "unavailable": {}}
    with H.stopping() as things:
        eng = H.mock_engine("u0", cpus=lcpu, timing={"time_scale": 0.1})
        things.append(eng)
        phase(eng.url, {}, "1", fixed_rate(50, 1, output_tokens=4, seed=7), shape)
        for name in names:
            try:
                p = H.start_peer(name, [eng], cpus=rcpu)
            except H.PeerUnavailable as e:
                data["unavailable"][name] = str(e)
                rows.append([name, "—", "—", "not run: " + str(e).splitlines()[0][:160]] + ["—"] * 8)
                continue
            things.append(p)
            try:
                for http in p.protocols:
                    phase(p.url, p.headers, http, fixed_rate(20, 2.0, prompt_tokens=prompt_tokens, output_tokens=output_tokens, seed=9), shape)  # warm-up
                    for rate in rates:
                        arr = fixed_rate(rate, duration_s, prompt_tokens=prompt_tokens, output_tokens=output_tokens, seed=int(rate) + 1)
                        d = summarize(phase(eng.url, {}, http, arr, shape))
                        c0, w0 = p.proc.cpu(), time.perf_counter()
                        s = summarize(phase(p.url, p.headers, http, arr, shape, drain_s=20.0))
                        cpu, wall = p.proc.cpu() - c0, time.perf_counter() - w0
                        s["router_cpu_s"], s["wall_s"] = cpu, wall
                        s["cpu_us_per_token"] = cpu / max(1, s["tokens"]) * 1e6
                        add50 = None if s["ttft"]["p50"] is None else s["ttft"]["p50"] - d["ttft"]["p50"]
                        add99 = None if s["ttft"]["p99"] is None else s["ttft"]["p99"] - d["ttft"]["p99"]
                        s["added_p50"], s["added_p99"] = add50, add99
                        data["runs"][f"{name}/h{http}/{rate:g}"] = {"peer": s, "direct": d, "notes": p.notes}
                        rows.append([name, f"HTTP/{'1.1' if http == '1' else '2'}", f"{rate:g}", p.notes, f"{s['ok']}/{s['offered']}", f"{s['refused']}/{s['errors']}", fmt_ms(d["ttft"]["p50"]), fmt_ms(s["ttft"]["p50"]),
                                     fmt_ms(add50), fmt_ms(add99), f"{s['cpu_us_per_token']:.0f}", f"{cpu / wall:.2f}"])
            finally:
                p.stop()
    rep.data = data
    rep.add(f"Open-loop Poisson load, {duration_s:g} s per point, streaming chat, prompt {prompt_tokens} tokens, {output_tokens} output tokens {tpot_ms:g} ms apart, "
            f"one mock engine (vllm dialect); a direct phase against the engine precedes every routed phase with the same arrivals. {data['pinning']}")
    rep.add(markdown_table(["router", "HTTP", "req/s", "server", "ok/offered", "refused/errors", "direct TTFT p50", "routed TTFT p50", "added p50", "added p99", "router CPU µs / token event", "router cores busy"], rows))
    for name, why in data["unavailable"].items():
        rep.add(f"- **{name}** did not run: {why}")
    if img is not None and data["runs"]:
        from .plots import peers_plot

        rep.add(f"![peers]({peers_plot(data, img / 'peers.png').name})")
    rep.save(out)
    return rep
