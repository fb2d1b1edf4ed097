"""`narwhal probe-engine` against mock engines of every dialect, clean and faulty."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal_conformance.probe import FAIL, probe_engine


@pytest.fixture(scope="module")
def mocks() -> Iterator[dict[str, Any]]:
    t = Timing(time_scale=0.2)
    with running_fleet([MockConfig(dialect=d, name=d, timing=t) for d in ("vllm", "sglang", "openai")]) as ms:
        yield {m.config.dialect: m for m in ms}


@pytest.mark.parametrize(("dialect", "accounting"), [("vllm", "token_ids"), ("sglang", "unavailable"), ("openai", "unavailable")])
def test_clean_engines_are_compatible(mocks: dict[str, Any], dialect: str, accounting: str) -> None:
    p = probe_engine(mocks[dialect].url, dialect=dialect, model="narwhal-demo")
    assert not p.failed, [r for r in p.results if r.verdict == FAIL]
    assert p.token_accounting == accounting
    rules = {r.rule for r in p.results}
    assert {"A01", "A07", "A08", "A15"} <= rules
    if dialect == "vllm":
        assert {"T02", "T11"} <= rules
    else:
        assert "T08" in rules


def test_tool_calls_are_checked_when_the_engine_makes_them(mocks: dict[str, Any]) -> None:
    p = probe_engine(mocks["vllm"].url, dialect="vllm", model="narwhal-demo", extra_body={"mock": {"scenario": "tool_calls"}})
    a05 = [r for r in p.results if r.rule == "A05"]
    assert a05 and a05[0].verdict == "Pass" and a05[0].detail == "2 call(s)"


@pytest.mark.parametrize(
    ("fault", "rule"),
    [("missing_token_ids", "T02"), ("bool_token_ids", "T02"), ("string_token_ids", "T02"), ("malformed_json", "E02"), ("error_event", "E04"), ("drop", "stream"), ("audio", "A12"), ("tool_call_no_id", "A10"), ("reject", "E05"), ("error_before", "E04")],
)
def test_faults_are_reported_by_rule(mocks: dict[str, Any], fault: str, rule: str) -> None:
    p = probe_engine(mocks["vllm"].url, dialect="vllm", model="narwhal-demo", extra_body={"mock": {"fault": fault, "fault_after": 1}})
    assert p.failed
    assert rule in {r.rule for r in p.results if r.verdict == FAIL}, [(r.rule, r.detail) for r in p.results if r.verdict == FAIL]
    if rule.startswith("T"):
        assert p.token_accounting.startswith("unavailable")


def test_cli_report_and_exit_status(mocks: dict[str, Any]) -> None:
    ok = subprocess.run([sys.executable, "-m", "narwhal.cli", "probe-engine", mocks["sglang"].url, "--dialect", "sglang", "--model", "narwhal-demo"], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ok.stdout.rstrip().endswith("token_accounting: unavailable")
    bad = subprocess.run([sys.executable, "-m", "narwhal.cli", "probe-engine", mocks["vllm"].url, "--dialect", "vllm", "--model", "narwhal-demo", "--extra-body", '{"mock": {"fault": "bool_token_ids"}}', "--json"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and '"verdict": "Fail"' in bad.stdout


def test_concurrency_two_overlapping_requests_are_both_whole() -> None:
    cfg = MockConfig(dialect="openai", name="batching", timing=Timing(time_scale=0.5), output_tokens=48)
    with running_fleet([cfg]) as (m,):
        p = probe_engine(m.url, dialect="openai", model="narwhal-demo")
    (c,) = [r for r in p.results if r.rule == "concurrency"]
    assert c.verdict == "Pass", c
    assert p.recommended_max_concurrency is None


def test_concurrency_an_engine_that_cuts_the_first_answer_is_reported() -> None:
    # llama-cpp-python's server by default: a new request aborts the one streaming
    cfg = MockConfig(dialect="openai", name="llama", timing=Timing(time_scale=0.5), output_tokens=48, quirks=frozenset({"interrupts"}))
    with running_fleet([cfg]) as (m,):
        p = probe_engine(m.url, dialect="openai", model="narwhal-demo")
    (c,) = [r for r in p.results if r.rule == "concurrency"]
    assert c.verdict == FAIL and "max_concurrency: 1" in c.detail, c
    assert p.recommended_max_concurrency == 1
