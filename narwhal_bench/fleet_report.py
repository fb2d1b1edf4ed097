"""`narwhal bench fleet`'s records and its reading of them: how each request ended as the
client saw it (classify), the steps and the SIGTERM (StepRecord, SigtermRecord,
sigterm_times), the run summed up (analyse) and its tables. Pure: no processes, no I/O
(tests/bench/test_fleet_bench.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .harness.follow import Poll, Request
from .harness.stats import REFUSAL_STATUSES, Result, fmt_whole, markdown_table, percentile, to_ms

if TYPE_CHECKING:
    from .fleet import RunLog

__all__ = ["classify", "StepRecord", "SigtermRecord", "analyse", "tables", "sigterm_times", "request_rows", "REQUEST_FIELDS"]


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
            "new_active_ms": to_ms(s.new_active_s), "old_gone_ms": to_ms(s.old_gone_s), "ok": s.ok, "note": s.note,
            "requests": sum(c.values()), "ok_200": c["ok"], "refused": c["refused"], "failed": c["failed"], "cancelled": c["cancelled"],
            "longest_gap_ms": to_ms(max(g)) if g else None, **({"extra": s.extra} if s.extra else {}),
        })

    sig_out: dict[str, Any] | None = None
    if sig is not None:
        sig_out = {"leader": f"r{sig.leader}", "leader_503_ms": to_ms(sig.leader_503_s), "leader_closed_ms": to_ms(sig.leader_closed_s),
                   "leader_exit_ms": to_ms(sig.leader_exit_s), "leader_exit_code": sig.leader_exit_code,
                   "standby_ready_ms": to_ms(sig.standby_ready_s), "standby_won_ms": to_ms(sig.standby_won_s), "first_200_ms": to_ms(sig.first_200_s),
                   "in_flight_at_signal": sig.in_flight_at_signal, "in_flight_ok": sig.in_flight_ok}
        t_over = sig.first_200_s if sig.first_200_s is not None else None
        sig_out["takeover_ms"] = to_ms(max(x for x in (sig.standby_ready_s, t_over) if x is not None)) if (sig.standby_ready_s is not None or t_over is not None) else None
        sig_out["takeover_ok"] = sig.standby_ready_s is not None and sig.first_200_s is not None and max(sig.standby_ready_s, sig.first_200_s) < 1.0

    no_ra = sum(c[0] - c[1] for c in refused.values())
    requests_ok = n > 0 and outcomes["failed"] == 0 and outcomes["cancelled"] == 0 and no_ra == 0
    return {
        "offered": n, "ok_200": outcomes["ok"], "refused": sum(c[0] for c in refused.values()),
        "refused_by_row": {k: {"count": v[0], "with_retry_after": v[1]} for k, v in sorted(refused.items())},
        "refused_without_retry_after": no_ra,
        "failed": outcomes["failed"], "failed_by": dict(failed), "cancelled": outcomes["cancelled"], "cancelled_by": dict(cancelled),
        "longest_gap_ms": None if longest is None else to_ms(longest[0]), "longest_gap_at_s": None if longest is None else round(longest[1] - t_start, 2),
        "longest_gap_rid": None if longest is None else longest[2],
        "gap_p50_ms": to_ms(percentile(gap_values, 50)), "gap_p99_ms": to_ms(percentile(gap_values, 99)),
        "ttft_p50_ms": to_ms(percentile(ttfts, 50)), "ttft_p99_ms": to_ms(percentile(ttfts, 99)), "ttft_max_ms": to_ms(max(ttfts)) if ttfts else None,
        "steps": step_rows, "sigterm": sig_out, "books": books or {}, "fleet_changes": changes or {},
        "requests_ok": requests_ok,
        "ok": requests_ok and (sig_out is None or bool(sig_out["takeover_ok"])) and all(s.ok for s in steps),
    }


def tables(res: dict[str, Any]) -> str:
    """The Markdown the bench prints (and docs/operations.md publishes)."""
    out = []
    rows_ref = ", ".join(f"{k} {v['count']} ({v['with_retry_after']} with Retry-After)" for k, v in res["refused_by_row"].items()) or "0"
    failed = f"{res['failed']}" + (f" ({', '.join(f'{k}: {v}' for k, v in res['failed_by'].items())})" if res["failed_by"] else "")
    cancelled = f"{res['cancelled']}" + (f" ({', '.join(f'{k}: {v}' for k, v in res['cancelled_by'].items())})" if res["cancelled_by"] else "")
    out.append(markdown_table(
        ["requests offered", "answered 200 (whole stream, [DONE])", "refused, by row", "failed", "cancelled", "longest gap in a 200 stream, ms (at s)",
         "per-stream longest gap p50 / p99 ms", "TTFT p50 / p99 / max ms"],
        [[res["offered"], res["ok_200"], rows_ref, failed, cancelled, f"{fmt_whole(res['longest_gap_ms'])} ({fmt_whole(res['longest_gap_at_s'])})",
          f"{fmt_whole(res['gap_p50_ms'])} / {fmt_whole(res['gap_p99_ms'])}", f"{fmt_whole(res['ttft_p50_ms'])} / {fmt_whole(res['ttft_p99_ms'])} / {fmt_whole(res['ttft_max_ms'])}"]]))
    srows = []
    for s in res["steps"]:
        srows.append([s["n"], s["kind"], s["what"] + (f" — {s['note']}" if s["note"] else ""), f"{s['at_s']:.1f}", fmt_whole(s["new_active_ms"]), fmt_whole(s["old_gone_ms"]),
                      f"{s['requests']} / {s['ok_200']} / {s['refused']} / {s['failed']} / {s['cancelled']}", fmt_whole(s["longest_gap_ms"]), "ok" if s["ok"] else "NO"])
    out.append(markdown_table(["step", "source", "change", "at s", "new engine active on both routers, ms", "old engine gone from both, ms after its removal",
                               "requests sent until the next step: offered / 200 / refused / failed / cancelled", "longest gap ended in it, ms", "step done"], srows))
    sg = res.get("sigterm")
    if sg is not None:
        out.append(markdown_table(
            ["SIGTERM to the leader", "→ its /ready 503, ms", "→ its listener closed, ms", "→ it exited (code), ms", "→ standby elected, ms",
             "→ standby /ready 200, ms", "→ client's first 200 from the standby, ms", "streams in flight on the leader at the signal: answered 200", "take-over < 1 s"],
            [[sg["leader"], fmt_whole(sg["leader_503_ms"]), fmt_whole(sg["leader_closed_ms"]), f"{fmt_whole(sg['leader_exit_ms'])} ({fmt_whole(sg['leader_exit_code'])})", fmt_whole(sg["standby_won_ms"]),
              fmt_whole(sg["standby_ready_ms"]), fmt_whole(sg["first_200_ms"]), f"{sg['in_flight_at_signal']}: {sg['in_flight_ok']}", "yes" if sg["takeover_ok"] else "NO"]]))
    if res.get("books"):
        brows = []
        for name, b in res["books"].items():
            brows.append([name, b.get("when", ""), fmt_whole(b.get("offered")), ", ".join(f"{k} {v}" for k, v in sorted((b.get("terminal") or {}).items()) if v) or "—",
                          fmt_whole(b.get("open")), ", ".join(f"{k} {v}" for k, v in sorted((res.get("fleet_changes") or {}).get(name, {}).items()) if v) or "—"])
        out.append(markdown_table(["router", "books read", "narwhal_requests_offered_total", "narwhal_requests_terminal_total by class", "open",
                                   "narwhal_fleet_changes_total by change"], brows))
    return "\n\n".join(out)


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


def request_rows(log: RunLog) -> list[list[Any]]:
    def rel(v: float | None) -> float | None:
        return None if not v else round((v - log.t_start) * 1000.0, 1)

    out = []
    for q in log.requests:
        o, detail, ra = classify(q)
        r = q.attempts[-1].r if q.attempts else Result(scheduled=q.scheduled)
        out.append([q.rid, rel(q.first_sent), len(q.attempts), q.attempts[-1].router if q.attempts else None, r.status, r.code, o, detail, ra,
                    r.tokens, to_ms(r.extra.get("max_gap_s")), rel(r.headers_at), rel(r.done_at), r.error])
    return out


REQUEST_FIELDS = ["rid", "sent_ms", "attempts", "router", "status", "code", "outcome", "detail", "retry_after", "tokens", "max_gap_ms", "headers_ms", "done_ms", "error"]
