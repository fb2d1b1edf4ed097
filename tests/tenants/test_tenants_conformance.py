"""Capability `tenants` of the conformance suite against Narwhal (issue 22 item 5): a router
the runner starts from `{config}` (`--serve`) has the suite's tenants and their keys, is
sent the run key, and passes the cases of rows R17-R20 (one process and `--workers 2`,
profiles reference and unified, HTTP/1.1 and h2c); a router without the tenants (no auth,
or auth without per-tenant limits) gets those cases N/A, never a Fail; print-config
--capability tenants writes a keys file and a configuration Narwhal accepts."""

from __future__ import annotations

import argparse
import hashlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from narwhal_conformance import cli
from narwhal_conformance.cases import load_cases, select_cases
from narwhal_conformance.cli import add_arguments
from narwhal_conformance.fleet import running_fleet
from narwhal_conformance.profiles import (
    RUN_KEY,
    TENANT_KEYS,
    TENANTS,
    get_profile,
    keys_file_entries,
    router_config,
)
from tests.conformance.support import ADMIN_TOKEN, free_port_base, parse_results, run, serving

ROWS = ("refusals/R17", "refusals/R18", "refusals/R19", "refusals/R20")


def tenant_cases(profile: str) -> set[str]:
    return {c.id for c in select_cases(load_cases(), None, profile=profile) if "tenants" in c.needs}


def test_every_tenant_row_has_a_case_on_both_profiles() -> None:
    for profile in ("reference", "unified"):
        got = tenant_cases(profile)
        assert {c.rsplit("/", 1)[0] for c in got} == set(ROWS), got


@pytest.mark.parametrize(("profile", "workers", "http2"), [("reference", 1, False), ("reference", 2, True), ("unified", 2, False)],
                         ids=["reference-1-h1", "reference-2-h2c", "unified-2-h1"])
def test_the_tenant_cases_pass_against_narwhal_served(monkeypatch: pytest.MonkeyPatch, profile: str, workers: int, http2: bool) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    p = get_profile(profile)
    base = free_port_base([p])
    serve = f"{sys.executable} -m narwhal.cli serve --config {{config}} --listen {{listen}} --workers {workers} --log-level warning"
    extra = ["--serve", serve, "--strict", *(["--http2"] if http2 else []), "--case", *ROWS, "refusals/R15", "refusals/R16", "failures/H10"]
    code, out = run(f"http://{p.listen(base)}", profile, base, *extra)
    results = parse_results(out)
    have = out.split("capabilities: ", 1)[1].split(";")[0].split(", ")
    assert "tenants" in have and "auth" in have, out  # detected: the run key is sent
    want = tenant_cases(profile) | {c.id for c in select_cases(load_cases(), ["refusals/R15", "refusals/R16", "failures/H10"], profile=profile)}
    assert code == 0 and set(results) == want and set(results.values()) == {"PASS"}, out


@pytest.fixture(scope="module")
def plain() -> Iterator[tuple[int, dict[str, str], str]]:
    """One fleet (profile unified) and two routers on it without tenants: print-config's
    configuration as it is (no auth), and with auth (the suite's keys) but no tenants."""
    profile = get_profile("unified")
    base = free_port_base([profile])
    tmp = Path(tempfile.mkdtemp(prefix="narwhal-tenants-conformance-"))
    keys = tmp / "tenant-keys.yaml"  # not keys.yaml: the configuration of router "keys"
    keys.write_text(yaml.safe_dump(keys_file_entries()))
    keyed = router_config(profile, base, listen=profile.listen(base + 7))
    keyed["auth"] = {"keys_file": str(keys)}
    configs = {"open": (profile.listen(base), router_config(profile, base, listen=profile.listen(base))), "keys": (profile.listen(base + 7), keyed)}
    with running_fleet([profile], base), serving(profile, base, tmp, configs) as targets:
        yield base, targets, str(tmp)


def test_without_tenants_the_cases_are_na(plain: tuple[int, dict[str, str], str]) -> None:
    base, targets, _ = plain
    cases = tenant_cases("unified")
    code, out = run(targets["open"], "unified", base, "--case", *ROWS)
    assert code == 0 and set(parse_results(out)) == cases and set(parse_results(out).values()) == {"N/A"}, out
    assert "a second request of tenant t-probe (requests_per_s 0.1) at once answers 200" in out, out
    # keys (the run's and the tenants') but no tenants: limits nowhere, N/A as well
    code, out = run(targets["keys"], "unified", base, "--case", *ROWS, "--header", f"Authorization: Bearer {RUN_KEY}")
    assert code == 0 and set(parse_results(out).values()) == {"N/A"}, out
    assert "auth" in out.split("capabilities: ", 1)[1].split(";")[0].split(", "), out
    # --no-capability: N/A whatever the router has
    code, out = run(targets["open"], "unified", base, "--case", *ROWS, "--no-capability", "tenants")
    assert code == 0 and set(parse_results(out).values()) == {"N/A"} and "denied by --no-capability" in out, out


def test_declared_without_tenants_the_cases_fail(plain: tuple[int, dict[str, str], str]) -> None:
    """A CI gate that pins the capability gets a Fail, not an N/A, when the router lost it."""
    base, targets, _ = plain
    code, out = run(targets["open"], "unified", base, "--case", "refusals/R17", "--capability", "tenants")
    assert code == 1 and parse_results(out) == {"refusals/R17/1": "FAIL"}, out


def test_print_config_writes_the_keys_and_the_tenants(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert cli.run(p.parse_args(["print-config"])) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert "auth" not in cfg and "tenants" not in cfg  # as before: no key needed
    keys = tmp_path / "keys.yaml"
    assert cli.run(p.parse_args(["print-config", "--capability", "tenants", "--keys-file", str(keys)])) == 0
    out = capsys.readouterr().out
    assert RUN_KEY in out  # the header to run with
    cfg = yaml.safe_load(out)
    assert cfg["auth"] == {"keys_file": str(keys)} and cfg["tenants"] == TENANTS
    entries = yaml.safe_load(keys.read_text())
    by_tenant = {e["tenant"]: e["sha256"] for e in entries}
    assert by_tenant["conformance"] == hashlib.sha256(RUN_KEY.encode()).hexdigest()
    assert all(by_tenant[t] == hashlib.sha256(k.encode()).hexdigest() for t, k in TENANT_KEYS.items())
    assert all(k not in keys.read_text() for k in [RUN_KEY, *TENANT_KEYS.values()])  # digests only
    from narwhal.config import parse_config

    parsed = parse_config(cfg)  # a valid Narwhal configuration
    assert parsed.auth is not None and parsed.tenants is not None
    # without --keys-file: the entries as comments, the file named
    assert cli.run(p.parse_args(["print-config", "--capability", "tenants"])) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out)["auth"] == {"keys_file": "narwhal-conformance-keys.yaml"} and "#   - id: conformance-run-0" in out


def test_serve_config_has_the_keys_of_the_run(tmp_path: Path) -> None:
    """{config} names a keys file with the tenants' keys and the run's (--header's if
    given); the run key is sent only to a command that reads {config} and only when
    --header gives no key."""
    seen = tmp_path / "seen"
    cmd = f"{sys.executable} -c \"import sys, shutil, yaml; c = yaml.safe_load(open(sys.argv[2])); shutil.copy(sys.argv[2], sys.argv[1] + '.yaml'); shutil.copy(c['auth']['keys_file'], sys.argv[1] + '.keys')\" {seen} {{config}}"
    with cli._served(cmd, get_profile("reference"), "http://127.0.0.1:18200", 18200, run_keys=["sk-vendor-key"]):
        import time

        end = time.monotonic() + 10
        while not Path(str(seen) + ".keys").exists() and time.monotonic() < end:
            time.sleep(0.05)
    cfg = yaml.safe_load(Path(str(seen) + ".yaml").read_text())
    assert cfg["tenants"] == TENANTS
    entries = yaml.safe_load(Path(str(seen) + ".keys").read_text())
    assert {"id": "conformance-run-0", "tenant": "conformance", "sha256": hashlib.sha256(b"sk-vendor-key").hexdigest()} in entries
    assert cli._serve_headers("narwhal serve --config {config}", {}) == {"authorization": f"Bearer {RUN_KEY}"}
    assert cli._serve_headers("narwhal serve --config {config}", {"x-api-key": "k"}) == {"x-api-key": "k"}
    assert cli._serve_headers("my-router --port 1", {}) == {}
    assert cli._serve_headers(None, {}) == {}
    assert cli._run_keys({"authorization": "Bearer sk-a", "x-api-key": "sk-b"}) == ["sk-a", "sk-b"]
    assert cli._run_keys({"authorization": "Basic xyz"}) == []
