"""`narwhal bench migration`: its pure parts on synthetic records (the recorder, what a cut
is, the analysis, the metrics and the tables), and a `--quick` run of every arm on a tiny
budget (four sequence mocks and a router per arm, ~1 min) that checks the structure of
what it reports and that the router's books balance. No timing is asserted."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from narwhal_bench.harness.stats import Result
from narwhal_bench.migration import ARMS, MigRec, MReq, add_arguments, run
from narwhal_bench.migration_report import (
    KillRecord,
    RollStep,
    analyse_kill,
    analyse_roll,
    cut_at,
    expected_ids,
    read_migrations,
    request_body,
    tables,
)

T0 = 100.0


def _stream(ids: list[int], *, migrations: int = 0, error: bool = False) -> list[bytes]:
    out = [b'data: {"id":"x","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n']
    out += [b'data: {"id":"x","choices":[{"index":0,"delta":{"content":"w"},"token_ids":[%d]}]}\n\n' % i for i in ids]
    if error:
        out.append(b'data: {"error":{"message":"gone","type":"upstream_error","code":"engine_unreachable"}}\n\n')
    if migrations:
        out.append(b": x-narwhal-migrations %d\n\n" % migrations)
    out.append(b"data: [DONE]\n\n")
    return out


def _req(k: int, *, n: int = 8, cut_after: int | None = None, migrations: int = 0, error: bool = False, gap: float = 0.3) -> MReq:
    """Request k, its tokens 20 ms apart from T0 + k; cut after `cut_after` tokens: a pause
    of `gap` s, then the rest (migrated) or an error event."""
    body = request_body(k, 64, n)
    want = expected_ids(body)
    got = want if not error else want[: cut_after or 0]
    r = Result(scheduled=T0 + k, sent=T0 + k, output_tokens=n)
    q = MReq(f"r{k}", k, body, r, MigRec(r))
    assert q.rec is not None
    q.rec.on_headers(200, {b"content-type": b"text/event-stream"}, T0 + k + 0.001)
    t = T0 + k + 0.01
    evs = _stream(got, migrations=migrations, error=error)
    for i, ev in enumerate(evs):
        if cut_after is not None and i == cut_after + 1:
            t += gap
        q.rec.on_body(ev, t)
        t += 0.02
    q.rec.on_end(t)
    return q


def test_recorder_keeps_ids_comments_and_token_times() -> None:
    q = _req(0, n=5, migrations=1)
    assert q.rec is not None and q.rec.ids == expected_ids(q.body) and q.migrations == 1
    assert [n for _, n in q.times] == [1] * 5 and q.outcome == ("ok", "200") and q.whole()
    bad = _req(1, n=5, cut_after=2, error=True)
    assert bad.outcome[0] == "failed" and "engine_unreachable" in bad.outcome[1] and not bad.whole()


def test_expected_ids_are_the_sequence_answer_and_prompts_differ() -> None:
    a, b = request_body(1, 64, 30), request_body(2, 64, 30)
    assert a["messages"] != b["messages"] and a["ignore_eos"] is True and a["max_tokens"] == 30
    assert len(expected_ids(a)) == 30 and expected_ids(a) != expected_ids(b)


def test_cut_at_needs_a_token_before_and_not_all_of_them() -> None:
    times = [(1.0, 1), (1.02, 1), (1.5, 1), (1.52, 1)]
    assert cut_at(times, 1.03, 4) == (True, pytest.approx(0.48))
    assert cut_at(times, 0.5, 4) == (False, None)  # no token yet: a retry from scratch, not a cut
    assert cut_at(times, 1.6, 4) == (False, None)  # every token already there
    assert cut_at(times[:2], 1.01, 4) == (True, None)  # a token in flight reached the client after the kill, then nothing
    assert cut_at(times, 1.01, 4) == (True, pytest.approx(0.48))  # the pause after the token in flight


def test_analyse_kill_counts_cuts_gaps_and_attribution() -> None:
    whole = [_req(k) for k in range(4)]  # never on the killed engine
    moved = _req(4, cut_after=3, migrations=1)  # tokens at T0+4.01 .. ; the pause after the 3rd
    lost = _req(5, cut_after=3, error=True)
    stray = _req(6, migrations=1)  # migrated, yet in no killed engine's log
    reqs = [*whole, moved, lost, stray]
    kills = [KillRecord(1, "u0", T0 + 4.0 + 0.01 + 0.02 * 3 + 0.05, ["r4", "r99"]), KillRecord(2, "u1", T0 + 5.0 + 0.01 + 0.02 * 3 + 0.05, ["r5", "r0"], restart_s=0.4)]
    res = analyse_kill(reqs, kills)
    assert (res["offered"], res["completed_whole"], res["failed"], res["kills"], res["kills_failed_restart"]) == (7, 6, 1, 2, 1)
    assert (res["cut"], res["cut_whole"], res["cut_whole_share"], res["cut_without_token_after"]) == (2, 1, 0.5, 1)
    assert res["cut_by"] == {"r4": [1], "r5": [2]}  # r0 ended long before kill 2
    assert res["migrated"] == 2 and res["migrated_not_attributed"] == 1 and res["migrated_by_count"] == {"1": 2}
    assert res["cut_gap_p50_ms"] == pytest.approx(320.0, abs=1.0)  # the 0.3 s pause plus one token's 20 ms
    assert res["baseline_token_gap_p50_ms"] == pytest.approx(20.0, abs=0.5)


def test_analyse_roll_times_the_steps() -> None:
    reqs = [_req(0), _req(1, cut_after=2, migrations=1, gap=0.05)]
    steps = [RollStep(1, "u0", "n0", T0, t_put=T0 + 0.3, active_s=0.05, t_delete=T0 + 0.4, gone_s=0.1, lifecycle="draining"),
             RollStep(2, "u1", "n1", T0 + 0.5, t_put=T0 + 0.8, active_s=0.05, t_delete=T0 + 0.9, gone_s=2.0, lifecycle="draining")]
    res = analyse_roll(reqs, steps)
    assert res["roll_ok"] and res["roll_s"] == 2.6 and res["drain_sum_s"] == 2.1 and res["gone_max_ms"] == 2000.0
    assert (res["offered"], res["completed_whole"], res["failed"], res["migrated"], res["migrated_whole"]) == (2, 2, 0, 1, 1)
    assert [s["gone_after_delete_ms"] for s in res["steps"]] == [100.0, 2000.0]
    assert analyse_roll(reqs, [*steps, RollStep(3, "u2", "n2", T0 + 1, ok=False, note="x")])["roll_s"] is None


def test_read_migrations_sums_workers() -> None:
    text = "\n".join([
        "# TYPE narwhal_migrations_total counter",
        'narwhal_migrations_total{cause="E06",decision="carry_on",worker="0"} 3.0',
        'narwhal_migrations_total{cause="E06",decision="carry_on",worker="1"} 2.0',
        'narwhal_migrations_total{cause="E04",decision="placement_refused",worker="0"} 1.0',
        'narwhal_migrations_total{cause="E07",decision="deadline",worker="0"} 0.0',
    ])
    assert read_migrations(text) == {"by_decision": {"carry_on": 5, "placement_refused": 1}, "by_cause": {"E04": 1, "E06": 5}}


def test_tables_render_both_kinds_of_arm() -> None:
    reqs = [_req(0), _req(1, cut_after=2, migrations=1)]
    k = analyse_kill(reqs, [KillRecord(1, "u0", T0 + 1.0 + 0.01 + 0.02 * 2 + 0.05, ["r1"], restart_s=0.3)])
    k.update(arm="kill-migrate", max_attempts=2, books={"offered": 2, "terminal": {"completed": 2}, "open": 0}, balanced=True,
             migrations_total={"by_decision": {"carry_on": 1}})
    r = analyse_roll(reqs, [RollStep(1, "u0", "n0", T0, t_put=T0, active_s=0.05, t_delete=T0 + 0.1, gone_s=0.07)])
    r.update(arm="roll-migrate", drain="migrate", max_attempts=2, books={"offered": 2, "terminal": {"completed": 2}, "open": 1}, balanced=False)
    md = tables({"arms": [k, r]})
    assert "| kill-migrate | 2 | 2 | 2 (1.000) | 0 | 0 | 0 | 1 (300) | 1 (0 twice) | 1 (**1.000**) |" in md
    assert "| roll-migrate | migrate | 2 | 2 (1.000) | 0 | 0 | 0 | 0.17 | 50 | 70 | 1 (1) |" in md
    assert "2 → completed 2; open 0: balanced | carry_on 1 |" in md and "NOT balanced" in md


@pytest.mark.skipif(os.environ.get("NARWHAL_BENCH_SMOKE") != "1", reason="the whole bench (~70 s: four arms, engine processes killed and restarted): NARWHAL_BENCH_SMOKE=1")
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_quick_run_of_every_arm_reports_whole_answers_and_balanced_books(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--quick", "--duration", "5", "--out", str(tmp_path)])
    cpus = os.sched_getaffinity(0)
    try:
        assert run(args) == 0
    finally:
        os.sched_setaffinity(0, cpus)
    data = json.loads((tmp_path / "migration.json").read_text())
    assert "| kill-off |" in (tmp_path / "migration.md").read_text()
    assert [a["arm"] for a in data["arms"]] == list(ARMS)
    for a in data["arms"]:
        b = a["books"]
        assert a["balanced"] and b["open"] == 0 and b["offered"] == a["offered"] > 0, a["arm"]
        assert a["completed"] + a["refused"] + a["failed"] + a["cancelled"] == a["offered"]
        assert b["terminal"].get("completed", 0) == a["completed"]  # the client's count is the router's
        assert a["completed_not_whole"] == 0  # a migrated answer is the uninterrupted one, token for token
        assert len(a["requests"]) == a["offered"] and len(a["requests"][0]) == len(data["request_fields"])
    off, on, wait, mig = data["arms"]
    assert off["kills"] >= 1 and on["kills"] >= 1 and off["max_attempts"] == 0 and on["max_attempts"] == 2
    assert off["migrated"] == 0 and "carry_on" not in off["migrations_total"]["by_decision"]
    assert on["cut_whole"] <= on["cut"] and on["migrated_whole"] <= on["migrated"]
    for a in (wait, mig):
        assert a["roll_ok"] and len(a["steps"]) == 4 and a["failed"] == 0, a
    assert wait["migrated"] == 0
