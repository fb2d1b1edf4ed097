"""`narwhal bench migration`'s records of the fleet's events (KillRecord, RollStep) and
its reading of an arm: streams cut by a kill (cut_at), the kill and roll arms summed up
(analyse_kill, analyse_roll), the routers' migration counters (read_migrations) and the
tables. Pure: no processes, no I/O (tests/bench/test_migration_bench.py)."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from narwhal.mock.scenarios import sequence_script
from narwhal.mock.tokens import prompt_token_ids

from .harness.stats import fmt_whole, markdown_table, percentile, to_ms

if TYPE_CHECKING:
    from .migration import MReq

__all__ = ["request_body", "expected_ids", "BYTES_PER_TOKEN", "gaps", "share", "KillRecord", "RollStep", "cut_at", "analyse_kill", "analyse_roll", "read_migrations", "balanced", "tables"]


MODEL = "narwhal-demo"
BYTES_PER_TOKEN = 4.0  # the mock's default text sizing
_SENTENCE = "Narwhals live in the Arctic and use their long tusks to sense the water around them. "


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


def _pct(xs: Sequence[float], q: float) -> float | None:
    return to_ms(percentile(list(xs), q))


def gaps(times: Sequence[tuple[float, int]]) -> list[float]:
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
    token_gaps = [g for q in untouched for g in gaps(q.times)]
    max_gaps = [max(gaps(q.times)) for q in untouched if len(q.times) > 1]
    mig_max = [max(gaps(q.times)) for q in reqs if q.migrations > 0 and len(q.times) > 1]
    restarts = [k.restart_s for k in kills if k.restart_s is not None]
    out.update({
        "kills": len(kills), "kills_failed_restart": sum(1 for k in kills if k.restart_s is None),
        "restart_p50_ms": _pct(restarts, 50), "restart_max_ms": to_ms(max(restarts)) if restarts else None,
        "cut": len(cut_reqs), "cut_events": sum(len(v) for v in cut.values()), "cut_twice": sum(1 for v in cut.values() if len(v) > 1),
        "cut_whole": cut_whole, "cut_whole_share": round(cut_whole / len(cut_reqs), 4) if cut_reqs else None,
        "cut_outcomes": dict(Counter(q.outcome[1] if q.outcome[0] != "ok" else ("ok, whole" if q.whole(want.get(q.rid)) else "ok, NOT whole") for q in cut_reqs).most_common()),
        "cut_without_token_after": no_resume,
        "on_killed_engine_before_first_token": len(pre_reqs), "of_those_whole": sum(1 for q in pre_reqs if q.whole(want.get(q.rid))),
        "migrated_not_attributed": sum(1 for q in reqs if q.migrations > 0 and q.rid not in cut),
        "cut_gap_p50_ms": _pct(cut_gaps, 50), "cut_gap_p99_ms": _pct(cut_gaps, 99), "cut_gap_max_ms": to_ms(max(cut_gaps)) if cut_gaps else None,
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
    mig_max = [max(gaps(q.times)) for q in reqs if q.migrations > 0 and len(q.times) > 1]
    plain_max = [max(gaps(q.times)) for q in reqs if q.migrations == 0 and q.outcome[0] == "ok" and len(q.times) > 1]
    ok = all(s.ok for s in steps) and len(ends) == len(steps) > 0
    out.update({
        "steps": [{"n": s.n, "old": s.old, "new": s.new, "new_started_to_put_ms": to_ms(None if s.t_put is None else s.t_put - s.t_start),
                   "active_after_put_ms": to_ms(s.active_s), "gone_after_delete_ms": to_ms(s.gone_s), "lifecycle": s.lifecycle, "ok": s.ok, "note": s.note}
                  for s in steps],
        "roll_ok": ok,
        "roll_s": round(max(ends) - min(puts), 2) if ok and puts else None,
        "drain_sum_s": round(sum(s.gone_s for s in steps if s.gone_s is not None), 2),
        "gone_max_ms": to_ms(max((s.gone_s for s in steps if s.gone_s is not None), default=None)),
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


def share(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def _books(a: dict[str, Any]) -> str:
    b = a.get("books") or {}
    terms = ", ".join(f"{k} {v}" for k, v in sorted((b.get("terminal") or {}).items()) if v) or "—"
    return f"{fmt_whole(b.get('offered'))} → {terms}; open {fmt_whole(b.get('open'))}: {'balanced' if a.get('balanced') else 'NOT balanced'}"


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
            [[a["arm"], a["max_attempts"], a["offered"], f"{a['completed_whole']} ({share(a['whole_share'])})", _failed(a), _refused(a), a["cancelled"],
              f"{a['kills']} ({fmt_whole(a['restart_p50_ms'])})", f"{a['cut']} ({a['cut_twice']} twice)", f"{a['cut_whole']} (**{share(a['cut_whole_share'])}**)",
              f"{a['of_those_whole']} of {a['on_killed_engine_before_first_token']}",
              f"{a['migrated']} ({', '.join(f'{k}×: {v}' for k, v in a['migrated_by_count'].items()) or '—'})", a["completed_not_whole"]] for a in kill]))
        out.append(markdown_table(
            ["arm", "gap at the cut p50 / p99 / max ms", "cuts whose stream did not go on", "migrated answer's longest gap p50 / p99 ms",
             "baseline: token gap p50 / p99 ms", "baseline: an answer's longest gap p50 / p99 ms"],
            [[a["arm"], f"{fmt_whole(a['cut_gap_p50_ms'])} / {fmt_whole(a['cut_gap_p99_ms'])} / {fmt_whole(a['cut_gap_max_ms'])}", a["cut_without_token_after"],
              f"{fmt_whole(a['migrated_max_gap_p50_ms'])} / {fmt_whole(a['migrated_max_gap_p99_ms'])}",
              f"{fmt_whole(a['baseline_token_gap_p50_ms'])} / {fmt_whole(a['baseline_token_gap_p99_ms'])}",
              f"{fmt_whole(a['baseline_max_gap_p50_ms'])} / {fmt_whole(a['baseline_max_gap_p99_ms'])}"] for a in kill]))
    if roll:
        out.append(markdown_table(
            ["arm", "discovery.drain", "offered", "completed whole (share)", "failed", "refused", "cancelled", "rolling update, s (first PUT → last gone)",
             "new engine active after its PUT, ms", "old engine gone after its DELETE, ms", "migrated answers (whole)", "migrated answer's longest gap p50 / p99 ms", "others' longest gap p50 / p99 ms"],
            [[a["arm"], a["drain"], a["offered"], f"{a['completed_whole']} ({share(a['whole_share'])})", _failed(a), _refused(a), a["cancelled"],
              fmt_whole(a["roll_s"]) if a["roll_s"] is None else f"{a['roll_s']:.2f}", " / ".join(fmt_whole(s["active_after_put_ms"]) for s in a["steps"]),
              " / ".join(fmt_whole(s["gone_after_delete_ms"]) for s in a["steps"]),
              f"{a['migrated']} ({a['migrated_whole']})", f"{fmt_whole(a['migrated_max_gap_p50_ms'])} / {fmt_whole(a['migrated_max_gap_p99_ms'])}",
              f"{fmt_whole(a['unmigrated_max_gap_p50_ms'])} / {fmt_whole(a['unmigrated_max_gap_p99_ms'])}"] for a in roll]))
    out.append(markdown_table(["arm", "router's books: offered → terminal classes", "narwhal_migrations_total by decision"],
                              [[a["arm"], _books(a), _migs(a)] for a in res["arms"]]))
    return "\n\n".join(out)
