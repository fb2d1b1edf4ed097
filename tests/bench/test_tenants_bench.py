"""`narwhal bench tenants` on a tiny budget: the Narwhal arms only (mock engines and a
router as processes, a few seconds of load), checked for structure and books, never for
timing; and the per-tenant summary on synthetic records."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest

from narwhal_bench.harness.stats import Result
from narwhal_bench.tenants import add_arguments, outcome, run, tenant_summary


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
