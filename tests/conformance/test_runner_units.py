"""The runner's parts that need no router: implied capabilities, expectation files, the
subcommands' own help, the class of an error check."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from narwhal_conformance.capabilities import CAPABILITIES, implied_needs
from narwhal_conformance.cases import load_cases
from narwhal_conformance.cli import add_arguments, run
from narwhal_conformance.expectations import ExpectationError, expectation_for, load_expectations


@pytest.mark.parametrize(
    ("steps", "needs"),
    [
        ([{"request": {"route": "/v1/chat/completions", "body": {}}}], set()),
        ([{"request": {"route": "/v1/chat/completions", "headers": {"x-narwhal-deadline-ms": "5"}}}], {"narwhal-headers"}),
        ([{"request": {"route": "/admin/state", "method": "POST"}}], {"admin"}),
        ([{"request": {"route": "/ready", "method": "GET"}}], {"ready"}),
        ([{"request": {"route": "/v1/engines", "method": "GET"}}], {"engines-api"}),
        ([{"request": {"route": "/metrics", "method": "GET"}}], {"books"}),
        ([{"wait": {"ready": 503}}], {"ready"}),
        ([{"wait": {"engines": {"all": {"eligible": True}}}}], {"engines-api"}),
        ([{"request": {"route": "/v1/completions"}, "background": "b", "until": {"offered": 1}}], {"books"}),
        ([{"request": {"route": "/v1/completions"}, "background": "b", "until": {"received": {"role": "output"}}}], set()),
    ],
)
def test_steps_imply_their_capabilities(steps: list[dict[str, object]], needs: set[str]) -> None:
    assert implied_needs({"steps": steps}) == needs


def test_every_case_names_known_capabilities_and_a_class() -> None:
    for c in load_cases():
        assert set(c.needs) <= set(CAPABILITIES), c.id
        assert c.cls in ("interoperability", "narwhal"), c.id


def test_interoperability_cases_need_nothing_of_narwhals_api() -> None:
    """Interoperability is what any OpenAI-compatible router owes its clients: such a case
    may need a fleet feature (pd, retry) but not Narwhal's own API or headers."""
    api = {"ready", "engines-api", "books", "admin"}
    bad = [c.id for c in load_cases() if c.cls == "interoperability" and api & set(c.needs)]
    assert not bad, bad


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("refusals/R11/1: {status: PASS}\n", ":1: refusals/R11/1: status 'PASS' is not one of FAIL, NA"),
        ("# known\nassembly/A07: {status: NA}\n", ":2: assembly/A07: status NA needs a reason"),
        ("refusals/R11/1: {status: FAIL}\nnot-a-case: {status: FAIL}\n", ":2: not-a-case: not a case id"),
        ("refusals/R11/1: [FAIL]\n", ":1: refusals/R11/1: expected {status: FAIL"),
        ("refusals/R11/1: {status: FAIL, bugs: x}\n", ":1: refusals/R11/1: unknown key(s) ['bugs']"),
        ("refusals/R11/1: {status: FAIL\n", ": not valid YAML"),
        ("- refusals/R11/1\n", ":1: an expectation file maps case ids"),
    ],
)
def test_a_bad_expectation_file_names_its_line(tmp_path: Path, text: str, problem: str) -> None:
    f = tmp_path / "vendor.yaml"
    f.write_text(text)
    with pytest.raises(ExpectationError) as e:
        load_expectations(f)
    assert problem in str(e.value) and str(f) in str(e.value)


def test_expectations_fail_and_na_most_specific_wins(tmp_path: Path) -> None:
    f = tmp_path / "vendor.yaml"
    f.write_text("assembly: {status: NA, reason: we do not assemble}\nassembly/A05/1: {status: FAIL, bug: 'https://bugs.example/1'}\n")
    exp = load_expectations(f)
    assert expectation_for("assembly/A05/1", exp) == {"status": "FAIL", "bug": "https://bugs.example/1"}
    assert expectation_for("assembly/A07/2", exp) == {"status": "NA", "reason": "we do not assemble"}
    assert expectation_for("refusals/R11/1", exp) is None


def test_a_bad_expectation_file_exits_2_before_any_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "vendor.yaml"
    f.write_text("refusals/R11/1: {status: SKIP}\n")
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--target", "http://127.0.0.1:9", "--expectations", str(f)])) == 2
    assert f"{f}:1: refusals/R11/1: status 'SKIP'" in capsys.readouterr().err


@pytest.mark.parametrize(("action", "says"), [("fleet", "Serve the scripted mock engines"), ("print-config", "Print the router configuration"), ("run", "--ready-url")])
def test_subcommands_print_their_own_help(action: str, says: str, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser(prog="narwhal conformance")
    add_arguments(p)
    with pytest.raises(SystemExit) as e:
        p.parse_args([action, "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert says in out and f"narwhal conformance {action}" in out


def test_a_bad_header_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--target", "http://127.0.0.1:9", "--header", "no colon here"])) == 2
    assert "expected 'Name: value'" in capsys.readouterr().err


_REQ = {"request": {"route": "/v1/chat/completions", "body": {}}}


@pytest.mark.parametrize(
    ("case", "before", "after", "out"),
    [
        ({"steps": [_REQ]}, 4, 4, False),  # nothing faulted, the fleet unchanged: no wait
        ({"steps": [_REQ]}, 4, 6, True),  # the engines faulted (E06's drops): a breaker may be open
        ({"steps": [_REQ]}, None, 4, True),  # a count unread: assume so
        ({"steps": [_REQ]}, 4, None, True),
        ({"steps": [{"fleet": {"engine": "d0", "health": "down"}}, _REQ]}, 4, 4, True),  # the fleet changed
        ({"steps": [_REQ], "teardown": [{"fleet": {"engine": "all", "health": "ok"}}]}, 4, 4, True),
    ],
)
def test_the_runner_waits_for_engines_it_cannot_see_only_after_faults_or_fleet_changes(case: dict[str, object], before: int | None, after: int | None, out: bool) -> None:
    from narwhal_conformance.runner import engines_may_be_out

    assert engines_may_be_out(case, before, after) is out


def test_the_breaker_rest_is_the_profiles_cooldown_and_two_polls() -> None:
    """A router without /v1/engines gets this long after a faulting case (the flake this
    replaces: failures/E07 answered 503 6 ms after E06's drops opened the unified
    profile's breakers, 3 failures for 300 ms)."""
    from narwhal_conformance.profiles import PROFILES

    for p in PROFILES.values():
        m = p.router["monitoring"]
        assert p.breaker_rest_s() == pytest.approx((m["breaker_cooldown_ms"] + 2 * m["poll_interval_ms"]) / 1000.0)
        assert p.breaker_rest_s() >= 0.3
