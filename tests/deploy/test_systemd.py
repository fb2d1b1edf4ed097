"""deploy/systemd/narwhal.service: `systemd-analyze verify` accepts it with no warning
(when systemd-analyze runs here), its offline security exposure stays low, and its stop
and reload agree with the router: SIGTERM, TimeoutStopSec above serving.shutdown_grace_ms,
ExecReload sends SIGHUP, a non-root user. deploy/systemd/narwhal.yaml loads with
narwhal's own config loader."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from narwhal.config import parse_config
from tests.deploy.promql import ROOT

UNIT = ROOT / "deploy" / "systemd" / "narwhal.service"


def _directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", "[")):
            continue
        k, v = line.split("=", 1)
        out.setdefault(k, []).append(v)
    return out


def test_the_unit_stops_and_reloads_as_the_router_expects() -> None:
    d = _directives()
    cfg = parse_config(yaml.safe_load((ROOT / "deploy" / "systemd" / "narwhal.yaml").read_text()), source="deploy/systemd/narwhal.yaml")
    assert d["KillSignal"] == ["SIGTERM"]
    assert d["KillMode"] == ["mixed"]
    assert int(d["TimeoutStopSec"][0]) * 1000 > max(cfg.serving.shutdown_grace_ms, cfg.serving.shutdown_delay_ms) + 5000
    assert d["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert d["User"] == ["narwhal"] and d["Group"] == ["narwhal"]
    assert d["ExecStart"][0].split()[1:] == ["serve", "--config", "/etc/narwhal/narwhal.yaml"]
    assert d["RestartPreventExitStatus"] == ["2"]  # an invalid configuration is not retried
    for k in ("NoNewPrivileges", "ProtectSystem", "ProtectHome", "PrivateTmp", "RestrictAddressFamilies", "SystemCallFilter", "CapabilityBoundingSet"):
        assert k in d, k


def _runnable_copy(tmp: Path) -> Path:
    """The unit with ExecStart pointing at this environment's `narwhal` (verify checks it exists)."""
    exe = Path(sys.executable).parent / "narwhal"
    assert exe.exists(), exe
    text = UNIT.read_text().replace("/opt/narwhal/bin/narwhal", str(exe))
    out = tmp / "narwhal.service"
    out.write_text(text)
    return out


@pytest.fixture
def analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.skip("systemd-analyze is not installed here (Debian: systemd)")
    return tool


def test_systemd_analyze_verify_has_no_warning(analyze: str, tmp_path: Path) -> None:
    r = subprocess.run([analyze, "verify", str(_runnable_copy(tmp_path))], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "" and r.stderr.strip() == "", r.stdout + r.stderr


def test_systemd_analyze_verify_catches_a_wrong_directive(analyze: str, tmp_path: Path) -> None:
    u = _runnable_copy(tmp_path)
    u.write_text(u.read_text().replace("KillSignal=SIGTERM", "KillSignal=SIGTERMX"))
    r = subprocess.run([analyze, "verify", str(u)], capture_output=True, text=True, timeout=60)
    assert "SIGTERMX" in r.stdout + r.stderr


def test_security_exposure_is_low(analyze: str, tmp_path: Path) -> None:
    r = subprocess.run([analyze, "security", "--offline=yes", "--no-pager", str(_runnable_copy(tmp_path))], capture_output=True, text=True, timeout=60)
    m = re.search(r"Overall exposure level for narwhal\.service: ([\d.]+)", r.stdout + r.stderr)
    assert m, r.stdout[-2000:] + r.stderr
    assert float(m.group(1)) <= 2.0, r.stdout[-3000:]
