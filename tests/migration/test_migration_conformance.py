"""Capability `migration` of the conformance suite against Narwhal (issue 24 item 5): a
router the runner starts from `{config}` (`--serve`, upstream.migration.max_attempts 1)
is detected to carry a broken stream on and passes the cases of table migration (one
process and `--workers 2`, profiles reference and unified, HTTP/1.1 and h2c), and the
failure cases whose content check holds only without migration; a router without
migration (print-config's configuration as it is) gets those cases N/A, never a Fail,
and the failure cases check the error event as before; declared against it, they fail."""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from narwhal_conformance import cli
from narwhal_conformance.cases import load_cases, select_cases, spec_rows, untestable
from narwhal_conformance.cli import add_arguments
from narwhal_conformance.fleet import running_fleet
from narwhal_conformance.profiles import MIGRATION, get_profile, router_config
from tests.conformance.support import (
    ADMIN_TOKEN,
    free_port_base,
    parse_results,
    run,
    serving,
)

# the failure cases a router that carries streams on answers otherwise (assertions marked
# `unless: migration`): they run with the migration cases
AFFECTED = ("failures/E02/5", "failures/E04/3", "failures/E06/2", "failures/E07/1", "token_identity/T06/1")


def migration_cases(profile: str) -> set[str]:
    return {c.id for c in select_cases(load_cases(), None, profile=profile) if "migration" in c.needs}


def test_every_migration_row_has_a_case_or_a_reason() -> None:
    rows = {r for r, row in spec_rows().items() if row.table == "migration"}
    assert rows == {f"G{i:02d}" for i in range(1, 14)}
    covered = {r for c in load_cases() if c.id.startswith("migration/") for r in c.rows if r.startswith("G")}
    assert covered | (set(untestable()) & rows) == rows and not covered & set(untestable())
    assert set(untestable()) & rows == {"G01", "G02"}
    for profile in ("reference", "unified"):
        got = {c.split("/")[1] for c in migration_cases(profile)}
        assert got == {"G03", "G05", "G06", "G07", "G08", "G09", "G10", "G11", "G12", "G13"} | ({"G04"} if profile == "reference" else set()), got


@pytest.mark.parametrize(("profile", "workers", "http2"), [("reference", 1, False), ("reference", 2, True), ("unified", 1, True), ("unified", 2, False)],
                         ids=["reference-1-h1", "reference-2-h2c", "unified-1-h2c", "unified-2-h1"])
def test_the_migration_cases_pass_against_narwhal_served(monkeypatch: pytest.MonkeyPatch, profile: str, workers: int, http2: bool) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    p = get_profile(profile)
    base = free_port_base([p])
    serve = f"{sys.executable} -m narwhal.cli serve --config {{config}} --listen {{listen}} --workers {workers} --log-level warning"
    want = migration_cases(profile) | set(AFFECTED)
    code, out = run(f"http://{p.listen(base)}", profile, base, "--serve", serve, "--strict", *(["--http2"] if http2 else []), "--case", *sorted(want))
    results = parse_results(out)
    have = out.split("capabilities: ", 1)[1].split(";")[0].split(", ")
    assert "migration" in have, out  # detected
    assert code == 0 and set(results) == want and set(results.values()) == {"PASS"}, out


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[int, str]]:
    """One fleet (profile unified) and a router on it without migration: print-config's
    configuration as it is."""
    profile = get_profile("unified")
    base = free_port_base([profile])
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-migration-conformance-"))
    cfg = router_config(profile, base, listen=profile.listen(base))
    assert "migration" not in cfg["upstream"]
    with running_fleet([profile], base), serving(profile, base, tmp, {"plain": (profile.listen(base), cfg)}) as targets:
        yield base, targets["plain"]


def test_without_migration_the_cases_are_na_and_the_failures_as_before(plain: tuple[int, str]) -> None:
    base, target = plain
    cases = migration_cases("unified")
    code, out = run(target, "unified", base, "--strict", "--verbose", "--case", "migration", *AFFECTED)
    results = parse_results(out)
    assert code == 0 and {k for k, v in results.items() if v == "N/A"} == cases, out
    assert all(results[k] == "PASS" for k in AFFECTED), out  # the content before the cut checked
    assert "a stream whose engine drops after 8 tokens ends with an error event (code 'engine_unreachable')" in out, out
    assert out.count("N/A: needs migration (a stream whose engine drops") == len(cases), out
    assert "holds only without migration" not in out, out
    # --no-capability: N/A whatever the router has
    code, out = run(target, "unified", base, "--case", "migration/G11", "--no-capability", "migration")
    assert code == 0 and set(parse_results(out).values()) == {"N/A"} and "denied by --no-capability" in out, out


def test_declared_without_migration_the_cases_fail(plain: tuple[int, str]) -> None:
    """A CI gate that pins the capability gets a Fail, not an N/A, when the router lost it."""
    base, target = plain
    code, out = run(target, "unified", base, "--case", "migration/G11/1", "migration/G06/1", "--capability", "migration")
    assert code == 1 and parse_results(out) == {"migration/G11/1": "FAIL", "migration/G06/1": "PASS"}, out


def test_print_config_adds_migration_only_when_asked(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert cli.run(p.parse_args(["print-config"])) == 0
    assert "migration" not in yaml.safe_load(capsys.readouterr().out)["upstream"]
    assert cli.run(p.parse_args(["print-config", "--profile", "unified", "--capability", "migration"])) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["upstream"]["migration"] == MIGRATION == {"max_attempts": 1}
    from narwhal.config import parse_config

    assert parse_config(cfg).upstream.migration.max_attempts == 1  # a valid Narwhal configuration
