"""The suite can fail: against deliberately wrong routers (a mutating proxy in front of a
correct Narwhal) it flags exactly the cases whose rows the mutation breaks, and its
failure output names the case, the row's requirement, and Expected vs Actual."""

from __future__ import annotations

import pytest

from narwhal_conformance.cases import load_cases, select_cases

from .proxy import (
    Answer500,
    DropRetryAfter,
    DropUsage,
    ForeignFace,
    LeakTokenIds,
    Mutation,
    RenameCode,
    ReverseToolCalls,
    running_proxy,
)
from .support import Stack, parse_results, run

WRONG: list[tuple[str, Mutation, list[str], set[str]]] = [
    (
        "drops Retry-After",
        DropRetryAfter(),
        ["refusals/R01", "refusals/R02", "refusals/R08", "refusals/R09", "refusals/R10", "refusals/R11", "refusals/R12", "refusals/R14"],
        {"refusals/R01/1", "refusals/R01/2", "refusals/R01/3", "refusals/R02/1", "refusals/R09/1", "refusals/R09/2", "refusals/R10/1", "refusals/R11/1", "refusals/R14/1"},
    ),
    (
        "assembles tool calls in reverse index order",
        ReverseToolCalls(),
        ["assembly/A05", "assembly/A06", "assembly/A10", "assembly/A11", "assembly/A20", "assembly/A21"],
        {"assembly/A05/1", "assembly/A11/1"},
    ),
    (
        "leaks token IDs to clients that did not ask",
        LeakTokenIds(),
        ["token_identity/T04", "token_identity/T09", "token_identity/T10", "assembly/A01", "assembly/A15", "assembly/A22"],
        {"token_identity/T10/1", "token_identity/T10/2", "token_identity/T10/3", "assembly/A22/2"},
    ),
    (
        "answers 500 on row R06",
        Answer500(),
        ["refusals/R05", "refusals/R06", "accounting", "failures/H06"],
        {"refusals/R06/1", "refusals/R06/2", "accounting/C02/1"},
    ),
]


@pytest.mark.parametrize(("what", "mutation", "cases", "flagged"), WRONG, ids=[w[0] for w in WRONG])
def test_the_suite_flags_a_wrong_router(stack: Stack, what: str, mutation: Mutation, cases: list[str], flagged: set[str]) -> None:
    with running_proxy(stack.targets["reference"], mutation) as url:
        args = [a for c in cases for a in ("--case", c)]
        code, out = run(url, "reference", stack.port_base, "--strict", *args)
    results = parse_results(out)
    failed = {k for k, v in results.items() if v == "FAIL"}
    assert code == 1, out
    assert failed == flagged, f"{what}: flagged {sorted(failed)}, expected {sorted(flagged)}\n{out}"
    assert all(v in ("PASS", "INFO") for k, v in results.items() if k not in flagged), out
    # every failure names its rows, quotes the requirement, shows Expected and Actual
    for case_id in flagged:
        block = out.split(case_id, 1)[1].split("\nPASS ", 1)[0].split("\nFAIL ", 1)[0]
        assert "Requirement " in block and "Expected:" in block and "Actual:" in block, block


def test_answer_500_is_reported_as_h06(stack: Stack) -> None:
    with running_proxy(stack.targets["reference"], Answer500()) as url:
        code, out = run(url, "reference", stack.port_base, "--case", "refusals/R06/1")
    assert code == 1 and "no internal error (H06)" in out, out


def test_an_expectation_file_turns_known_failures_into_expected_ones(stack: Stack, tmp_path: object) -> None:
    from pathlib import Path

    exp = Path(str(tmp_path)) / "vendor.yaml"
    exp.write_text("assembly/A05/1: {status: FAIL, bug: 'https://bugs.example/1'}\nassembly/A11: {status: FAIL, bug: 'https://bugs.example/2'}\nassembly/A01/1: {status: FAIL, bug: 'https://bugs.example/3'}\n")
    with running_proxy(stack.targets["reference"], ReverseToolCalls()) as url:
        code, out = run(url, "reference", stack.port_base, "--expectations", str(exp), "--case", "assembly/A05/1", "--case", "assembly/A11/1", "--case", "assembly/A01/1")
    res = parse_results(out)
    assert res == {"assembly/A05/1": "EXPECTED-FAIL", "assembly/A11/1": "EXPECTED-FAIL", "assembly/A01/1": "UNEXPECTED-PASS"}, out
    assert code == 1  # the unexpected pass: a stale expectation fails the run


def test_a_should_case_is_non_strict_without_strict(stack: Stack) -> None:
    with running_proxy(stack.targets["reference"], DropRetryAfter()) as url:
        code, out = run(url, "reference", stack.port_base, "--case", "refusals/R14/1")
    assert parse_results(out) == {"refusals/R14/1": "NON-STRICT"}, out
    assert code == 0, out


def test_cases_needing_the_admin_api_are_na_without_its_token(stack: Stack) -> None:
    code, out = run(stack.targets["reference"], "reference", stack.port_base, "--admin-token", "", "--case", "refusals/R01/2", "--case", "failures/H05")
    assert parse_results(out) == {"refusals/R01/2": "N/A", "failures/H05/1": "N/A"}, out
    assert out.count("N/A: needs admin (no --admin-token given)") == 2, out
    assert code == 0, out


# The same mutants in front of the unified profile's Narwhal: the unified fleet catches them too.
WRONG_UNIFIED: list[tuple[str, Mutation, list[str], set[str]]] = [
    ("drops Retry-After", DropRetryAfter(), ["refusals/R02", "refusals/R09", "refusals/R11", "refusals/R12", "refusals/R06"],
     {"refusals/R02/1", "refusals/R09/3", "refusals/R11/2"}),
    ("renames a code", RenameCode("engine_error", "upstream_failed"), ["failures/E04", "failures/E05"],
     {"failures/E04/1", "failures/E04/2"}),
    ("assembles tool calls in reverse index order", ReverseToolCalls(), ["assembly/A05", "assembly/A11", "assembly/A20"], {"assembly/A05/1", "assembly/A11/1"}),
    ("leaks token IDs to clients that did not ask", LeakTokenIds(), ["token_identity/T09", "token_identity/T10", "assembly/A22"],
     {"token_identity/T10/1", "token_identity/T10/2", "token_identity/T10/3", "assembly/A22/2"}),
    ("drops usage", DropUsage(), ["assembly/A15", "assembly/A18", "assembly/A19", "token_identity/T10/1", "assembly/A01"],
     {"assembly/A18/1", "assembly/A19/1", "assembly/A19/2", "token_identity/T10/1"}),
]


@pytest.mark.parametrize(("what", "mutation", "cases", "flagged"), WRONG_UNIFIED, ids=[w[0] for w in WRONG_UNIFIED])
def test_the_unified_fleet_flags_a_wrong_router(stack: Stack, what: str, mutation: Mutation, cases: list[str], flagged: set[str]) -> None:
    with running_proxy(stack.targets["unified"], mutation) as url:
        code, out = run(url, "unified", stack.port_base, "--strict", *[a for c in cases for a in ("--case", c)])
    results = parse_results(out)
    failed = {k for k, v in results.items() if v == "FAIL"}
    assert code == 1 and failed == flagged, f"{what}: flagged {sorted(failed)}, expected {sorted(flagged)}\n{out}"


def test_a_router_without_narwhals_api_gets_a_verdict_on_its_wire_behaviour(stack: Stack) -> None:
    """No /ready, /v1/engines, /metrics, admin API; its own x-request-id and error codes:
    the suite still runs, every interoperability case passes (the wire behaviour is
    Narwhal's), what needs Narwhal's API is N/A with the reason, the books are N/A."""
    with running_proxy(stack.targets["unified"], ForeignFace()) as url:
        code, out = run(url, "unified", stack.port_base, "--admin-token", "")
    results = parse_results(out)
    cases = {c.id: c for c in select_cases(load_cases(), None, profile="unified")}
    assert set(results) == set(cases), out
    assert "ready URL " + url + "/health" in out, out
    interop = {k: v for k, v in results.items() if cases[k].cls == "interoperability"}
    assert len(interop) >= 45 and all(v == "PASS" or (v == "N/A" and cases[k].needs) for k, v in interop.items()), out
    n = sum(1 for v in interop.values() if v == "PASS")
    assert f"interoperability {n}/{n}" in out, out
    na = {k for k, v in results.items() if v == "N/A"}
    assert na == {k for k, c in cases.items() if {"ready", "engines-api", "books", "admin", "narwhal-headers", "auth", "tenants", "migration"} & set(c.needs)}, out
    assert "N/A: needs books (GET /metrics (404) has no narwhal_requests_offered_total)" in out, out
    for cap in ("ready (GET /ready answers 404)", "books (GET /metrics (404)", "admin (no --admin-token given)", "narwhal-errors (n: 2 answers 400 code None)"):
        assert cap in out.split("absent: ", 1)[1].split("\n", 1)[0], out
    assert "books 0/0 (N/A" in out, out
    # codes of its own: the Narwhal-profile cases that read a row's code fail, and only those
    failed = {k for k, v in results.items() if v == "FAIL"}
    assert failed and all(cases[k].cls == "narwhal" for k in failed), out
    assert code == 1


def test_an_na_expectation_skips_the_case_with_the_vendors_reason(stack: Stack, tmp_path: object) -> None:
    from pathlib import Path

    exp = Path(str(tmp_path)) / "vendor.yaml"
    exp.write_text("refusals/R06: {status: NA, reason: 'we serve n > 1 on purpose'}\n")
    code, out = run(stack.targets["unified"], "unified", stack.port_base, "--expectations", str(exp), "--case", "refusals/R06", "--case", "refusals/R05/1")
    res = parse_results(out)
    assert res == {"refusals/R06/1": "N/A", "refusals/R06/2": "N/A", "refusals/R06/3": "N/A", "refusals/R05/1": "PASS"}, out
    assert out.count("N/A: the vendor's expectation file: we serve n > 1 on purpose") == 3, out
    assert code == 0
