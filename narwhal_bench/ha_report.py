"""`narwhal bench ha`'s reading of its rounds: one round's failover times, requests,
double admissions and books (analyse), the rounds of one TTL summed up (summarize_ttl),
and the Markdown tables. Pure: no processes, no I/O (the rules: ha.py's docstring)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from .harness.follow import Attempt, Request
from .harness.stats import markdown_table, percentile, to_ms

if TYPE_CHECKING:
    from .ha import LoadRun, Router

__all__ = ["analyse", "summarize_ttl", "tables", "attempt_rows", "ATTEMPT_FIELDS"]


def analyse(run: LoadRun, rs: list[Router], books: dict[int, dict[str, Any]], ha: dict[int, dict[str, Any] | None], engine: Counter[str], cfg: dict[str, int]) -> dict[str, Any]:
    t0 = run.t0
    assert t0 is not None and run.killed is not None
    killed = run.killed
    survivors = [i for i in range(len(rs)) if i != killed]
    atts = [(q, a) for q in run.requests for a in q.attempts]

    # failover times
    admits = [a for _, a in atts if a.router != killed and a.r.status == 200 and a.r.headers_at is not None and a.r.headers_at > t0]
    first = min(admits, key=lambda a: a.r.headers_at or 0.0) if admits else None
    t_admit = None if first is None else first.r.headers_at - t0  # type: ignore[operator]
    readies = [p for p in run.polls if p.router != killed and p.status == 200 and p.sent > t0 and p.answered is not None]
    ready_first = min(readies, key=lambda p: p.answered or 0.0) if readies else None
    t_ready = None if ready_first is None else ready_first.answered - t0  # type: ignore[operator]
    won: dict[int, float] = {}
    for i in survivors:
        for h in (ha.get(i) or {}).get("history", []):
            if h.get("to") == "leader" and h["at"] > t0 - 0.001:
                won[i] = min(won.get(i, h["at"]), h["at"])
    new_leader = first.router if first is not None else (ready_first.router if ready_first is not None else None)
    t_won = None if new_leader is None or new_leader not in won else won[new_leader] - t0
    ttl_ms = cfg["lease_ttl_ms"]

    # the lease: the old leader's last renewal (read just before the kill), and the key in etcd
    t_due = None
    lh = run.leader_ha
    if lh is not None and lh.get("fence_in_ms") is not None and run.leader_ha_at is not None:
        sent = run.leader_ha_at + (lh["fence_in_ms"] + cfg["fence_margin_ms"] - ttl_ms) / 1000.0
        t_due = sent + ttl_ms / 1000.0 - t0  # etcd may expire the lease from here on (renewal received >= sent)
    old_rev = next((k.create_revision for k in run.keys if k.answered <= t0 and k.create_revision is not None), None)
    gone = next((k for k in run.keys if k.answered > t0 and k.create_revision is None), None)
    new_key = next((k for k in run.keys if k.answered > t0 and k.create_revision is not None and k.create_revision != old_rev), None)
    new_token = (ha.get(new_leader) or {}).get("fencing_token") if new_leader is not None else None

    # requests, overall and in the window [t0, t0 + t_admit)
    overall = _counts(run.requests)
    end_w = t0 + (t_admit if t_admit is not None else float("inf"))
    in_window = [q for q in run.requests if t0 <= q.first_sent < end_w]
    window = _counts(in_window)
    window["refused_share"] = round(window["refused"] / window["requests"], 4) if window["requests"] else None
    window["seconds"] = None if t_admit is None else round(t_admit, 3)
    inflight = [q for q in run.requests if q.first_sent < t0 and q.outcome == "failed"]
    kinds = Counter(a.kind for _, a in atts)
    errors = Counter((a.r.error or f"HTTP {a.r.status} {a.r.code}")[:80] for _, a in atts if a.kind == "error")

    twice_client, twice_engine, engine_seen = _twice(run, atts, engine)
    bk, books_ok = _books(books, atts, {i: rs[i].name for i in survivors})

    target_s = ttl_ms / 1000.0 + 1.0
    return {
        "killed": rs[killed].name, "new_leader": None if new_leader is None else rs[new_leader].name,
        "ready_first": None if ready_first is None else rs[ready_first.router].name,
        "since_last_renewal_ms": None if t_due is None else to_ms(ttl_ms / 1000.0 - t_due),
        "t0_to_lease_due_ms": to_ms(t_due), "t0_to_key_gone_seen_ms": None if gone is None else to_ms(gone.answered - t0),
        "t0_to_new_key_seen_ms": None if new_key is None else to_ms(new_key.answered - t0),
        "old_token": lh.get("fencing_token") if lh else None, "new_key_revision": None if new_key is None else new_key.create_revision,
        "new_key_holder": None if new_key is None else new_key.holder, "new_token": new_token,
        "t0_to_won_ms": to_ms(t_won), "t0_to_ready_ms": to_ms(t_ready), "t0_to_first_200_ms": to_ms(t_admit),
        "first_200_sent_ms": None if first is None else to_ms(first.r.sent - t0),
        "overall": overall, "window": window, "failed_in_flight_at_kill": len(inflight), "attempts": dict(kinds), "other_errors": dict(errors),
        "admitted_twice_client": twice_client, "admitted_twice_engine": twice_engine, "engine_requests": engine_seen,
        "client_200": sum(1 for _, a in atts if a.r.status == 200),
        "books": bk, "books_ok": books_ok,
        "target_s": target_s, "failover_ok": t_admit is not None and t_admit <= target_s,
        "ok": t_admit is not None and t_admit <= target_s and not twice_client and not twice_engine and books_ok,
    }


def attempt_rows(run: LoadRun, rs: list[Router]) -> list[list[Any]]:
    t0 = run.t0 if run.t0 is not None else run.t_start

    def rel(v: float | None) -> float | None:
        return None if not v else round((v - t0) * 1000.0, 2)

    return [[q.rid, n, rs[a.router].name, rel(a.r.sent), a.r.status, a.r.code, a.kind, rel(a.r.headers_at), rel(a.r.done_at), a.r.tokens, a.r.error]
            for q in run.requests for n, a in enumerate(q.attempts)]


ATTEMPT_FIELDS = ["rid", "attempt", "router", "sent_ms", "status", "code", "kind", "headers_ms", "done_ms", "tokens", "error"]

def _counts(qs: Sequence[Request]) -> dict[str, Any]:
    c = Counter(q.outcome for q in qs)
    return {"requests": len(qs), "completed": c["completed"], "refused": c["refused"], "failed": c["failed"], "error": c["error"]}


def _twice(run: LoadRun, atts: Sequence[tuple[Request, Attempt]], engine: Counter[str]) -> tuple[list[str], list[str], int]:
    """Request ids answered 200 by two routers (client side); ids the engine received more
    than once; how many of this run's ids the engine received."""
    by_rid: dict[str, set[int]] = {}
    for q, a in atts:
        if a.r.status == 200:
            by_rid.setdefault(q.rid, set()).add(a.router)
    twice_client = sorted(rid for rid, s in by_rid.items() if len(s) > 1)
    ours = {q.rid for q in run.requests}
    twice_engine = sorted(rid for rid, n in engine.items() if n > 1 and rid in ours)
    return twice_client, twice_engine, sum(1 for rid in engine if rid in ours)


def _books(books: dict[int, dict[str, Any]], atts: Sequence[tuple[Request, Attempt]], names: dict[int, str]) -> tuple[dict[str, Any], bool]:
    """Per survivor (index -> name): its books balance at rest and match what the client
    saw of it; and whether every survivor's do."""
    bk: dict[str, Any] = {}
    books_ok = True
    for i, name in names.items():
        b = books[i]
        mine = [a for _, a in atts if a.router == i]
        answered = sum(1 for a in mine if a.r.status != 0)
        ok200 = sum(1 for a in mine if a.kind == "completed")
        r01 = sum(1 for a in mine if a.kind == "refused")
        term = sum(b["terminal"].values())
        balance = b["offered"] == term and b["open"] == 0
        match = b["offered"] == answered and b["terminal"].get("completed") == ok200 and b["terminal"].get("unavailable") == r01
        books_ok = books_ok and balance and match
        bk[name] = {"offered": b["offered"], "terminal_sum": term, "open": b["open"], "terminal": b["terminal"], "balance": balance,
                    "client_answered": answered, "client_completed": ok200, "client_r01": r01, "matches_client": match}
    return bk, books_ok


def _med(xs: list[float]) -> float | None:
    m = percentile(xs, 50)
    return None if m is None else round(m, 1)


def summarize_ttl(rounds: list[dict[str, Any]], ttl_ms: int) -> dict[str, Any]:
    ok = [r for r in rounds if "error" not in r]
    adm = [r["t0_to_first_200_ms"] for r in ok if r["t0_to_first_200_ms"] is not None]
    rdy = [r["t0_to_ready_ms"] for r in ok if r["t0_to_ready_ms"] is not None]
    won = [r["t0_to_won_ms"] for r in ok if r["t0_to_won_ms"] is not None]
    due_won = [r["t0_to_won_ms"] - r["t0_to_lease_due_ms"] for r in ok if r["t0_to_won_ms"] is not None and r["t0_to_lease_due_ms"] is not None]
    won_adm = [r["t0_to_first_200_ms"] - r["t0_to_won_ms"] for r in ok if r["t0_to_won_ms"] is not None and r["t0_to_first_200_ms"] is not None]
    wreq = sum(r["window"]["requests"] for r in ok)
    wref = sum(r["window"]["refused"] for r in ok)
    return {
        "ttl_ms": ttl_ms, "rounds": len(rounds), "rounds_failed_to_run": len(rounds) - len(ok),
        "first_200_ms": {"median": _med(adm), "max": round(max(adm), 1) if adm else None},
        "ready_ms": {"median": _med(rdy), "max": round(max(rdy), 1) if rdy else None},
        "won_ms": {"median": _med(won), "max": round(max(won), 1) if won else None},
        "lease_due_to_won_ms": {"median": _med(due_won), "max": round(max(due_won), 1) if due_won else None},
        "won_to_first_200_ms": {"median": _med(won_adm), "max": round(max(won_adm), 1) if won_adm else None},
        "requests": sum(r["overall"]["requests"] for r in ok), "completed": sum(r["overall"]["completed"] for r in ok),
        "refused": sum(r["overall"]["refused"] for r in ok), "failed": sum(r["overall"]["failed"] for r in ok), "error": sum(r["overall"]["error"] for r in ok),
        "window_requests": wreq, "window_refused": wref, "window_failed": sum(r["window"]["failed"] for r in ok),
        "window_refused_share": round(wref / wreq, 4) if wreq else None,
        "failed_in_flight_at_kill": sum(r["failed_in_flight_at_kill"] for r in ok),
        "admitted_twice": sum(len(r["admitted_twice_client"]) + len(r["admitted_twice_engine"]) for r in ok),
        "books_ok": all(r["books_ok"] for r in ok) and bool(ok),
        "target_ms": ttl_ms + 1000, "failover_ok": bool(ok) and all(r["failover_ok"] for r in ok) and len(ok) == len(rounds),
        "ok": bool(ok) and len(ok) == len(rounds) and all(r["ok"] for r in ok),
    }


def _f(v: float | None) -> str:
    return "—" if v is None else f"{v:.0f}"


def _pct(v: float | None) -> str:
    return "—" if v is None else f"{100.0 * v:.0f} %"


def tables(rounds: list[dict[str, Any]], summary: list[dict[str, Any]]) -> str:
    head = ["TTL ms", "rounds", "failover to first 200, median / max ms", "to /ready 200, median / max ms", "to elected, median / max ms",
            "lease due → elected, median / max ms", "elected → first 200, median / max ms",
            "requests (completed / refused / failed / other)", "in the window: requests, refused (share), failed", "failed in flight at the kill",
            "admitted twice", "books balance", "≤ TTL + 1 s"]
    rows = []
    for s in summary:
        rows.append([s["ttl_ms"], s["rounds"], f"{_f(s['first_200_ms']['median'])} / {_f(s['first_200_ms']['max'])}",
                     f"{_f(s['ready_ms']['median'])} / {_f(s['ready_ms']['max'])}", f"{_f(s['won_ms']['median'])} / {_f(s['won_ms']['max'])}",
                     f"{_f(s['lease_due_to_won_ms']['median'])} / {_f(s['lease_due_to_won_ms']['max'])}",
                     f"{_f(s['won_to_first_200_ms']['median'])} / {_f(s['won_to_first_200_ms']['max'])}",
                     f"{s['requests']} ({s['completed']} / {s['refused']} / {s['failed']} / {s['error']})",
                     f"{s['window_requests']}, {s['window_refused']} ({_pct(s['window_refused_share'])}), {s['window_failed']}",
                     s["failed_in_flight_at_kill"], s["admitted_twice"], "yes" if s["books_ok"] else "NO", "yes" if s["failover_ok"] else "NO"])
    out = [markdown_table(head, rows)]
    head2 = ["TTL ms", "round", "killed → new leader", "last renewal before t0 ms", "t0 → lease due ms", "t0 → new key in etcd ms", "t0 → elected ms",
             "t0 → /ready 200 ms", "t0 → first 200 ms", "requests", "completed", "refused", "failed", "window requests / refused", "twice", "books"]
    rows2 = []
    for r in rounds:
        if "error" in r:
            rows2.append([r["ttl_ms"], r["tag"], *(["—"] * 13), f"error: {r['error'][:60]}"])
            continue
        o, w = r["overall"], r["window"]
        rows2.append([r["ttl_ms"], r["tag"], f"{r['killed']} → {r['new_leader']}", _f(r["since_last_renewal_ms"]), _f(r["t0_to_lease_due_ms"]),
                      _f(r["t0_to_new_key_seen_ms"]), _f(r["t0_to_won_ms"]), _f(r["t0_to_ready_ms"]), _f(r["t0_to_first_200_ms"]),
                      o["requests"], o["completed"], o["refused"], o["failed"], f"{w['requests']} / {w['refused']}",
                      len(r["admitted_twice_client"]) + len(r["admitted_twice_engine"]), "ok" if r["books_ok"] else "NO"])
    out.append(markdown_table(head2, rows2))
    return "\n\n".join(out)
