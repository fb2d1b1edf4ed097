"""`narwhal bench migration`: stream migration (issue 24) measured under load, with engines
killed and engines replaced.

    narwhal bench migration [--arms kill-off,kill-migrate,roll-wait,roll-migrate] [--rate 8]
        [--output-tokens 250] [--tpot-ms 20] [--duration 90] [--kill-every 4] [--quick]
        [--out out/bench/migration]
    python -m narwhal_bench.migration ...            (the same, without the `narwhal bench` entry)

Every arm
  * Four `narwhal mock-engine --sequence-output` processes (vllm dialect, unified,
    `--tpot-base-ms` = --tpot-ms): each answers as a function of the whole token
    sequence, so a migrated answer equals the uninterrupted one exactly, and the expected
    answer of every request is computed here (narwhal.mock.tokens.prompt_token_ids, then
    narwhal.mock.scenarios.sequence_script with max_tokens and ignore_eos) without any
    engine. One `narwhal serve` (harness.start_narwhal: pinned to the router CPU,
    admission.mode open, no profiling) in front of them, `admin.token_env` set.
  * Open-loop load (load.open_loop): `--rate` streaming chat completions per second at
    uniform gaps, each with its own prompt (the request's number in the text),
    `max_tokens` --output-tokens, `ignore_eos: true`, `return_token_ids: true`, its
    own x-request-id. Per request (MigRec): status, whether the stream ended with
    `data: [DONE]` and no error event (fleet.classify), its token IDs (equal to the
    expected answer whole or not), the `: x-narwhal-migrations N` comment, and the time
    of every event that carried tokens.

Kill arms (`kill-off`: upstream.migration.max_attempts 0, today's behaviour;
`kill-migrate`: --max-attempts, default 2)
  * From --lead-in on, every --kill-every seconds, one engine (round robin) is sent
    SIGKILL (its process group) and started again on the same port; the router's health
    polling (monitoring.poll_interval_ms) brings it back. Just before the signal the
    engine's own request log (GET /mock/requests) is read: an answer is *cut* by that
    kill when its x-request-id is there, its client had received a token by the kill and
    had not received all of them. An answer on the killed engine that had no token yet
    is counted apart (before response headers a failure is retried from scratch, T05).
  * The gap at the cut: for each cut, the time between the last token the client had
    before the kill and the first one after (none when the stream ended). Baseline: the
    gaps between tokens of answers never cut.

Rolling-update arms (`roll-wait`: discovery.drain wait; `roll-migrate`: discovery.drain
migrate; both with --max-attempts and discovery.drain_timeout_ms --drain-timeout-ms)
  * The same load; after --lead-in each engine in turn is replaced without a capacity
    gap: a new mock started, PUT /admin/engines/{new} (fleet.Admin), wait until it is
    active on /v1/engines, DELETE /admin/engines/{old}, wait until it is gone, stop its
    process, next. Per step: new engine active after its PUT, old engine gone after its
    DELETE; in all: the roll's time from the first PUT to the last engine gone. The load
    runs a fixed time long enough for the slowest roll (the same in both arms).

At rest, every arm: the router's books (/metrics: offered, terminal classes, open;
balanced when offered == sum of the terminal classes and nothing is open) and
narwhal_migrations_total{cause,decision}.

Targets (issue 24): cut answers completed whole >= 99% with migration, ~0% without;
no request failed in a rolling update. Every loop is bounded in time and count; every
process started here runs in its own session and is stopped by its own process group in a
`finally`. Output: Markdown on stdout and, with --out, migration.md and migration.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as _dt
import json
import os
import re
import secrets
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from narwhal.mock.scenarios import sequence_script
from narwhal.mock.tokens import prompt_token_ids

from .fleet_report import classify
from .harness import Engine, narwhal_config, start_narwhal
from .harness.admin import Admin, active, gone, wait_fleet
from .harness.client import H1Pool, SSERecorder
from .harness.follow import Attempt, Request, books_at_rest
from .harness.load import open_loop, run_loop
from .harness.processes import (
    Proc,
    command_line,
    free_port,
    layout,
    log_dir,
    pin_self,
    python,
    run_bench,
    wait_http,
)
from .harness.report import commit
from .harness.stats import Result, markdown_table, percentile

__all__ = ["add_arguments", "run", "main", "ARMS", "MReq", "MigRec", "KillRecord", "RollStep", "expected_ids", "request_body",
           "analyse_kill", "analyse_roll", "read_migrations", "tables"]

MODEL = "narwhal-demo"
TOKEN_ENV = "NARWHAL_ADMIN_TOKEN"
ARMS = ("kill-off", "kill-migrate", "roll-wait", "roll-migrate")
BYTES_PER_TOKEN = 4.0  # the mock's default text sizing
_clock = time.perf_counter  # the load client's clock (client.py)
_SENTENCE = "Narwhals live in the Arctic and use their long tusks to sense the water around them. "


# -- arguments ---------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, in order (default all: {','.join(ARMS)})")
    p.add_argument("--rate", type=float, default=None, help="requests/s, uniform gaps (default 8; --quick 6)")
    p.add_argument("--output-tokens", type=int, default=None, help="max_tokens of every answer, with ignore_eos (default 250; --quick 60)")
    p.add_argument("--tpot-ms", type=float, default=20.0, help="the mocks' --tpot-base-ms (default 20: a 250-token answer streams ~5 s)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--duration", type=float, default=None, help="kill arms: seconds of arrivals (default 90; --quick 6)")
    p.add_argument("--kill-every", type=float, default=None, help="kill arms: seconds between kills (default 4; --quick 2.5)")
    p.add_argument("--lead-in", type=float, default=None, help="seconds of load before the first kill or replacement (default 6; --quick 1.5)")
    p.add_argument("--after", type=float, default=None, help="roll arms: seconds of load planned after the roll (default 4; --quick 1)")
    p.add_argument("--max-attempts", type=int, default=2, help="upstream.migration.max_attempts of the arms with migration (default 2)")
    p.add_argument("--drain-timeout-ms", type=int, default=30000, help="discovery.drain_timeout_ms (default 30000: above the answers' length)")
    p.add_argument("--prefill-slots", type=int, default=4, help="admission.phase_concurrency.prefill per engine (default 4, the config's)")
    p.add_argument("--poll-interval-ms", type=int, default=500, help="monitoring.poll_interval_ms (default 500, the config's)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, s (default 60)")
    p.add_argument("--drain", type=float, default=30.0, help="wait at most this long for open requests after the last arrival (default 30)")
    p.add_argument("--quick", action="store_true", help="a short run of every arm (6 req/s of 60-token answers, 6 s of kills): a smoke test")
    p.add_argument("--from-json", default=None, help="print the tables of a saved migration.json again (no run)")
    p.add_argument("--out", default="out/bench/migration", help="save migration.md and migration.json here (default out/bench/migration; '' to skip)")


def _defaults(args: argparse.Namespace) -> None:
    q = bool(getattr(args, "quick", False))
    for k, full, quick in (("rate", 8.0, 6.0), ("output_tokens", 250, 60), ("duration", 90.0, 6.0), ("kill_every", 4.0, 2.5),
                           ("lead_in", 6.0, 1.5), ("after", 4.0, 1.0)):
        if getattr(args, k, None) is None:
            setattr(args, k, quick if q else full)


def _arms(s: str) -> list[str]:
    arms = [a.strip() for a in s.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"unknown arm {bad[0] if bad else '(none)'!r}: choose from {', '.join(ARMS)}")
    return arms


# -- requests and what the client saw ----------------------------------------------------------


def request_body(k: int, prompt_tokens: int, output_tokens: int) -> dict[str, Any]:
    """Request k's body: its own prompt (~prompt_tokens tokens at the mock's 4 bytes per
    token, 3 for the message), a fixed-length answer."""
    head = f"Request {k}: tell me a long story about narwhals. "
    want = max(len(head), round((prompt_tokens - 3) * BYTES_PER_TOKEN))
    text = (head + _SENTENCE * (want // len(_SENTENCE) + 1))[:want]
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": output_tokens, "ignore_eos": True,
            "stream": True, "return_token_ids": True, "stream_options": {"include_usage": True}}


def expected_ids(body: dict[str, Any]) -> list[int]:
    """The uninterrupted answer's token IDs (the sequence mock's, computed here)."""
    prompt = prompt_token_ids("chat", body, BYTES_PER_TOKEN)
    return [p.token_id for p in sequence_script(prompt, max_tokens=body["max_tokens"], ignore_eos=True).pieces]


class MigRec(SSERecorder):
    """SSERecorder that also keeps the answer's token IDs, the SSE comments, and
    (time, tokens) of every event that carried tokens."""

    __slots__ = ("ids", "times", "comments")

    def __init__(self, result: Result) -> None:
        super().__init__(result)
        self.ids: list[int] = []
        self.times: list[tuple[float, int]] = []
        self.comments: list[str] = []

    def _event(self, ev: bytes, now: float) -> None:
        if b"\n:" in ev or ev.startswith(b":"):
            self.comments.extend(ln[1:].strip().decode("utf-8", "replace") for ln in ev.split(b"\n") if ln.startswith(b":"))
            if b"data:" not in ev:
                return
        before = self.r.tokens
        super()._event(ev, now)
        got = self.r.tokens - before
        if got <= 0:
            return
        self.times.append((now, got))
        for line in ev.split(b"\n"):
            if line.startswith(b"data:"):
                with contextlib.suppress(orjson.JSONDecodeError):
                    obj = orjson.loads(line[5:].strip())
                    choices = obj.get("choices") if type(obj) is dict else None
                    for c in choices if type(choices) is list else ():
                        if type(c) is dict and type(c.get("token_ids")) is list:
                            self.ids.extend(c["token_ids"])

    def migrations(self) -> int:
        for c in self.comments:
            m = re.fullmatch(r"x-narwhal-migrations (\d+)", c)
            if m:
                return int(m.group(1))
        return 0


@dataclass
class MReq:
    """One offered request."""

    rid: str
    k: int
    body: dict[str, Any]
    r: Result
    rec: MigRec | None = None

    @property
    def outcome(self) -> tuple[str, str]:
        o, detail, _ = classify(Request(self.rid, self.r.scheduled, [Attempt(0, self.r)]))
        return o, detail

    @property
    def times(self) -> list[tuple[float, int]]:
        return self.rec.times if self.rec is not None else []

    @property
    def migrations(self) -> int:
        return self.rec.migrations() if self.rec is not None else 0

    def whole(self, want: list[int] | None = None) -> bool:
        """Completed ([DONE], no error event) with exactly the expected token IDs."""
        if self.rec is None or self.outcome[0] != "ok":
            return False
        return self.rec.ids == (want if want is not None else expected_ids(self.body))


async def _send(pool: H1Pool, q: MReq, timeout_s: float) -> None:
    q.rec = MigRec(q.r)
    try:
        await pool.request("POST", "/v1/chat/completions", orjson.dumps(q.body), q.rec, headers={"x-request-id": q.rid}, timeout_s=timeout_s)
    except asyncio.CancelledError:
        q.r.error = q.r.error or "cut at end of run"
        raise


# -- records of the fleet's events -------------------------------------------------------------


@dataclass
class KillRecord:
    n: int
    engine: str
    t_kill: float  # perf_counter, just before SIGKILL
    on_engine: list[str]  # x-request-ids in the engine's request log just before the signal
    restart_s: float | None = None  # the signal -> the new process answers /health
    note: str = ""


@dataclass
class RollStep:
    n: int
    old: str
    new: str
    t_start: float  # the new engine's process started
    t_put: float | None = None
    active_s: float | None = None  # PUT -> active on /v1/engines
    t_delete: float | None = None
    gone_s: float | None = None  # DELETE -> gone from /v1/engines
    lifecycle: str | None = None  # DELETE's answer
    ok: bool = True
    note: str = ""


# -- analysis (pure: tests/bench/test_migration_bench.py) ---------------------------------------


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 1)


def _pct(xs: Sequence[float], q: float) -> float | None:
    return _ms(percentile(list(xs), q))


def _gaps(times: Sequence[tuple[float, int]]) -> list[float]:
    return [b[0] - a[0] for a, b in zip(times, times[1:], strict=False)]


def cut_at(times: Sequence[tuple[float, int]], t_kill: float, want_tokens: int, *, settle_s: float = 0.1, window_s: float = 1.0) -> tuple[bool, float | None]:
    """(cut, gap): was the answer streaming at t_kill (a token before it, not all of them),
    and the pause the client saw there: the longest gap between consecutive tokens where
    the later one came after t_kill and the earlier one by t_kill + window_s (tokens the
    engine sent just before the kill may reach the client just after it). None: the
    stream did not go on (no token later than t_kill + settle_s)."""
    before = [(t, n) for t, n in times if t <= t_kill]
    if not before or sum(n for _, n in before) >= want_tokens:
        return False, None
    if not any(t > t_kill + settle_s for t, _ in times):
        return True, None
    pairs = [(a[0], b[0]) for a, b in zip(times, times[1:], strict=False) if b[0] > t_kill and a[0] <= t_kill + window_s]
    return True, max(b - a for a, b in pairs)


def _common(reqs: Sequence[MReq], want: dict[str, list[int]]) -> dict[str, Any]:
    outcomes: Counter[str] = Counter()
    failed: Counter[str] = Counter()
    refused: Counter[str] = Counter()
    whole = not_whole = 0
    for q in reqs:
        o, detail = q.outcome
        outcomes[o] += 1
        if o == "failed":
            failed[detail] += 1
        elif o == "refused":
            refused[detail] += 1
        if o == "ok":
            if q.whole(want.get(q.rid)):
                whole += 1
            else:
                not_whole += 1
    n = len(reqs)
    migrated = [q for q in reqs if q.migrations > 0]
    return {
        "offered": n, "completed": outcomes["ok"], "completed_whole": whole, "whole_share": round(whole / n, 4) if n else None,
        "completed_not_whole": not_whole, "refused": outcomes["refused"], "refused_by": dict(refused.most_common()), "failed": outcomes["failed"], "failed_by": dict(failed.most_common()),
        "cancelled": outcomes["cancelled"], "migrated": len(migrated), "migrated_by_count": {str(k): v for k, v in sorted(Counter(q.migrations for q in migrated).items())},
        "migrated_whole": sum(1 for q in migrated if q.whole(want.get(q.rid))),
    }


def analyse_kill(reqs: Sequence[MReq], kills: Sequence[KillRecord], want: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Everything a kill arm's tables show, from the client's records and the kills."""
    want = want if want is not None else {q.rid: expected_ids(q.body) for q in reqs}
    out = _common(reqs, want)
    by_rid = {q.rid: q for q in reqs}
    cut: dict[str, list[int]] = {}  # rid -> the kills that cut it
    prefill: set[str] = set()  # on a killed engine before their first token
    cut_gaps: list[float] = []
    no_resume = 0
    for k in kills:
        for rid in k.on_engine:
            q = by_rid.get(rid)
            if q is None:
                continue
            r = q.r
            if r.done_at is not None and r.done_at <= k.t_kill:
                continue
            is_cut, gap = cut_at(q.times, k.t_kill, q.body["max_tokens"])
            if is_cut:
                cut.setdefault(rid, []).append(k.n)
                if gap is None:
                    no_resume += 1
                else:
                    cut_gaps.append(gap)
            elif not any(t <= k.t_kill for t, _ in q.times):
                prefill.add(rid)
    cut_reqs = [by_rid[r] for r in cut]
    cut_whole = sum(1 for q in cut_reqs if q.whole(want.get(q.rid)))
    pre_reqs = [by_rid[r] for r in prefill - set(cut)]
    untouched = [q for q in reqs if q.rid not in cut and q.migrations == 0 and q.outcome[0] == "ok"]
    token_gaps = [g for q in untouched for g in _gaps(q.times)]
    max_gaps = [max(_gaps(q.times)) for q in untouched if len(q.times) > 1]
    mig_max = [max(_gaps(q.times)) for q in reqs if q.migrations > 0 and len(q.times) > 1]
    restarts = [k.restart_s for k in kills if k.restart_s is not None]
    out.update({
        "kills": len(kills), "kills_failed_restart": sum(1 for k in kills if k.restart_s is None),
        "restart_p50_ms": _pct(restarts, 50), "restart_max_ms": _ms(max(restarts)) if restarts else None,
        "cut": len(cut_reqs), "cut_events": sum(len(v) for v in cut.values()), "cut_twice": sum(1 for v in cut.values() if len(v) > 1),
        "cut_whole": cut_whole, "cut_whole_share": round(cut_whole / len(cut_reqs), 4) if cut_reqs else None,
        "cut_outcomes": dict(Counter(q.outcome[1] if q.outcome[0] != "ok" else ("ok, whole" if q.whole(want.get(q.rid)) else "ok, NOT whole") for q in cut_reqs).most_common()),
        "cut_without_token_after": no_resume,
        "on_killed_engine_before_first_token": len(pre_reqs), "of_those_whole": sum(1 for q in pre_reqs if q.whole(want.get(q.rid))),
        "migrated_not_attributed": sum(1 for q in reqs if q.migrations > 0 and q.rid not in cut),
        "cut_gap_p50_ms": _pct(cut_gaps, 50), "cut_gap_p99_ms": _pct(cut_gaps, 99), "cut_gap_max_ms": _ms(max(cut_gaps)) if cut_gaps else None,
        "migrated_max_gap_p50_ms": _pct(mig_max, 50), "migrated_max_gap_p99_ms": _pct(mig_max, 99),
        "baseline_token_gap_p50_ms": _pct(token_gaps, 50), "baseline_token_gap_p99_ms": _pct(token_gaps, 99),
        "baseline_max_gap_p50_ms": _pct(max_gaps, 50), "baseline_max_gap_p99_ms": _pct(max_gaps, 99),
        "cut_by": {r: v for r, v in cut.items()},
    })
    return out


def analyse_roll(reqs: Sequence[MReq], steps: Sequence[RollStep], want: dict[str, list[int]] | None = None) -> dict[str, Any]:
    """Everything a rolling-update arm's tables show."""
    want = want if want is not None else {q.rid: expected_ids(q.body) for q in reqs}
    out = _common(reqs, want)
    puts = [s.t_put for s in steps if s.t_put is not None]
    ends = [s.t_delete + s.gone_s for s in steps if s.t_delete is not None and s.gone_s is not None]
    mig_max = [max(_gaps(q.times)) for q in reqs if q.migrations > 0 and len(q.times) > 1]
    plain_max = [max(_gaps(q.times)) for q in reqs if q.migrations == 0 and q.outcome[0] == "ok" and len(q.times) > 1]
    ok = all(s.ok for s in steps) and len(ends) == len(steps) > 0
    out.update({
        "steps": [{"n": s.n, "old": s.old, "new": s.new, "new_started_to_put_ms": _ms(None if s.t_put is None else s.t_put - s.t_start),
                   "active_after_put_ms": _ms(s.active_s), "gone_after_delete_ms": _ms(s.gone_s), "lifecycle": s.lifecycle, "ok": s.ok, "note": s.note}
                  for s in steps],
        "roll_ok": ok,
        "roll_s": round(max(ends) - min(puts), 2) if ok and puts else None,
        "drain_sum_s": round(sum(s.gone_s for s in steps if s.gone_s is not None), 2),
        "gone_max_ms": _ms(max((s.gone_s for s in steps if s.gone_s is not None), default=None)),
        "migrated_max_gap_p50_ms": _pct(mig_max, 50), "migrated_max_gap_p99_ms": _pct(mig_max, 99),
        "unmigrated_max_gap_p50_ms": _pct(plain_max, 50), "unmigrated_max_gap_p99_ms": _pct(plain_max, 99),
    })
    return out


_MIG = re.compile(r"^narwhal_migrations_total\{([^}]*)\} ([0-9.eE+-]+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def read_migrations(metrics_text: str) -> dict[str, dict[str, int]]:
    """narwhal_migrations_total summed over workers: {"by_decision": {...}, "by_cause": {...}}."""
    dec: Counter[str] = Counter()
    cause: Counter[str] = Counter()
    for line in metrics_text.splitlines():
        m = _MIG.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group(1)))
        v = int(float(m.group(2)))
        if v:
            dec[labels.get("decision", "?")] += v
            cause[labels.get("cause", "?")] += v
    return {"by_decision": dict(sorted(dec.items())), "by_cause": dict(sorted(cause.items()))}


def balanced(b: dict[str, Any]) -> bool:
    return b.get("offered") is not None and b.get("open") == 0 and b["offered"] == sum((b.get("terminal") or {}).values())


# -- tables ---------------------------------------------------------------------------------------


def _f(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.0f}"
    return str(v)


def _share(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _books(a: dict[str, Any]) -> str:
    b = a.get("books") or {}
    terms = ", ".join(f"{k} {v}" for k, v in sorted((b.get("terminal") or {}).items()) if v) or "—"
    return f"{_f(b.get('offered'))} → {terms}; open {_f(b.get('open'))}: {'balanced' if a.get('balanced') else 'NOT balanced'}"


def _migs(a: dict[str, Any]) -> str:
    m = (a.get("migrations_total") or {}).get("by_decision") or {}
    return ", ".join(f"{k} {v}" for k, v in m.items()) or "0"


def _failed(a: dict[str, Any]) -> str:
    fb = a.get("failed_by") or {}
    return f"{a['failed']}" + (f" ({', '.join(f'{k}: {v}' for k, v in fb.items() if v)})" if a["failed"] else "")


def _refused(a: dict[str, Any]) -> str:
    rb = a.get("refused_by") or {}
    return f"{a['refused']}" + (f" ({', '.join(f'{k}: {v}' for k, v in rb.items())})" if a["refused"] else "")


def tables(res: dict[str, Any]) -> str:
    """The Markdown the bench prints (and docs/performance.md publishes)."""
    out = []
    kill = [a for a in res["arms"] if a["arm"].startswith("kill-")]
    roll = [a for a in res["arms"] if a["arm"].startswith("roll-")]
    if kill:
        out.append(markdown_table(
            ["arm", "max_attempts", "offered", "completed whole (share)", "failed", "refused", "cancelled", "kills (restart p50 ms)", "cut by a kill",
             "cut, completed whole (share)", "on a killed engine before a token: whole", "migrated answers (by count)", "completed but NOT whole"],
            [[a["arm"], a["max_attempts"], a["offered"], f"{a['completed_whole']} ({_share(a['whole_share'])})", _failed(a), _refused(a), a["cancelled"],
              f"{a['kills']} ({_f(a['restart_p50_ms'])})", f"{a['cut']} ({a['cut_twice']} twice)", f"{a['cut_whole']} (**{_share(a['cut_whole_share'])}**)",
              f"{a['of_those_whole']} of {a['on_killed_engine_before_first_token']}",
              f"{a['migrated']} ({', '.join(f'{k}×: {v}' for k, v in a['migrated_by_count'].items()) or '—'})", a["completed_not_whole"]] for a in kill]))
        out.append(markdown_table(
            ["arm", "gap at the cut p50 / p99 / max ms", "cuts whose stream did not go on", "migrated answer's longest gap p50 / p99 ms",
             "baseline: token gap p50 / p99 ms", "baseline: an answer's longest gap p50 / p99 ms"],
            [[a["arm"], f"{_f(a['cut_gap_p50_ms'])} / {_f(a['cut_gap_p99_ms'])} / {_f(a['cut_gap_max_ms'])}", a["cut_without_token_after"],
              f"{_f(a['migrated_max_gap_p50_ms'])} / {_f(a['migrated_max_gap_p99_ms'])}",
              f"{_f(a['baseline_token_gap_p50_ms'])} / {_f(a['baseline_token_gap_p99_ms'])}",
              f"{_f(a['baseline_max_gap_p50_ms'])} / {_f(a['baseline_max_gap_p99_ms'])}"] for a in kill]))
    if roll:
        out.append(markdown_table(
            ["arm", "discovery.drain", "offered", "completed whole (share)", "failed", "refused", "cancelled", "rolling update, s (first PUT → last gone)",
             "new engine active after its PUT, ms", "old engine gone after its DELETE, ms", "migrated answers (whole)", "migrated answer's longest gap p50 / p99 ms", "others' longest gap p50 / p99 ms"],
            [[a["arm"], a["drain"], a["offered"], f"{a['completed_whole']} ({_share(a['whole_share'])})", _failed(a), _refused(a), a["cancelled"],
              _f(a["roll_s"]) if a["roll_s"] is None else f"{a['roll_s']:.2f}", " / ".join(_f(s["active_after_put_ms"]) for s in a["steps"]),
              " / ".join(_f(s["gone_after_delete_ms"]) for s in a["steps"]),
              f"{a['migrated']} ({a['migrated_whole']})", f"{_f(a['migrated_max_gap_p50_ms'])} / {_f(a['migrated_max_gap_p99_ms'])}",
              f"{_f(a['unmigrated_max_gap_p50_ms'])} / {_f(a['unmigrated_max_gap_p99_ms'])}"] for a in roll]))
    out.append(markdown_table(["arm", "router's books: offered → terminal classes", "narwhal_migrations_total by decision"],
                              [[a["arm"], _books(a), _migs(a)] for a in res["arms"]]))
    return "\n\n".join(out)


# -- processes --------------------------------------------------------------------------------


class Fleet:
    """Four sequence mocks and one router of an arm; `stop()` ends every process it started."""

    def __init__(self, arm: str, args: argparse.Namespace, rcpu: set[int] | None, lcpu: set[int] | None, token: str) -> None:
        self.arm, self.args, self.rcpu, self.lcpu = arm, args, rcpu, lcpu
        self.admin = Admin(token)
        self.mocks: dict[str, Engine] = {}
        self.gen: Counter[str] = Counter()
        self.retired: list[Proc] = []
        self.router: Any = None
        self.log: list[str] = []

    def note(self, msg: str) -> None:
        self.log.append(f"{_dt.datetime.now(_dt.UTC).strftime('%H:%M:%S')} {msg}")
        print(f"narwhal bench migration [{self.arm}]: {msg}", file=sys.stderr, flush=True)

    def _proc(self, name: str, port: int) -> Proc:
        self.gen[name] += 1
        argv = [python(), "-m", "narwhal.mock", "--dialect", "vllm", "--role", "unified", "--port", str(port), "--model", MODEL, "--name", name,
                "--sequence-output", "--tpot-base-ms", str(self.args.tpot_ms)]
        return Proc(f"migration-{self.arm}-{name}-{self.gen[name]}", argv, cpus=self.lcpu).start()

    def start_mocks(self, names: Sequence[str]) -> list[Engine]:
        """Start them all, then wait for each (faster than one by one)."""
        started = []
        for n in names:
            port = free_port()
            m = Engine(n, "unified", f"http://127.0.0.1:{port}", self._proc(n, port))
            self.mocks[n] = m
            started.append(m)
        for m in started:
            wait_http(m.url + "/health", proc=m.proc, timeout_s=30)
        return started

    def start(self, upstream: dict[str, Any], discovery: dict[str, Any]) -> None:
        a = self.args
        ms = self.start_mocks([f"u{i}" for i in range(4)])
        cfg = narwhal_config(ms, model=MODEL,
                             admission={"mode": "open", "prediction": {"profile_on_start": False}, "phase_concurrency": {"prefill": a.prefill_slots, "decode": 8192}},
                             monitoring={"poll_interval_ms": a.poll_interval_ms}, upstream=upstream)
        cfg["admin"] = {"token_env": TOKEN_ENV}
        cfg["discovery"] = discovery
        self.router = start_narwhal(cfg, cpus=self.rcpu, name=f"migration-{self.arm}-router", timeout_s=60)
        self.note(f"router {self.router.url} (log {self.router.proc.log_path}), engines {', '.join(f'{m.name} {m.url}' for m in ms)}")

    def kill_restart(self, n: int, name: str) -> KillRecord:
        """Read the engine's request log, SIGKILL its process group, start it again on the
        same port and wait for its /health (bounded: 5 starts, 30 s each)."""
        import httpx

        m = self.mocks[name]
        try:
            recs = httpx.get(m.url + "/mock/requests", timeout=2.0, trust_env=False).json()
            on = [r["x_request_id"] for r in recs if r.get("x_request_id")]
            note = ""
        except (httpx.HTTPError, ValueError) as e:
            on, note = [], f"request log not read: {type(e).__name__}"
        t_kill = _clock()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(m.proc.pid, signal.SIGKILL)
        if m.proc.p is not None:
            m.proc.p.wait(10)
        rec = KillRecord(n, name, t_kill, on, note=note)
        port = int(m.url.rsplit(":", 1)[1])
        for _ in range(5):
            p = self._proc(name, port)
            self.mocks[name] = Engine(name, "unified", m.url, p)
            try:
                wait_http(m.url + "/health", proc=p, timeout_s=30)
                rec.restart_s = _clock() - t_kill
                break
            except (RuntimeError, TimeoutError) as e:
                p.stop()
                rec.note = (rec.note + f"; restart failed: {str(e).splitlines()[0][:120]}").lstrip("; ")
                time.sleep(0.5)
        return rec

    def replace(self, n: int, old: str, new: str) -> RollStep:
        """The new engine started and active, then the old one removed and gone."""
        url = self.router.url
        limit = self.args.drain_timeout_ms / 1000.0 + 15.0
        st = RollStep(n, old, new, _clock())
        (m,) = self.start_mocks([new])
        st.t_put = _clock()
        self.admin.put(url, m)
        t_act = wait_fleet([url], active(new), 30.0)
        if t_act is None:
            st.ok, st.note = False, f"{new} not active after 30 s; {old} left in place"
            return st
        st.active_s = t_act - st.t_put
        st.t_delete = _clock()
        st.lifecycle = self.admin.delete(url, old).get("lifecycle")
        t_gone = wait_fleet([url], gone(old), limit)
        if t_gone is None:
            st.ok, st.note = False, f"{old} still listed after {limit:g} s"
            return st
        st.gone_s = t_gone - st.t_delete
        old_m = self.mocks.pop(old)
        old_m.proc.stop()
        return st

    def stop(self) -> None:
        if self.router is not None:
            with contextlib.suppress(Exception):
                self.router.stop()
        for m in self.mocks.values():
            with contextlib.suppress(Exception):
                m.proc.stop()


# -- the arms ---------------------------------------------------------------------------------------


async def _load(fleet: Fleet, duration_s: float, events: Any) -> list[MReq]:
    """Open-loop arrivals for duration_s, with `events()` (the kills or the roll) beside
    them; returns once every request ended (bounded by --drain) and `events` is done."""
    a = fleet.args
    pool = H1Pool(fleet.router.url)
    reqs: list[MReq] = []
    offsets = [k / a.rate for k in range(max(1, round(duration_s * a.rate)))]
    tag = fleet.arm.replace("-", "")

    async def start(i: int, target: float) -> None:
        q = MReq(f"mig-{tag}-{i:06d}", i, request_body(i, a.prompt_tokens, a.output_tokens), Result(scheduled=target, output_tokens=a.output_tokens))
        reqs.append(q)
        await _send(pool, q, a.timeout)

    ev = asyncio.create_task(events())
    try:
        await open_loop(offsets, start, drain_s=a.drain)
        await asyncio.wait_for(asyncio.shield(ev), timeout=a.drain_timeout_ms / 1000.0 * 4 + 120.0)
    finally:
        if not ev.done():
            ev.cancel()
            await asyncio.gather(ev, return_exceptions=True)
        await pool.aclose()
    return reqs


def _kill_arm(fleet: Fleet, max_attempts: int) -> dict[str, Any]:
    a = fleet.args
    fleet.start({"migration": {"max_attempts": max_attempts}}, {"drain_timeout_ms": a.drain_timeout_ms})
    kills: list[KillRecord] = []

    async def killer() -> None:
        t0 = _clock()
        n = 0
        while a.lead_in + n * a.kill_every <= a.duration:
            d = t0 + a.lead_in + n * a.kill_every - _clock()
            if d > 0:
                await asyncio.sleep(d)
            name = f"u{n % 4}"
            rec = await asyncio.to_thread(fleet.kill_restart, n + 1, name)
            kills.append(rec)
            fleet.note(f"kill {rec.n}: {name}, {len(rec.on_engine)} requests in its log, back after {_f(_ms(rec.restart_s))} ms {rec.note}")
            n += 1

    reqs = run_loop(_load(fleet, a.duration, killer))
    res = analyse_kill(reqs, kills)
    res.update(arm=fleet.arm, max_attempts=max_attempts)
    return _finish(fleet, res, reqs, kill_log=[{"n": k.n, "engine": k.engine, "restart_ms": _ms(k.restart_s), "in_log": len(k.on_engine), "note": k.note} for k in kills])


def _roll_duration(a: argparse.Namespace) -> float:
    """Arrivals of a rolling-update arm: long enough for four drains that wait for the
    longest answer, the same in both arms."""
    answer_s = float(a.output_tokens) * float(a.tpot_ms) / 1000.0
    return float(a.lead_in) + 4 * (answer_s + (1.0 if a.quick else 2.5)) + float(a.after)


def _roll_arm(fleet: Fleet, drain: str, max_attempts: int) -> dict[str, Any]:
    a = fleet.args
    fleet.start({"migration": {"max_attempts": max_attempts}}, {"drain": drain, "drain_timeout_ms": a.drain_timeout_ms})
    steps: list[RollStep] = []

    async def roll() -> None:
        await asyncio.sleep(a.lead_in)
        for i in range(4):
            try:
                st = await asyncio.to_thread(fleet.replace, i + 1, f"u{i}", f"n{i}")
            except Exception as e:  # noqa: BLE001 - recorded; the roll stops here
                st = RollStep(i + 1, f"u{i}", f"n{i}", _clock(), ok=False, note=f"{type(e).__name__}: {e}"[:200])
            steps.append(st)
            fleet.note(f"step {st.n}: u{i} → n{i}: active after {_f(_ms(st.active_s))} ms, gone {_f(_ms(st.gone_s))} ms after DELETE ({st.lifecycle}) {st.note}")
            if not st.ok:
                return

    duration = _roll_duration(a)
    reqs = run_loop(_load(fleet, duration, roll))
    res = analyse_roll(reqs, steps)
    res.update(arm=fleet.arm, drain=drain, max_attempts=max_attempts, load_s=round(duration, 1))
    return _finish(fleet, res, reqs)


def _finish(fleet: Fleet, res: dict[str, Any], reqs: Sequence[MReq], **extra: Any) -> dict[str, Any]:
    import httpx

    url = fleet.router.url
    b = books_at_rest(url)
    res["books"] = b
    res["balanced"] = balanced(b)
    res["migrations_total"] = read_migrations(httpx.get(url + "/metrics", timeout=5.0, trust_env=False).text)
    res["router_log"] = str(fleet.router.proc.log_path)
    res["log"] = fleet.log
    res.update(extra)
    cut_by = res.pop("cut_by", {})
    t0 = min((q.r.sent for q in reqs if q.r.sent), default=0.0)
    res["requests"] = [_row(q, cut_by.get(q.rid), t0) for q in reqs]
    fleet.note(f"offered {res['offered']}, completed whole {res['completed_whole']}, failed {res['failed']}; books {'balanced' if res['balanced'] else 'NOT balanced'}")
    return res


REQUEST_FIELDS = ["rid", "sent_ms", "status", "outcome", "detail", "tokens", "whole", "migrations", "longest_gap_ms", "longest_gap_end_ms", "cut_by_kills"]


def _row(q: MReq, cut: list[int] | None, t0: float) -> list[Any]:
    o, detail = q.outcome
    g = _gaps(q.times)
    k = max(range(len(g)), key=g.__getitem__) if g else None
    end = None if k is None else round((q.times[k + 1][0] - t0) * 1000.0, 1)
    return [q.rid, round((q.r.sent - t0) * 1000.0, 1), q.r.status, o, detail, q.r.tokens, q.whole(), q.migrations, _ms(g[k]) if k is not None else None, end, cut]


def run_arms(args: argparse.Namespace) -> dict[str, Any]:
    """Every arm in turn, each with its own processes; the run's results."""
    _defaults(args)
    arms = _arms(args.arms)
    rcpu, lcpu = layout()
    token = secrets.token_hex(16)
    old_env = os.environ.get(TOKEN_ENV)
    os.environ[TOKEN_ENV] = token  # the routers inherit it (harness.start_narwhal)
    pinned = os.sched_getaffinity(0)
    pin_self(lcpu)
    out: list[dict[str, Any]] = []
    try:
        for arm in arms:
            fleet = Fleet(arm, args, rcpu, lcpu, token)
            try:
                if arm == "kill-off":
                    out.append(_kill_arm(fleet, 0))
                elif arm == "kill-migrate":
                    out.append(_kill_arm(fleet, args.max_attempts))
                elif arm == "roll-wait":
                    out.append(_roll_arm(fleet, "wait", args.max_attempts))
                else:
                    out.append(_roll_arm(fleet, "migrate", args.max_attempts))
            finally:
                fleet.stop()
    finally:
        os.sched_setaffinity(0, pinned)
        if old_env is None:
            os.environ.pop(TOKEN_ENV, None)
        else:
            os.environ[TOKEN_ENV] = old_env
    meta = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%d %H:%M UTC"), "commit": commit(), "command": command_line("narwhal_bench.migration"),
            "cpus": os.cpu_count(), "pinning": "not pinned" if rcpu is None else f"router on CPU {sorted(rcpu)}; engines and client on CPU {sorted(lcpu or ())}",
            "rate": args.rate, "output_tokens": args.output_tokens, "tpot_ms": args.tpot_ms, "prompt_tokens": args.prompt_tokens, "duration_s": args.duration,
            "kill_every_s": args.kill_every, "lead_in_s": args.lead_in, "max_attempts": args.max_attempts, "drain_timeout_ms": args.drain_timeout_ms,
            "poll_interval_ms": args.poll_interval_ms, "prefill_slots": args.prefill_slots, "logs": str(log_dir())}
    return {"meta": meta, "arms": out, "request_fields": REQUEST_FIELDS}


def verdict(res: dict[str, Any]) -> list[str]:
    """The targets, one line each."""
    lines = []
    for a in res["arms"]:
        if a["arm"] == "kill-migrate":
            s = a["cut_whole_share"]
            lines.append(f"kill-migrate: cut answers completed whole {_share(s)} (target ≥ 0.99): {'met' if s is not None and s >= 0.99 else 'NOT met'}")
        elif a["arm"] == "kill-off":
            lines.append(f"kill-off: cut answers completed whole {_share(a['cut_whole_share'])} (today's behaviour)")
        else:
            lines.append(f"{a['arm']}: failed {a['failed']}, refused {a['refused']}, cancelled {a['cancelled']} (target 0), rolling update {_f(a['roll_s'])} s")
        if not a["balanced"]:
            lines.append(f"{a['arm']}: the router's books are NOT balanced")
    return lines


def run(args: argparse.Namespace) -> int:
    if getattr(args, "from_json", None):
        print(_markdown(json.loads(Path(args.from_json).read_text())))
        return 0
    rc, res = run_bench("migration", lambda: run_arms(args))
    if rc:
        return rc
    md = _markdown(res)
    print(md)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "migration.md").write_text(md)
        (out / "migration.json").write_text(json.dumps(res, indent=1, default=str))
    return 0


def _markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    head = (f"Stream migration under load: {m['rate']:g} req/s of {m['output_tokens']}-token streams (ignore_eos) at {m['tpot_ms']:g} ms/token, "
            f"4 sequence mock engines, one router (phase_concurrency.prefill {m.get('prefill_slots', 4)}); kills every {m['kill_every_s']:g} s for {m['duration_s']:g} s; max_attempts {m['max_attempts']}; "
            f"{m['date']}, commit {m['commit']}; {m['pinning']}.\nCommand: `{m['command']}`")
    return head + "\n\n" + tables(res) + "\n\n" + "\n".join(f"- {v}" for v in verdict(res)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m narwhal_bench.migration", description="Stream migration under load: engines killed and replaced (narwhal bench migration).")
    add_arguments(p)
    return run(p.parse_args(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
