"""`narwhal bench tenants` on a tiny budget: the Narwhal arms only (mock engines and a
router as processes, a few seconds of load), checked for structure and books, never for
timing; and the per-tenant summary on synthetic records."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from narwhal_bench import tenants_retention as retention
from narwhal_bench.harness.stats import Result
from narwhal_bench.tenants import add_arguments, outcome, run, tenant_summary, tenants


def _r(status: int, *, ttft: float | None = None, code: str | None = None, retry_after: str | None = None, error: str | None = None) -> Result:
    r = Result(scheduled=10.0, sent=10.0, status=status, code=code, retry_after=retry_after, error=error)
    if status == 200 and error is None:
        r.first_token_at = 10.0 + (ttft or 0.1)
        r.done_at = r.first_token_at + 0.1
        r.tokens = 4
    elif status:
        r.done_at = 10.01
    return r


def test_summary_classes_and_goodput_over_offered() -> None:
    rs = [_r(200, ttft=0.2), _r(200, ttft=1.5), _r(429, code="ttft_budget_exceeded", retry_after="1"), _r(429, code="admission_queue_full"),
          _r(502, code="malformed_engine_output"), _r(0, error="cut at end of run")]
    assert [outcome(r)[0] for r in rs] == ["ok", "ok", "refused", "refused", "failed", "cancelled"]
    s = tenant_summary(rs, budget_s=1.0)
    assert (s["offered"], s["ok"], s["refused"], s["refused_with_retry_after"], s["failed"], s["cancelled"]) == (6, 2, 2, 1, 1, 1)
    assert s["refusals"] == {"429 ttft_budget_exceeded +RA": 1, "429 admission_queue_full -RA": 1}
    assert s["goodput"] == 1 / 6  # one of six offered answered within the budget


@pytest.mark.skipif(os.environ.get("NARWHAL_BENCH_SMOKE") != "1", reason="the Narwhal arms of the bench (~35 s: two routers with profiling): NARWHAL_BENCH_SMOKE=1")
def test_the_narwhal_arms_run_and_balance_their_books(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--quick", "--arms", "narwhal-alone,narwhal", "--duration", "3", "--out", str(tmp_path)])
    cpus = os.sched_getaffinity(0)
    try:
        assert run(args) == 0
    finally:
        os.sched_setaffinity(0, cpus)  # the bench pins this process to the load CPUs
    data = json.loads((tmp_path / "tenants.json").read_text())
    assert (tmp_path / "tenants.md").read_text().startswith("## Tenants")
    assert [a["arm"] for a in data["arms"]] == ["narwhal-alone", "narwhal"]
    alone, both = data["arms"]
    assert set(alone["tenants"]) == {"quiet"} and set(both["tenants"]) == {"quiet", "noisy"}
    for a in data["arms"]:
        b = a["books"]
        assert b["balanced"] and b["open"] == 0
        for t, s in a["tenants"].items():
            assert s["offered"] == data["offered"][t]
            assert s["ok"] + s["refused"] + s["failed"] + s["cancelled"] == s["offered"]
            # the router's books for the tenant are the client's count
            assert b["tenants"][t]["offered"] == s["offered"]
            assert b["tenants"][t]["terminal"].get("completed", 0) == s["ok"]
    assert "narwhal" in data["verdict"] and data["verdict"]["narwhal"]["books_balanced"]


# -- the retention-bound arms (narwhal_bench/tenants_retention.py) ------------------------------------


def _arm(name: str, rnd: int, quiet_ttfts: list[float], noisy: tuple[int, int] | None = None) -> dict[str, object]:
    rs = [_r(200, ttft=t) for t in quiet_ttfts]
    tenants_ = {"quiet": tenant_summary(rs, 1.0)}
    if noisy is not None:
        ok, refused = noisy
        tenants_["noisy"] = tenant_summary([_r(200, ttft=0.1)] * ok + [_r(429, code="http_retention_full", retry_after="1")] * refused, 1.0)
    return {"arm": name, "round": rnd, "tenants": tenants_, "books": {"balanced": True}}


def test_retention_summary_is_the_median_over_rounds_and_the_ratio_is_per_round() -> None:
    rounds = [
        _arm("retention-alone", 1, [0.05] * 99 + [0.1]), _arm("retention", 1, [0.05] * 99 + [0.2], (10, 5)),
        _arm("retention-alone", 2, [0.05] * 99 + [0.2]), _arm("retention", 2, [0.05] * 99 + [0.2], (12, 3)),
        _arm("retention-alone", 3, [0.05] * 99 + [0.1]), _arm("retention", 3, [0.05] * 99 + [0.12], (11, 4)),
    ]
    s = retention.summarise(rounds)
    p99 = [r["tenants"]["quiet"]["ttft_p99"] for r in rounds]
    ratios = sorted(p99[i + 1] / p99[i] for i in (0, 2, 4))
    assert s["p99_vs_alone"]["median"] == pytest.approx(ratios[1]) and s["p99_vs_alone"]["min"] == pytest.approx(ratios[0])
    assert s["retention"]["answered"]["median"] == 1.0 and s["retention"]["noisy_ok"]["median"] == 11
    assert s["verdict"] == {"answered_ok": True, "p99_ok": ratios[1] <= 1.5}
    data = {"timing": retention.TIMING, "prompt_tokens": 100, "output_tokens": 8, "duration_s": 25.0, "retention_limit": 24, "max_concurrency": 2,
            "fair_reserve": None, "rates": {"quiet": 4.0, "noisy": 40.0}, "offered": {"quiet": 100, "noisy": 15}, "tree": "this tree",
            "rounds": rounds, "summary": s}
    md = retention.tables(data)
    assert "| retention | 2 | 100/100 |" in md and "429 http_retention_full +RA ×3" in md
    assert f"{ratios[1]:.2f} ({ratios[0]:.2f}–{ratios[2]:.2f})" in md


def test_an_unknown_arm_is_refused_before_anything_starts() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--quick", "--arms", "retention,nonsense"])
    with pytest.raises(ValueError, match="nonsense"):
        tenants(args)


@pytest.mark.skipif(os.environ.get("NARWHAL_BENCH_SMOKE") != "1", reason="the retention arms (~25 s: two routers, 3 s of load each): NARWHAL_BENCH_SMOKE=1")
def test_the_retention_arms_run_and_balance_their_books(tmp_path: Path) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--quick", "--arms", "retention-alone,retention", "--out", str(tmp_path)])
    cpus = os.sched_getaffinity(0)
    try:
        assert run(args) == 0
    finally:
        os.sched_setaffinity(0, cpus)
    data = json.loads((tmp_path / "tenants.json").read_text())["retention"]
    assert [(a["arm"], a["round"]) for a in data["rounds"]] == [("retention-alone", 1), ("retention", 1)]
    for a in data["rounds"]:
        assert a["books"]["balanced"] and a["books"]["open"] == 0
        for t, s in a["tenants"].items():
            assert s["offered"] == data["offered"][t] and s["ok"] + s["refused"] + s["failed"] + s["cancelled"] == s["offered"]
    assert "p99_vs_alone" in data["summary"] and "verdict" in data["summary"]
