"""deploy/prometheus: the rules and the example configuration pass `promtool check`, the
promtool unit tests pass, and every alert is tested (it fires in some test), carries a
severity and a runbook that names a heading of docs/deployment.md.

promtool is Debian's (scripts/ops/prometheus.sh unpacks the package into a cache
folder): in CI (CI=true, or NARWHAL_REQUIRE_PROMETHEUS=1 as tox sets) a missing promtool
fails these tests; elsewhere they skip with the reason."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.promql import ROOT, promtool, require, rules

PROM = ROOT / "deploy" / "prometheus"


@pytest.fixture(scope="module")
def tool() -> Path:
    return require(promtool)


def _run(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=120, cwd=PROM)


def test_promtool_check_rules(tool: Path) -> None:
    r = _run(tool, "check", "rules", PROM / "alerts.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"SUCCESS: {len(rules())} rules found" in r.stdout


def test_promtool_check_config(tool: Path) -> None:
    r = _run(tool, "check", "config", PROM / "prometheus.yml")
    assert r.returncode == 0, r.stdout + r.stderr


def test_promtool_unit_tests_pass(tool: Path) -> None:
    r = _run(tool, "test", "rules", PROM / "alerts.test.yaml")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


def test_promtool_unit_tests_catch_a_wrong_expectation(tool: Path, tmp_path: Path) -> None:
    """The unit tests compare labels and annotations: a wrong expected value fails."""
    (tmp_path / "alerts.yaml").write_text((PROM / "alerts.yaml").read_text())
    text = (PROM / "alerts.test.yaml").read_text()
    assert text.count("TTFT p99 3.98s") == 1
    (tmp_path / "t.yaml").write_text(text.replace("TTFT p99 3.98s", "TTFT p99 3.5s"))
    r = subprocess.run([str(tool), "test", "rules", "t.yaml"], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode != 0 and "FAILED" in r.stdout + r.stderr


def test_every_alert_fires_in_a_unit_test() -> None:
    tests = yaml.safe_load((PROM / "alerts.test.yaml").read_text())["tests"]
    fired = {t["alertname"] for case in tests for t in case.get("alert_rule_test", []) if t.get("exp_alerts")}
    alerts = {r["alert"] for r in rules() if "alert" in r}
    assert alerts - fired == set(), "alerts no unit test makes fire"
    assert fired - alerts == set(), "unit tests of alerts that do not exist"


def test_every_alert_has_a_severity_and_a_runbook_in_the_docs() -> None:
    doc = (ROOT / "docs" / "deployment.md").read_text()
    headings = {re.sub(r"[^a-z0-9 _-]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", doc, re.M)}
    for r in rules():
        name = r["alert"]
        assert r["labels"]["severity"] in ("warning", "critical"), name
        assert r["annotations"]["runbook"] == f"docs/deployment.md#{name.lower()}", name
        assert name.lower() in headings, f"docs/deployment.md has no heading {name}"
        assert r["annotations"]["summary"], name
