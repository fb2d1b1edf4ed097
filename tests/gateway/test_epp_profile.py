"""`narwhal conformance --profile epp`: the endpoint-picker profile proven on a picker that
is not Narwhal (the suite's round-robin fixture: every interoperability case passes, the
Narwhal-profile cases fail, by design) and on Narwhal itself (everything passes), with
the JUnit and ConformanceReport files written."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any
from xml.etree import ElementTree as ET

import pytest
import yaml

from narwhal.http.server import free_port
from narwhal_conformance.epp import CASES, POOL_OFFSETS

pytestmark = pytest.mark.timeout(240)


def _port_base() -> int:
    """A base whose pool and picker ports are free now."""
    for _ in range(50):
        base = free_port() - 80
        if base < 1024:
            continue
        try:
            for off in (*POOL_OFFSETS, 79):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + off))
            return base
        except OSError:
            continue
    raise AssertionError("no free port base")


def _run(serve: str, tmp_path: Path, *cases: str) -> tuple[int, str, dict[str, Any], ET.Element]:
    base, epp = _port_base(), f"127.0.0.1:{free_port()}"
    report, junit = tmp_path / "report.yaml", tmp_path / "junit.xml"
    only = [a for c in cases for a in ("--case", c)]
    p = subprocess.run([sys.executable, "-m", "narwhal.cli", "conformance", "--profile", "epp", "--epp", epp, "--port-base", str(base),
                        "--serve", serve, "--report-output", str(report), "--junit", str(junit), *only], capture_output=True, text=True, timeout=200)
    return p.returncode, p.stdout, yaml.safe_load(report.read_text()), ET.parse(junit).getroot()


def _verdicts(rep: dict[str, Any], section: str) -> dict[str, str]:
    return {t["id"]: t["verdict"] for t in rep["profiles"][0][section]["tests"]}


_ROUND_ROBIN = f"{sys.executable} -m narwhal_conformance.epp_picker --listen {{epp}} {{pool}}"


def test_a_round_robin_picker_passes_interoperability_and_fails_the_narwhal_profile(tmp_path: Path) -> None:
    rc, out, rep, junit = _run(_ROUND_ROBIN + " --fallbacks 1", tmp_path)
    assert rc == 1, out  # the Narwhal-profile cases fail: it has no admission of its own
    assert rep["kind"] == "ConformanceReport" and rep["apiVersion"] == "gateway.networking.k8s.io/v1"
    core, extended = _verdicts(rep, "core"), _verdicts(rep, "extended")
    assert set(core.values()) <= {"Pass", "N/A"} and rep["profiles"][0]["core"]["result"] == "success", out
    assert core["epp/fallback/1"] == "Pass"  # its list's second endpoint answered while the first was down
    assert core["epp/refusal/2"] == "N/A"  # nothing refused
    assert extended == {"epp/admission/1": "Fail", "epp/accounting/1": "Fail"}
    assert "interoperability 9/9" in out and "Narwhal profile 0/2" in out
    assert len(junit.findall(".//testcase")) == len(CASES) + 2


def test_the_fallback_case_fails_a_picker_that_names_a_dead_endpoint_alone(tmp_path: Path) -> None:
    """The check can fail: round robin without fallbacks names the stopped engine first,
    alone, every other request; Envoy answers those 503."""
    rc, out, rep, _ = _run(_ROUND_ROBIN, tmp_path, "epp/fallback/1")
    assert rc == 0, out  # a SHOULD: Non-Strict, not a failed run
    assert _verdicts(rep, "core") == {"epp/fallback/1": "Non-Strict"}, out


def test_narwhal_as_picker_passes_the_whole_profile(tmp_path: Path) -> None:
    rc, out, rep, _ = _run(f"{sys.executable} -m narwhal.cli serve --config {{config}}", tmp_path)
    assert rc == 0, out
    core, extended = _verdicts(rep, "core"), _verdicts(rep, "extended")
    assert core["epp/refusal/2"] == "Pass"  # its admission refuses part of the burst, 429 with Retry-After
    assert core["epp/fallback/1"] == "Pass"  # its grant names a fallback; the books follow the one served
    assert set(core.values()) == {"Pass"}
    assert set(extended.values()) == {"Pass"}
    assert "interoperability 10/10" in out and "Narwhal profile 2/2" in out


def test_print_config_names_the_pool_and_gateway_listen() -> None:
    p = subprocess.run([sys.executable, "-m", "narwhal.cli", "conformance", "print-config", "--profile", "epp", "--port-base", "18200",
                        "--epp", "127.0.0.1:18290"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    cfg = yaml.safe_load(p.stdout)
    assert cfg["gateway"] == {"listen": "127.0.0.1:18290"}
    assert [e["url"] for e in cfg["engines"]] == [f"http://127.0.0.1:{18200 + o}" for o in POOL_OFFSETS]
