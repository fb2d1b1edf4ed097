"""`narwhal bench`: the load generator and the experiments of docs/performance.md.

    narwhal bench load --url URL [--rate R | --trace conv|code|FILE] [--duration S] [--http 1|2] ...
    narwhal bench overhead [--rate 200] [--duration 10] [--rounds 2] [--http 1,2] [--servers hypercorn,granian] [--routers narwhal,smg,vllm-router,envoy]
    narwhal bench relay [--streams 200] [--interval-ms 20] [--window 15] [--profile 10] [--servers ...] [--routers ...]
    narwhal bench memory [--streams 5000] [--routers ...]
    narwhal bench versus [--routers narwhal,smg,vllm-router,envoy] [--runs 3] [--parts relay,ttft,memory] [--mem-streams 20000]
    narwhal bench peers [--peers narwhal,narwhal-granian,litellm,vllm-router,xpyd-proxy,smg,envoy] [--rates 20,200]
    narwhal bench overload [--scenario prefill|decode] [--loads 0.5,1,1.5,2,3,4] [--peers ...]
    narwhal bench abuse [--attacks slow-body,h2-no-read,...] [--duration 15] [--rate 20]
    narwhal bench prediction --engine URL --model NAME [--dialect openai] [--max-concurrency 1]
    narwhal bench split [--parts decisions,saturation,relay,ttft] [--rate 2000] [--clients 1] [--layouts pinned,spread]
    narwhal bench fleet [--rate 40] [--output-tokens 100] [--gap 4] [--after 6] [--quick]
    narwhal bench tenants [--arms narwhal-alone,narwhal,smg-alone,smg,smg-priority,litellm-alone,litellm,litellm-parallel] [--duration 90] [--quick]

Every subcommand prints Markdown tables; --out DIR also saves them with the raw numbers
as JSON (default out/bench, git-ignored); sweeps write PNG plots to --img (default
docs/img). Experiments start and stop their own engines and routers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .harness import PEERS as PEER_NAMES
from .harness import options as O
from .harness.options import opt

__all__ = ["add_arguments", "run"]


_AB_ATTACKS = "none, slow-body, h2-idle-streams, h2-no-read, h1-no-read, fin-churn, chunked-1-byte, settings-flood, ping-flood, rapid-reset"
_IMG = opt("--img", default="docs/img", help="write the PNG plot here ('' to skip)")

LOAD = (
    opt("--url", required=True, help="base URL (http://host:port); requests go to URL/v1/chat/completions or /v1/completions"),
    opt("--rate", type=float, help="fixed rate, req/s (Poisson arrivals; --uniform for fixed gaps)"),
    opt("--uniform", action="store_true", help="fixed gaps of 1/rate instead of Poisson arrivals"),
    opt("--trace", help="replay a trace: conv, code (the shipped Azure 2023 traces) or a CSV path (arrived_at,num_prefill_tokens,num_decode_tokens)"),
    opt("--trace-rate", type=float, help="time-scale the trace to this mean rate, req/s (default: its own rate)"),
    opt("--trace-start", type=float, default=0.0, help="start this many trace seconds in"),
    opt("--prompt-scale", type=float, default=1.0, help="multiply trace prompt lengths"),
    opt("--output-scale", type=float, default=1.0, help="multiply trace output lengths"),
    opt("--max-output", type=int, default=None, help="cap output lengths"),
    opt("--duration", type=float, default=10.0, help="seconds of arrivals (default 10)"),
    opt("--drain", type=float, default=30.0, help="seconds to wait for open requests after the last arrival (default 30)"),
    opt("--timeout", type=float, default=60.0, help="per-request timeout, s"),
    opt("--http", default="1", choices=["1", "2"], help="HTTP/1.1 (raw asyncio client) or HTTP/2 (httpx; h2c prior knowledge on http://)"),
    opt("--no-stream", action="store_true", help="non-streaming requests"),
    opt("--route", default="chat", choices=["chat", "completion"]),
    opt("--model", default="narwhal-demo"),
    opt("--prompt-tokens", type=int, default=64, help="fixed-rate prompt length (tokens, mock sizing)"),
    opt("--output-tokens", type=int, default=16, help="fixed-rate output length"),
    opt("--mock", default="{}", help='extra [[mock {...}]] options as JSON, e.g. \'{"prefill_ms": 0, "tpot_ms": 10}\''),
    opt("--mock-field", action="store_true", help='send the options as a "mock" body field instead of a prompt directive'),
    opt("--header", action="append", default=[], help="extra request header NAME:VALUE (repeatable), e.g. 'Authorization: Bearer KEY'"),
    opt("--ttft-target-ms", type=float, help="also print goodput: share of offered requests with TTFT <= this"),
    opt("--pid", type=int, help="router process id: report its CPU seconds per relayed token (from /proc)"),
    opt("--seed", type=int, default=1),
    opt("--json", help="write every request's record to this JSON file"),
)
OVERHEAD = (
    opt("--rate", type=float, default=200.0), opt("--duration", type=float, default=10.0), opt("--rounds", type=int, default=2),
    opt("--http", default="1,2", help="protocols, comma-separated (default 1,2)"), O.SERVERS, O.ROUTERS,
    opt("--output-tokens", type=int, default=16), opt("--tpot-ms", type=float, default=10.0), opt("--no-stream", action="store_true"), O.SAVE,
)
RELAY = (
    opt("--streams", type=int, default=200), opt("--interval-ms", type=float, default=20.0),
    opt("--tokens", type=int, default=250, help="tokens per stream before it restarts"), opt("--warm", type=float, default=4.0), opt("--window", type=float, default=15.0),
    opt("--profile", type=float, default=0.0, help="then profile the router with py-spy for this many seconds"), O.SERVERS, O.ROUTERS, O.WORKERS,
    opt("--http", default="1", choices=["1", "2"]),
    opt("--mode", default="open", choices=["open", "predictive"], help="Narwhal's admission mode (default open: measure the relay alone)"),
    opt("--tracing", default="", help="comma-separated observability.sample_ratio arms, e.g. off,0.01,1 (issue 23: spans to an OTLP sink in the load's process)"),
    opt("--alternations", type=int, default=1, help="with --tracing: rounds of the arms in turn"), O.SAVE,
)
ABUSE = (
    opt("--attacks", default="", help="comma-separated (default: all): " + _AB_ATTACKS),
    opt("--duration", type=float, default=15.0, help="seconds of normal traffic under each attack (default 15)"),
    opt("--rate", type=float, default=20.0, help="normal clients' request rate, req/s (default 20)"), opt("--out", default="out/bench"),
)
PREDICTION = (
    opt("--engine", required=True, help="the engine's base URL, e.g. http://127.0.0.1:8080"), opt("--dialect", default="openai", choices=["vllm", "sglang", "openai"]),
    opt("--model", required=True), opt("--max-concurrency", type=int, default=None, help="engines[].max_concurrency (1 for llama-cpp-python's server)"),
    opt("--lengths", default="16,64,256,512,1024,1500", help="prompt lengths, tokens of content"), opt("--repeats", type=int, default=4),
    opt("--depth", type=int, default=3, help="requests at once for the queued condition"), opt("--out", default="out/bench"),
)
MEMORY = (
    opt("--streams", type=int, default=5000), opt("--interval-ms", type=float, default=2000.0), opt("--ramp", type=float, default=15.0),
    opt("--hold", type=float, default=5.0), O.SERVERS, O.ROUTERS, O.WORKERS, O.SAVE,
)
PEERS = (
    opt("--peers", default="narwhal,narwhal-granian,litellm,vllm-router,xpyd-proxy,smg,envoy", help="comma-separated, of: " + ", ".join(PEER_NAMES)),
    opt("--rates", default="20,200"), opt("--duration", type=float, default=10.0), opt("--output-tokens", type=int, default=16),
    opt("--tpot-ms", type=float, default=10.0), O.SAVE, _IMG,
)
OVERLOAD = (
    opt("--scenario", default="prefill", choices=["prefill", "decode"]), opt("--loads", default="0.5,1,1.5,2,3,4"),
    opt("--arms", default="none,queue,predictive", help="Narwhal arms: none (open, no limits), queue (open, queue limit), predictive, tpot (predictive + the R14 TPOT check)"),
    opt("--queue-limit", type=int, default=None, help="queue limit of the 'queue' arm (default 8: 4 per engine)"),
    opt("--peers", default="vllm-router,litellm,xpyd-proxy", help="peer routers through the same replay ('' for none)"),
    opt("--engines", type=int, default=2), opt("--duration", type=float, default=20.0), opt("--drain", type=float, default=8.0),
    opt("--trace", default="conv", choices=["conv", "code"]), O.SAVE, _IMG,
)
SPLIT = (
    opt("--parts", default="decisions,saturation,relay,ttft", help="comma-separated: decisions, saturation, relay, ttft (default all)"),
    opt("--rate", type=float, default=2000.0, help="decisions: decisions/s (default 2000)"),
    opt("--warm", type=float, default=2.0, help="decisions: warm-up seconds"),
    opt("--window", type=float, default=10.0, help="decisions: measured seconds per arm"),
    opt("--repeats", type=int, default=2, help="decisions: runs of (in process, channel, floor)"),
    opt("--engines", type=int, default=4, help="decisions/saturation: fake unified engines"),
    opt("--mode", default="predictive", choices=["open", "predictive"], help="decisions/saturation: admission mode (default predictive)"),
    opt("--cycle", default="full", choices=["full", "minimal"],
        help="a request cycle: full = arrive, admit, first_token, close (full outcome), end; minimal = arrive, admit, close(at), end"),
    opt("--sat-rates", default="2000,3000,4000,5000,6000,8000,10000,12000,14000,16000,20000", help="saturation: cycles/s, rising"),
    opt("--sat-window", type=float, default=5.0),
    opt("--clients", type=int, default=1, help="saturation: client processes (each its own channel, like a worker)"),
    opt("--streams", type=int, default=200, help="relay: concurrent streams"),
    opt("--interval-ms", type=float, default=20.0, help="relay: ms between a stream's tokens"),
    opt("--relay-window", type=float, default=15.0),
    opt("--alternations", type=int, default=2, help="relay: runs of each worker count, alternating"),
    opt("--ttft-rates", default="50,100,150,200,300,400,600", help="ttft: req/s, rising"),
    opt("--ttft-duration", type=float, default=8.0, help="ttft: seconds of arrivals per point"),
    opt("--ttft-rounds", type=int, default=2),
    opt("--layouts", default="pinned,spread", help="ttft: pinned (every router process on CPU 0) and/or spread (router unpinned); load tool and engine on CPU 1"),
    opt("--quiet-wait", type=float, default=60.0, help="wait at most this long before each measurement for the rest of the machine to go quiet (< 0.15 core busy)"),
    O.SAVE,
)

# the subcommands in --help's order: (name, help, this module's table) or (name, help, the
# module whose add_arguments and run are its own)
_SUBCOMMANDS: tuple[tuple[str, str, tuple[O.Opt, ...] | str], ...] = (
    ("load", "open-loop load against any OpenAI-compatible URL; prints percentiles", LOAD),
    ("overhead", "router-added TTFT (routed minus direct) and CPU per token, HTTP/1.1 and HTTP/2", OVERHEAD),
    ("relay", "relayed token events per router CPU-second (N streams, one token every I ms)", RELAY),
    ("abuse", "the attacks of tests/abuse against a live router alongside normal traffic (issue 11's soak)", ABUSE),
    ("prediction", "projected vs measured TTFT in front of a real engine you run (issue 12)", PREDICTION),
    ("memory", "router memory per open stream", MEMORY),
    ("peers", "the same load through Narwhal and each peer router, in front of the same mock engine", PEERS),
    ("overload", "trace replay at multiples of capacity: admission arms and peers, goodput over offered", OVERLOAD),
    ("ha", "failover of leader election under load: kill -9 the leader of three routers on a real etcd (docs/ha.md)", "narwhal_bench.ha"),
    ("prefix", "the Mooncake conversation trace against caching mock engines: Narwhal cache-aware and cache-blind, vllm-router cache_aware and round_robin",
     "narwhal_bench.prefix"),
    ("fleet", "a fleet that changes under steady streaming load: engines replaced through the file, etcd and the admin API, limits reloaded, the ha leader "
     "stopped with SIGTERM (docs/operations.md)", "narwhal_bench.fleet"),
    ("tenants", "one tenant's overload: two tenants of equal weight at 2x the mock fleet's capacity, the noisy one 10x the quiet one, through Narwhal, "
     "SMG 1.13 and LiteLLM", "narwhal_bench.tenants"),
    ("prefix-model", "a queueing model of the prefix bench: what any placement rule could get on its workload (seconds, no processes)", "narwhal_bench.prefix_model"),
    ("migration", "stream migration under load: engines killed every few seconds (migration off vs on) and replaced one by one (drain wait vs migrate)",
     "narwhal_bench.migration"),
    ("paired", "two source trees of Narwhal relaying side by side at once on the router's core (a change's before and after, free of the VM's drift between runs)",
     "narwhal_bench.paired"),
    ("versus", "Narwhal side by side with SMG, vllm-router and Envoy in one run (issue 25): relayed events per router CPU-s, added TTFT p50/p99 at 200 req/s, "
     "memory per open stream", "narwhal_bench.versus"),
    ("split", "the cost of serving.workers N: decision round trip in process vs over the channel, authority saturation, relay CPU and TTFT capacity, "
     "workers 1 vs 2", SPLIT),
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    import importlib

    sub = p.add_subparsers(dest="bench_command", required=True)
    for name, help_, rows in _SUBCOMMANDS:
        sp = sub.add_parser(name, help=help_)
        if isinstance(rows, str):
            importlib.import_module(rows).add_arguments(sp)
        else:
            O.add(sp, rows)


_ARM_KEYS = {"none": "narwhal: no limits", "queue": "narwhal: queue limit", "predictive": "narwhal: predictive", "tpot": "narwhal: predictive + TPOT check"}


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind: every experiment stops the processes it started


def run(args: argparse.Namespace) -> int:
    import signal

    cmd = args.bench_command
    for name, _, rows in _SUBCOMMANDS:
        if cmd == name and isinstance(rows, str):
            import importlib

            return int(importlib.import_module(rows).run(args))
    signal.signal(signal.SIGTERM, _on_sigterm)
    out = Path(args.out) if getattr(args, "out", "") else None
    try:
        if cmd == "load":
            return _load(args)
        if cmd == "abuse":
            from .abuse import abuse

            abuse(attacks=O.names(args.attacks) or None, duration_s=args.duration, rate=args.rate, out=out)
            return 0
        if cmd == "prediction":
            from .prediction import prediction

            prediction(engine_url=args.engine, dialect=args.dialect, model=args.model, max_concurrency=args.max_concurrency,
                       lengths=[int(x) for x in args.lengths.split(",") if x], repeats=args.repeats, depth=args.depth, out=out)
            return 0
        if cmd == "split":
            from .split import split

            split(parts=O.names(args.parts), out=out, rate=args.rate, warm=args.warm, window=args.window, repeats=args.repeats, engines=args.engines, mode=args.mode,
                  cycle=args.cycle, sat_rates=O.floats(args.sat_rates), sat_window=args.sat_window, clients=args.clients, streams=args.streams,
                  interval_ms=args.interval_ms, relay_window=args.relay_window, alternations=args.alternations, ttft_rates=O.floats(args.ttft_rates),
                  ttft_duration=args.ttft_duration, ttft_rounds=args.ttft_rounds, layouts=O.names(args.layouts), quiet_wait=args.quiet_wait)
            return 0
        from . import experiments as X

        if cmd == "overhead":
            X.overhead(rate=args.rate, duration_s=args.duration, rounds=args.rounds, protocols=O.names(args.http), servers=O.names(args.servers),
                       output_tokens=args.output_tokens, tpot_ms=args.tpot_ms, stream=not args.no_stream, out=out, routers=O.names(args.routers))
        elif cmd == "relay":
            X.relay(streams=args.streams, interval_ms=args.interval_ms, tokens=args.tokens, warm_s=args.warm, window_s=args.window, servers=O.names(args.servers),
                    http=args.http, profile_s=args.profile, mode=args.mode, out=out, tracing=O.names(args.tracing) if args.tracing else (),
                    alternations=args.alternations, routers=O.names(args.routers), workers=args.workers)
        elif cmd == "memory":
            X.memory(streams=args.streams, interval_ms=args.interval_ms, ramp_s=args.ramp, hold_s=args.hold, servers=O.names(args.servers), out=out,
                     routers=O.names(args.routers), workers=args.workers)
        elif cmd == "peers":
            X.peers(names=O.names(args.peers), rates=O.floats(args.rates), duration_s=args.duration, output_tokens=args.output_tokens, tpot_ms=args.tpot_ms, out=out,
                    img=Path(args.img) if args.img else None)
        elif cmd == "overload":
            arms = [_ARM_KEYS[a] for a in O.names(args.arms)]
            from .overload import overload

            overload(scenario=args.scenario, loads=O.floats(args.loads), arms=arms, peer_names=O.names(args.peers), engines=args.engines, duration_s=args.duration,
                       drain_s=args.drain, trace=args.trace, queue_limit=args.queue_limit, out=out, img=Path(args.img) if args.img else None)
        return 0
    except KeyboardInterrupt:
        print("narwhal bench: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, FileNotFoundError, ValueError) as e:
        print(f"narwhal bench {cmd}: {e}", file=sys.stderr)
        return 1


def _load(args: argparse.Namespace) -> int:
    from .harness.client import make_client
    from .harness.load import (
        RequestShape,
        default_trace,
        fixed_rate,
        load_trace,
        run_loop,
        run_open_loop,
        trace_arrivals,
    )
    from .harness.processes import cpu_seconds
    from .harness.stats import LATENCY_HEADER, fmt_ms, latency_rows, markdown_table, summarize

    if (args.rate is None) == (args.trace is None):
        print("narwhal bench load: give exactly one of --rate or --trace", file=sys.stderr)
        return 2
    if args.trace:
        path = default_trace(args.trace) if args.trace in ("conv", "code") else Path(args.trace)
        arrivals, speedup = trace_arrivals(load_trace(path), duration_s=args.duration, rate=args.trace_rate, start_s=args.trace_start,
                                           prompt_scale=args.prompt_scale, output_scale=args.output_scale, max_output=args.max_output)
        what = f"trace {path.name} x{speedup:.2f} ({len(arrivals) / args.duration:.1f} req/s)"
    else:
        arrivals = fixed_rate(args.rate, args.duration, prompt_tokens=args.prompt_tokens, output_tokens=args.output_tokens, uniform=args.uniform, seed=args.seed)
        what = f"{args.rate:g} req/s {'uniform' if args.uniform else 'Poisson'}"
    headers = {}
    for h in args.header:
        k, _, v = h.partition(":")
        headers[k.strip()] = v.strip()
    try:
        mock = json.loads(args.mock)
    except json.JSONDecodeError as e:
        print(f"narwhal bench load: --mock is not JSON: {e}", file=sys.stderr)
        return 2
    shape = RequestShape(model=args.model, route=args.route, stream=not args.no_stream, mock=mock, mock_field=args.mock_field)

    async def go() -> list:
        c = make_client(args.url, args.http, headers=headers)
        try:
            return await run_open_loop(c, arrivals, shape, timeout_s=args.timeout, drain_s=args.drain)
        finally:
            await c.aclose()

    c0 = cpu_seconds(args.pid) if args.pid else None
    res = run_loop(go())
    s = summarize(res, duration_s=args.duration, ttft_target_s=(args.ttft_target_ms / 1000.0) if args.ttft_target_ms else None)
    print(f"{args.url}: {what}, {args.duration:g} s, HTTP/{'1.1' if args.http == '1' else '2'}, {'streaming' if shape.stream else 'non-streaming'}")
    print()
    print(markdown_table(LATENCY_HEADER, [latency_rows("load", s)]))
    print()
    extra = [["statuses", json.dumps(s["statuses"])], ["refusal rate", f"{s['refusal_rate']:.4f}"], ["refusal codes", json.dumps(s["refusal_codes"])],
             ["refusal latency p50/p99 ms", f"{fmt_ms(s['refusal_latency']['p50'])} / {fmt_ms(s['refusal_latency']['p99'])}"],
             ["errors", f"{s['errors']} {s['error_samples'][:2] if s['errors'] else ''}"], ["output tokens", s["tokens"]],
             ["load-tool send lag p50/p99 ms", f"{fmt_ms(s['send_lag']['p50'])} / {fmt_ms(s['send_lag']['p99'])}"]]
    if "goodput" in s:
        extra.append([f"goodput (TTFT <= {args.ttft_target_ms:g} ms, over offered)", f"{s['goodput']:.4f}"])
    if c0 is not None:
        cpu = cpu_seconds(args.pid) - c0
        extra.append(["router CPU s / per token event", f"{cpu:.2f} s / {cpu / max(1, s['tokens']) * 1e6:.0f} µs"])
    print(markdown_table(["measure", "value"], extra))
    if args.json:
        Path(args.json).write_text(json.dumps([r.as_dict() for r in res], default=str))
    return 0 if s["ok"] else 1
