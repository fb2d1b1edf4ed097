"""narwhal bench ha's reading of one round (ha_report.analyse): a kill at t0 = 10 s, three
routers, the values as the bench printed them before its split into ha.py and
ha_report.py."""

from __future__ import annotations

from collections import Counter
from typing import Any

from narwhal_bench.ha import KeyPoll, LoadRun, Router
from narwhal_bench.ha_report import analyse, attempt_rows, summarize_ttl, tables
from narwhal_bench.harness.follow import Attempt, Poll, Request
from narwhal_bench.harness.stats import Result


class _Proc:
    log_path = "unused"


def _r(sent: float, status: int, code: str | None = None, error: str | None = None) -> Result:
    r = Result(scheduled=sent, sent=sent, status=status, headers_at=sent + 0.01, code=code, error=error)
    if status == 200 and error is None:
        r.first_token_at, r.done_at, r.tokens = sent + 0.02, sent + 0.1, 16
    return r


def _round(books: dict[int, dict[str, Any]], engine: Counter[str]) -> dict[str, Any]:
    rs = [Router(f"r{i}", f"http://127.0.0.1:{i}", _Proc()) for i in range(3)]  # type: ignore[arg-type]
    reqs = [
        Request("a", 9.0, [Attempt(0, _r(9.0, 200))]),  # before the kill, on the leader
        Request("b", 10.5, [Attempt(0, _r(10.5, 0, error="connect: refused")), Attempt(1, _r(10.5, 503, "router_not_ready")),
                            Attempt(2, _r(10.6, 503, "router_not_ready"))]),  # in the window: refused by both survivors
        Request("c", 13.5, [Attempt(0, _r(13.5, 0, error="connect: refused")), Attempt(1, _r(13.5, 200))]),  # the new leader's first 200
    ]
    run = LoadRun(reqs, [Poll(1, 13.0, 13.01, 200)], 8.0, 10.0, 0, None, keys=[KeyPoll(9.9, 5, "r0"), KeyPoll(12.0, None, None), KeyPoll(12.9, 7, "r1")],
                  leader_ha={"fence_in_ms": 1500, "fencing_token": 5}, leader_ha_at=9.9)
    ha = {1: {"history": [{"to": "leader", "at": 12.95}], "fencing_token": 7}, 2: None}
    cfg = {"lease_ttl_ms": 3000, "fence_margin_ms": 500, "renew_interval_ms": 1000, "request_timeout_ms": 1000}
    res = analyse(run, rs, books, ha, engine, cfg)
    res.update(tag="t3000-1", ttl_ms=3000)
    assert attempt_rows(run, rs)[1] == ["b", 0, "r0", 500.0, 0, None, "unreached", 510.0, None, 0, "connect: refused"]
    return res


BALANCED = {1: {"offered": 2, "terminal": {"completed": 1, "unavailable": 1}, "open": 0}, 2: {"offered": 1, "terminal": {"completed": 0, "unavailable": 1}, "open": 0}}


def test_one_round_read_from_the_client_the_key_and_the_books() -> None:
    res = _round(BALANCED, Counter({"a": 1, "c": 1}))
    assert (res["killed"], res["new_leader"], res["ready_first"]) == ("r0", "r1", "r1")
    assert (res["t0_to_lease_due_ms"], res["since_last_renewal_ms"], res["t0_to_new_key_seen_ms"]) == (1900.0, 1100.0, 2900.0)
    assert (res["t0_to_won_ms"], res["t0_to_ready_ms"], res["t0_to_first_200_ms"]) == (2950.0, 3010.0, 3510.0)
    assert res["overall"] == {"requests": 3, "completed": 2, "refused": 1, "failed": 0, "error": 0}
    assert res["window"] == {"requests": 2, "completed": 1, "refused": 1, "failed": 0, "error": 0, "refused_share": 0.5, "seconds": 3.51}
    assert (res["old_token"], res["new_token"], res["new_key_revision"]) == (5, 7, 7)
    assert res["books_ok"] and res["failover_ok"] and res["ok"]  # 3.51 s <= TTL + 1 s, nothing twice
    s = summarize_ttl([res], 3000)
    assert s["first_200_ms"] == {"median": 3510.0, "max": 3510.0} and s["lease_due_to_won_ms"] == {"median": 1050.0, "max": 1050.0}
    assert "| 3000 | t3000-1 | r0 → r1 | 1100 | 1900 | 2900 | 2950 | 3010 | 3510 | 3 | 2 | 1 | 0 | 2 / 1 | 0 | ok |" in tables([res], [s])


def test_books_that_do_not_match_the_client_and_a_request_the_engine_saw_twice() -> None:
    books = {**BALANCED, 2: {"offered": 2, "terminal": {"completed": 0, "unavailable": 1}, "open": 1}}
    res = _round(books, Counter({"a": 1, "c": 2}))
    assert res["books"]["r2"]["balance"] is False and res["books"]["r2"]["matches_client"] is False and res["books"]["r1"]["matches_client"] is True
    assert not res["books_ok"] and not res["ok"]
    assert res["admitted_twice_engine"] == ["c"] and res["admitted_twice_client"] == [] and res["engine_requests"] == 2
