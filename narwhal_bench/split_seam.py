"""`narwhal bench split`'s seam: one admission authority driven by request cycles, in
this process (LocalDoor) or over the IPC channel from client processes (RemoteDoor ->
WorkerSession), and the machine's floor for a round trip. The rules: split.py's
docstring ("How"); the parts that use these: split.py.

Every loop is bounded in time and count; every client process is stopped by its PID.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import gc
import json
import math
import os
import signal
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from narwhal.core.lease import Order, Outcome
from narwhal.core.tickets import Refuse

from .harness.load import run_loop
from .harness.processes import cpu_seconds, python
from .harness.quiet import Others, machine
from .harness.stats import percentile

__all__ = ["authority", "drive", "client_main", "inproc", "ipc_arm", "floor", "summ", "pct", "us", "CLIENT_START_S", "ORDER_BYTES"]

CLIENT_START_S = 2.5  # a client interpreter's start-up (imports) before its first cycle
ORDER_BYTES = 256  # a 64-token prompt at the sizer's 4 bytes per token


# -- part 1: the seam's round trip -------------------------------------------------------------


def authority(engines: int, mode: str) -> Any:
    """A ControlPlane over `engines` fake unified engines (nothing listens; it is never
    started) and its LocalControls; limits out of reach, so only the decision is timed."""
    from narwhal.authority.control import ControlPlane
    from narwhal.authority.service import LocalControls
    from narwhal.config import parse_config
    from narwhal.upstream.engines import config_engines

    cfg = parse_config({
        "serving": {"model": "narwhal-demo"},
        "admission": {"mode": mode, "http_retention_limit": 1_000_000, "queue_limit": 1_000_000,
                      "phase_concurrency": {"prefill": 100_000, "decode": 100_000}},
        "monitoring": {"stale_after_ms": 1_000_000_000},  # no health polls here: R01 must not fire
        "engines": [{"name": f"u{i}", "url": f"http://127.0.0.1:{9 + i}", "role": "unified", "dialect": "vllm"} for i in range(engines)],
    }, source="narwhal bench split")
    return LocalControls(ControlPlane(cfg, config_engines(cfg)))


class _Window:
    """The cycles due in [w0, w1): each one's arrive and admit round trips, how late it
    left (µs), and (trace) when it started; counts of how every cycle ended."""

    def __init__(self, w0: float, w1: float, trace: bool) -> None:
        self.w0, self.w1, self.trace = w0, w1, trace
        self.arrive_us, self.admit_us, self.lag_us, self.at_s = array.array("d"), array.array("d"), array.array("d"), array.array("d")
        self.counts: Counter[str] = Counter()


async def _cycle(door: Any, due: float, full: bool, w: _Window) -> None:
    """One request cycle: arrive, admit, granted, then (full) first_token and close with a
    full Outcome or (minimal) close(at); end("completed"). A refusal ends it early."""
    perf = time.perf_counter
    t0 = perf()
    entry = await door.arrive(t0)
    t1 = perf()
    if isinstance(entry, Refuse):
        w.counts["refused " + entry.row.id] += 1
        return
    lease = await entry.admit(Order("chat", ORDER_BYTES, None, 16, 2000.0, t0, None))
    t2 = perf()
    if isinstance(lease, Refuse):
        entry.end(lease.row.counter)
        w.counts["refused " + lease.row.id] += 1
        return
    g = await lease.granted()
    if isinstance(g, Refuse):
        lease.close(Outcome(at=perf()))
        entry.end(g.row.counter)
        w.counts["refused " + g.row.id] += 1
        return
    if full:
        lease.first_token(perf())
        lease.close(Outcome(at=perf(), ok_engine=g.engine, tpot_s=0.010, tpot_engine=g.engine, output_tokens=16,
                            finish_reason="length", reported_prompt_tokens=64))
    else:
        lease.close(Outcome(at=perf()))
    entry.end("completed")
    if w.w0 <= due < w.w1:
        w.arrive_us.append((t1 - t0) * 1e6)
        w.admit_us.append((t2 - t1) * 1e6)
        w.lag_us.append((t0 - due) * 1e6)
        if w.trace:
            w.at_s.append(t0 - w.w0)
        w.counts["completed"] += 1


async def _process_cpu(w0: float, w1: float, cpu: dict[str, float]) -> None:
    """This process's CPU time (and the clock) at w0 and at w1, into cpu."""
    d = w0 - time.monotonic()
    if d > 0:
        await asyncio.sleep(d)
    cpu["t0"], cpu["c0"] = time.monotonic(), time.process_time()
    d = w1 - time.monotonic()
    if d > 0:
        await asyncio.sleep(d)
    cpu["t1"], cpu["c1"] = time.monotonic(), time.process_time()


async def drive(door: Any, p: dict[str, Any]) -> dict[str, Any]:
    """Open-loop cycles against `door` (LocalDoor or RemoteDoor) at p["rate"], from the
    instant p["start"] (time.monotonic) for p["warm_s"] + p["window_s"]; the cycles due
    in the window are recorded. Bounded: at most rate * (warm + window) cycles, then
    p["drain_s"] for the last answers."""
    loop = asyncio.get_running_loop()
    rate, start, full = float(p["rate"]), float(p["start"]), p["cycle"] == "full"
    w0 = start + float(p["warm_s"])
    w1 = w0 + float(p["window_s"])
    offset = float(p.get("offset", 0.0))
    w = _Window(w0, w1, bool(p.get("trace")))  # trace: keep each recorded cycle's start (at_s), for ad-hoc looks at the tails
    cpu: dict[str, float] = {}
    sampler = loop.create_task(_process_cpu(w0, w1, cpu))
    tasks: set[asyncio.Task[None]] = set()
    d = start - time.monotonic()
    late_start = max(0.0, -d)
    if d > 0:
        await asyncio.sleep(d)
    k = 0
    n = math.ceil((w1 - start) * rate)
    while k < n:
        due = start + offset + k / rate
        d = due - time.monotonic()
        if d > 0.0005:  # as the load tool (harness.load.open_loop): uvloop's timers tick in ms
            await asyncio.sleep(d)
            continue
        t = loop.create_task(_cycle(door, due, full, w))
        tasks.add(t)
        t.add_done_callback(tasks.discard)
        k += 1
        if k % 64 == 0:
            await asyncio.sleep(0)  # behind schedule: let the answers in
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(sampler, timeout=max(1.0, w1 - time.monotonic() + 1.0))
    if tasks:
        _, pending = await asyncio.wait(set(tasks), timeout=float(p.get("drain_s", 5.0)))
        for t in pending:
            t.cancel()
        if pending:
            w.counts["unanswered"] += len(pending)
    return {"arrive_us": w.arrive_us.tolist(), "admit_us": w.admit_us.tolist(), "lag_us": w.lag_us.tolist(), "at_s": w.at_s.tolist(), "counts": dict(w.counts),
            "window_s": cpu.get("t1", w1) - cpu.get("t0", w0), "cpu_s": cpu.get("c1", 0.0) - cpu.get("c0", 0.0), "late_start_s": late_start,
            "cycles_sent": k}


async def _client(fd: int, p: dict[str, Any]) -> dict[str, Any]:
    """The worker's side, in its own process: a Link on the channel, RemoteDoor."""
    from narwhal.worker.remote import Link, RemoteDoor

    loop = asyncio.get_running_loop()
    link = Link()
    link.hello.cancel()  # no Hello comes here (the authority side is a bare WorkerSession)
    await loop.create_unix_connection(lambda: link.channel, sock=socket.socket(fileno=fd))
    try:
        return await drive(RemoteDoor(link), p)
    finally:
        link.channel.close()


def client_main(argv: list[str]) -> int:
    """python -m narwhal_bench.split client FD PARAMS_JSON OUT_JSON"""
    fd, p, out = int(argv[0]), json.loads(argv[1]), Path(argv[2])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides
    import narwhal.worker.remote  # noqa: F401  (imported before the heap is frozen, as in a worker)

    gc.freeze()
    res = run_loop(_client(fd, p))
    out.write_text(json.dumps(res))
    return 0


class _GCWatch:
    """Collections in this process while it is on: count and longest pause per generation."""

    def __init__(self) -> None:
        self.t = 0.0
        self.stats: dict[int, list[float]] = {}
        self.on = False

    def __call__(self, phase_: str, info: dict[str, int]) -> None:
        if not self.on:
            return
        if phase_ == "start":
            self.t = time.perf_counter()
        else:
            self.stats.setdefault(info["generation"], []).append(time.perf_counter() - self.t)

    def __enter__(self) -> _GCWatch:
        self.stats = {}
        self.on = True
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self.on = False
        with contextlib.suppress(ValueError):
            gc.callbacks.remove(self)

    def summary(self) -> dict[str, Any]:
        return {f"gen{g}": {"n": len(v), "max_ms": max(v) * 1000.0} for g, v in sorted(self.stats.items())}


def _self_cpu() -> float:
    return cpu_seconds(os.getpid(), tree=False)


async def inproc(controls: Any, p: dict[str, Any]) -> dict[str, Any]:
    p = {**p, "start": time.monotonic() + 0.2}
    w0 = p["start"] + p["warm_s"]
    box: dict[str, float] = {}

    async def proc_sample() -> None:
        await asyncio.sleep(max(0.0, w0 - time.monotonic()))
        box["p0"], (box["m0"], _, box["t0"]) = _self_cpu(), machine()
        await asyncio.sleep(max(0.0, w0 + p["window_s"] - time.monotonic()))
        box["p1"], (box["m1"], _, box["t1"]) = _self_cpu(), machine()

    with _GCWatch() as gw:
        s = asyncio.ensure_future(proc_sample())
        res = await drive(controls.door, p)
        await s
    res["proc_cpu_s"] = box["p1"] - box["p0"]
    res["others_cores"] = max(0.0, box["m1"] - box["m0"] - res["proc_cpu_s"]) / (box["t1"] - box["t0"])
    res["gc"] = gw.summary()
    return res


class _Echo:
    """An authority that decides nothing: a bare ipc.Channel answering Arrive and Admit at
    once with a fixed Arrived and Admitted (the real authority's answers, taken once), and
    ignoring the rest. The channel and the two event loops' share of a round trip."""

    def __init__(self, controls: Any) -> None:
        from narwhal import ipc

        self.ipc = ipc
        self.arrived, self.admitted = _answers(controls)
        self.channel = ipc.Channel(self._on, lambda exc: None)

    def _on(self, m: Any) -> None:
        import dataclasses

        if type(m) is self.ipc.Arrive:
            self.channel.send(dataclasses.replace(self.arrived, rid=m.rid))
        elif type(m) is self.ipc.Admit:
            self.channel.send(dataclasses.replace(self.admitted, rid=m.rid))

    def close(self) -> None:
        self.channel.close()


def _answers(controls: Any) -> tuple[Any, Any]:
    """The authority's Arrived and Admitted for one request, from a WorkerSession whose
    writes are kept (no event loop turn needed: the writes are flushed by hand)."""
    from narwhal import ipc
    from narwhal.authority.channel import WorkerSession

    out: list[Any] = []

    class Keep:
        def write(self, data: bytes) -> None:
            pos = 0
            while pos < len(data):
                n = int.from_bytes(data[pos:pos + 4], "big")
                out.append(ipc.decode(data[pos + 4:pos + 4 + n]))
                pos += 4 + n

        def close(self) -> None:
            pass

        def abort(self) -> None:
            pass

    sess = WorkerSession(999, controls, on_up=lambda s, m: None, on_penalise=lambda s, a, x: None, on_lost=lambda s: None)
    sess.channel.connection_made(Keep())  # type: ignore[arg-type]
    at = time.monotonic()
    fields: dict[str, Any] = {f: _ADMIT.get(f, [] if "prefix" in f else None) for f in ipc.Admit.__dataclass_fields__ if f != "TAG"}
    admit = ipc.Admit(**{**fields, "rid": 1, "arrival": at})
    for m in (ipc.Arrive(1, at), admit):
        sess.channel.data_received(ipc.encode(m))
        sess.channel._flush()
    sess.channel.data_received(ipc.encode(ipc.End(1, "completed")))
    arrived = next(m for m in out if type(m) is ipc.Arrived)
    admitted = next(m for m in out if type(m) is ipc.Admitted)
    return arrived, admitted


_ADMIT: dict[str, Any] = {"route": "chat", "prompt_bytes": ORDER_BYTES, "max_tokens": 16, "budget_ms": 2000.0}


async def ipc_arm(controls: Any, p: dict[str, Any], clients: int, cpus: set[int] | None, tmp: Path, *, echo: bool = False) -> dict[str, Any]:
    """`clients` client processes, each with its own channel and WorkerSession here (or,
    with `echo`, an authority that decides nothing: _Echo)."""
    from narwhal.authority.channel import WorkerSession

    loop = asyncio.get_running_loop()
    start = time.monotonic() + CLIENT_START_S
    rate = float(p["rate"])
    procs: list[subprocess.Popen[bytes]] = []
    sessions: list[Any] = []
    outs: list[Path] = []

    def pre() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    try:
        for i in range(clients):
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            sess: Any = _Echo(controls) if echo else WorkerSession(i, controls, on_up=lambda s, m: None, on_penalise=lambda s, a, x: None, on_lost=lambda s: None)
            await loop.create_unix_connection(lambda s=sess: s.channel, sock=ours)  # type: ignore[misc]
            sessions.append(sess)
            out = tmp / f"client{i}.json"
            with contextlib.suppress(FileNotFoundError):
                out.unlink()
            outs.append(out)
            pi = {**p, "rate": rate / clients, "start": start, "offset": i / rate}
            try:
                procs.append(subprocess.Popen([python(), "-m", "narwhal_bench.split", "client", str(theirs.fileno()), json.dumps(pi), str(out)],
                                              pass_fds=(theirs.fileno(),), preexec_fn=pre, start_new_session=True, stdin=subprocess.DEVNULL))
            finally:
                theirs.close()
        w0 = start + p["warm_s"]
        w1 = w0 + p["window_s"]
        with _GCWatch() as gw:
            await asyncio.sleep(max(0.0, w0 - time.monotonic()))
            c0, q0, t0, m0 = _self_cpu(), time.process_time(), time.monotonic(), machine()
            await asyncio.sleep(max(0.0, w1 - time.monotonic()))
            c1, q1, t1, m1 = _self_cpu(), time.process_time(), time.monotonic(), machine()
        deadline = time.monotonic() + float(p.get("drain_s", 5.0)) + 20.0
        while any(pr.poll() is None for pr in procs) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        results = []
        for pr, out in zip(procs, outs, strict=True):
            if pr.poll() is None or pr.returncode != 0 or not out.exists():
                raise RuntimeError(f"split client pid {pr.pid} failed (exit {pr.poll()})")
            results.append(json.loads(out.read_text()))
    finally:
        for pr in procs:
            if pr.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pr.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    pr.wait(5)
        for s in sessions:
            s.close()
        await asyncio.sleep(0.05)  # let the sessions' losses run (End for anything still open)
    arrive = [x for r in results for x in r["arrive_us"]]
    admit = [x for r in results for x in r["admit_us"]]
    lag = [x for r in results for x in r["lag_us"]]
    at = [x for r in results for x in r["at_s"]]
    counts: Counter[str] = Counter()
    for r in results:
        counts.update(r["counts"])
    return {"arrive_us": arrive, "admit_us": admit, "lag_us": lag, "at_s": at, "counts": dict(counts), "window_s": t1 - t0,
            "authority_cpu_s": c1 - c0, "authority_cpu_s_precise": q1 - q0,
            "client_cpu_s": [r["cpu_s"] for r in results], "late_start_s": max(r["late_start_s"] for r in results), "gc": gw.summary(),
            # the rest of the machine over the window: every CPU's busy time minus ours
            "others_cores": max(0.0, m1[0] - m0[0] - (q1 - q0) - sum(r["cpu_s"] for r in results)) / (t1 - t0), "steal_s": m1[1] - m0[1],
            "channel_messages": [{"in": s.channel.received, "out": s.channel.sent} for s in sessions]}


def pct(xs: Sequence[float]) -> dict[str, float | None]:
    return {"p50": percentile(xs, 50), "p90": percentile(xs, 90), "p99": percentile(xs, 99), "max": max(xs) if xs else None}


def us(v: float | None) -> str:
    return "—" if v is None else f"{v:,.0f}" if v >= 100 else f"{v:.1f}"


def summ(r: dict[str, Any]) -> dict[str, Any]:
    n = r["counts"].get("completed", 0)
    both = [a + b for a, b in zip(r["arrive_us"], r["admit_us"], strict=True)]  # the request's whole wait for admission
    out = {"arrive": pct(r["arrive_us"]), "admit": pct(r["admit_us"]), "both": pct(both), "lag": pct(r["lag_us"]), "completed": n,
           "achieved_per_s": n / r["window_s"] if r["window_s"] else 0.0, "counts": r["counts"], "window_s": r["window_s"]}
    return out


_ECHO = "import socket, sys\ns = socket.socket(fileno=int(sys.argv[1]))\nwhile True:\n    d = s.recv(65536)\n    if not d:\n        break\n    s.sendall(d)\n"


def floor(rate: float, warm_s: float, window_s: float, cpus: set[int] | None) -> tuple[list[float], float]:
    """The machine's own floor for a round trip between two processes on different CPUs:
    a 16-byte message over the same kind of socket pair to an echo process (blocking
    calls, no event loop, no Python work on either side), paced at `rate`; µs."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)

    def pre() -> None:
        if cpus:
            os.sched_setaffinity(0, cpus)

    try:
        pr = subprocess.Popen([python(), "-c", _ECHO, str(b.fileno())], pass_fds=(b.fileno(),), preexec_fn=pre, start_new_session=True, stdin=subprocess.DEVNULL)
    finally:
        b.close()
    xs: list[float] = []
    try:
        a.settimeout(5.0)
        a.sendall(b"x" * 16)
        a.recv(65536)  # the echo is up
        n = int((warm_s + window_s) * rate)
        skip = int(warm_s * rate)
        oth = Others([pr.pid])
        start = time.monotonic()
        for k in range(n):
            d = start + k / rate - time.monotonic()
            if d > 0:
                time.sleep(d)
            t0 = time.perf_counter()
            a.sendall(b"x" * 16)
            got = 0
            while got < 16:
                got += len(a.recv(65536))
            if k >= skip:
                xs.append((time.perf_counter() - t0) * 1e6)
        others = oth.cores()
    finally:
        a.close()
        try:
            pr.wait(5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pr.pid, signal.SIGKILL)
            pr.wait(5)
    return xs, others
