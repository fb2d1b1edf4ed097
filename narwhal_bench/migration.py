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
  * Open-loop load (harness.load.open_loop): `--rate` streaming chat completions per second at
    uniform gaps, each with its own prompt (the request's number in the text),
    `max_tokens` --output-tokens, `ignore_eos: true`, `return_token_ids: true`, its
    own x-request-id. Per request (MigRec): status, whether the stream ended with
    `data: [DONE]` and no error event (fleet_report.classify), its token IDs (equal to the
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
    gap: a new mock started, PUT /admin/engines/{new} (harness.admin.Admin), wait until it is
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

from .fleet_report import classify
from .harness import Engine, narwhal_config, start_narwhal
from .harness import options as O
from .harness.admin import Admin, active, gone, wait_fleet
from .harness.client import H1Pool, SSERecorder
from .harness.follow import Attempt, Request, books_at_rest
from .harness.load import open_loop, run_loop
from .harness.options import opt
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
from .harness.report import commit, save
from .harness.stats import Result, fmt_whole, to_ms
from .migration_report import (
    KillRecord,
    RollStep,
    analyse_kill,
    analyse_roll,
    balanced,
    expected_ids,
    gaps,
    read_migrations,
    request_body,
    share,
    tables,
)

__all__ = ["add_arguments", "run", "main", "ARMS", "MReq", "MigRec", "run_arms"]

MODEL = "narwhal-demo"
TOKEN_ENV = "NARWHAL_ADMIN_TOKEN"
ARMS = ("kill-off", "kill-migrate", "roll-wait", "roll-migrate")
_clock = time.perf_counter  # the load client's clock (harness/client.py)


# -- arguments ---------------------------------------------------------------------------------


OPTIONS = (
    opt("--arms", default=",".join(ARMS), help=f"comma-separated, in order (default all: {','.join(ARMS)})"),
    opt("--rate", type=float, default=None, help="requests/s, uniform gaps (default 8; --quick 6)"),
    opt("--output-tokens", type=int, default=None, help="max_tokens of every answer, with ignore_eos (default 250; --quick 60)"),
    opt("--tpot-ms", type=float, default=20.0, help="the mocks' --tpot-base-ms (default 20: a 250-token answer streams ~5 s)"),
    opt("--prompt-tokens", type=int, default=64),
    opt("--duration", type=float, default=None, help="kill arms: seconds of arrivals (default 90; --quick 6)"),
    opt("--kill-every", type=float, default=None, help="kill arms: seconds between kills (default 4; --quick 2.5)"),
    opt("--lead-in", type=float, default=None, help="seconds of load before the first kill or replacement (default 6; --quick 1.5)"),
    opt("--after", type=float, default=None, help="roll arms: seconds of load planned after the roll (default 4; --quick 1)"),
    opt("--max-attempts", type=int, default=2, help="upstream.migration.max_attempts of the arms with migration (default 2)"),
    opt("--drain-timeout-ms", type=int, default=30000, help="discovery.drain_timeout_ms (default 30000: above the answers' length)"),
    opt("--prefill-slots", type=int, default=4, help="admission.phase_concurrency.prefill per engine (default 4, the config's)"),
    opt("--poll-interval-ms", type=int, default=500, help="monitoring.poll_interval_ms (default 500, the config's)"),
    opt("--timeout", type=float, default=60.0, help="per-request timeout, s (default 60)"),
    O.drain(30.0),
    opt("--quick", action="store_true", help="a short run of every arm (6 req/s of 60-token answers, 6 s of kills): a smoke test"),
    O.from_json("migration"),
    O.out("migration"),
)


add_arguments = O.adder(OPTIONS)


QUICK = (("rate", 8.0, 6.0), ("output_tokens", 250, 60), ("duration", 90.0, 6.0), ("kill_every", 4.0, 2.5),
          ("lead_in", 6.0, 1.5), ("after", 4.0, 1.0))  # (dest, a full run's default, --quick's)


def _arms(s: str) -> list[str]:
    arms = [a.strip() for a in s.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"unknown arm {bad[0] if bad else '(none)'!r}: choose from {', '.join(ARMS)}")
    return arms


# -- requests and what the client saw ----------------------------------------------------------


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
            fleet.note(f"kill {rec.n}: {name}, {len(rec.on_engine)} requests in its log, back after {fmt_whole(to_ms(rec.restart_s))} ms {rec.note}")
            n += 1

    reqs = run_loop(_load(fleet, a.duration, killer))
    res = analyse_kill(reqs, kills)
    res.update(arm=fleet.arm, max_attempts=max_attempts)
    return _finish(fleet, res, reqs, kill_log=[{"n": k.n, "engine": k.engine, "restart_ms": to_ms(k.restart_s), "in_log": len(k.on_engine), "note": k.note} for k in kills])


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
            fleet.note(f"step {st.n}: u{i} → n{i}: active after {fmt_whole(to_ms(st.active_s))} ms, gone {fmt_whole(to_ms(st.gone_s))} ms after DELETE ({st.lifecycle}) {st.note}")
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
    g = gaps(q.times)
    k = max(range(len(g)), key=g.__getitem__) if g else None
    end = None if k is None else round((q.times[k + 1][0] - t0) * 1000.0, 1)
    return [q.rid, round((q.r.sent - t0) * 1000.0, 1), q.r.status, o, detail, q.r.tokens, q.whole(), q.migrations, to_ms(g[k]) if k is not None else None, end, cut]


def run_arms(args: argparse.Namespace) -> dict[str, Any]:
    """Every arm in turn, each with its own processes; the run's results."""
    O.fill_defaults(args, QUICK)
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
            lines.append(f"kill-migrate: cut answers completed whole {share(s)} (target ≥ 0.99): {'met' if s is not None and s >= 0.99 else 'NOT met'}")
        elif a["arm"] == "kill-off":
            lines.append(f"kill-off: cut answers completed whole {share(a['cut_whole_share'])} (today's behaviour)")
        else:
            lines.append(f"{a['arm']}: failed {a['failed']}, refused {a['refused']}, cancelled {a['cancelled']} (target 0), rolling update {fmt_whole(a['roll_s'])} s")
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
    save(args.out, "migration", md, res)
    return 0


def _markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    head = (f"Stream migration under load: {m['rate']:g} req/s of {m['output_tokens']}-token streams (ignore_eos) at {m['tpot_ms']:g} ms/token, "
            f"4 sequence mock engines, one router (phase_concurrency.prefill {m.get('prefill_slots', 4)}); kills every {m['kill_every_s']:g} s for {m['duration_s']:g} s; max_attempts {m['max_attempts']}; "
            f"{m['date']}, commit {m['commit']}; {m['pinning']}.\nCommand: `{m['command']}`")
    return head + "\n\n" + tables(res) + "\n\n" + "\n".join(f"- {v}" for v in verdict(res)) + "\n"


def main(argv: list[str] | None = None) -> int:
    return O.main("narwhal_bench.migration", "Stream migration under load: engines killed and replaced (narwhal bench migration).", add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
