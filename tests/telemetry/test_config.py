"""observability.* and serving.log_format: defaults, bounds, and what a schema cannot say."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from narwhal.config import ConfigError, parse_config
from narwhal.telemetry.tracing import Tracing


def obs(**kw: Any) -> dict[str, Any]:
    return {"observability": kw}


def test_defaults_trace_nothing_and_log_text() -> None:
    cfg = parse_config({})
    o = cfg.observability
    assert (o.otlp_endpoint, o.sample_ratio, o.protocol) == (None, 0, "http/protobuf")
    assert (o.max_queue_size, o.max_export_batch_size, o.schedule_delay_ms, o.export_timeout_ms, o.client_sampled_per_s) == (2048, 512, 1000, 5000, 10)
    assert cfg.serving.log_format == "text"
    assert Tracing.of(o) is None
    # an endpoint with sampling 0: still off (no provider, no thread)
    assert Tracing.of(parse_config(obs(otlp_endpoint="http://127.0.0.1:4318")).observability) is None


@pytest.mark.parametrize(("cfg", "says"), [
    (obs(sample_ratio=0.5), "otlp_endpoint"),
    (obs(otlp_endpoint="http://c:4318", sample_ratio=1.5), "observability.sample_ratio"),
    (obs(otlp_endpoint="http://c:4318", sample_ratio=-0.1), "observability.sample_ratio"),
    (obs(otlp_endpoint="ftp://c", sample_ratio=1), "observability.otlp_endpoint"),
    (obs(otlp_endpoint="http://c:4318", max_queue_size=0), "observability.max_queue_size"),
    (obs(otlp_endpoint="http://c:4318", max_queue_size=70000), "observability.max_queue_size"),
    (obs(otlp_endpoint="http://c:4318", max_queue_size=10, max_export_batch_size=11), "observability.max_export_batch_size"),
    (obs(otlp_endpoint="http://c:4318", export_timeout_ms=10), "observability.export_timeout_ms"),
    (obs(otlp_endpoint="http://c:4318", schedule_delay_ms=10**6), "observability.schedule_delay_ms"),
    (obs(otlp_endpoint="http://c:4318", client_sampled_per_s=10**6), "observability.client_sampled_per_s"),
    (obs(otlp_endpoint="http://c:4318", protocol="thrift"), "observability.protocol"),
    (obs(unknown=1), "observability.unknown: unknown key"),
    ({"serving": {"log_format": "xml"}}, "serving.log_format"),
])
def test_refused(cfg: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace(".", r"\.")):
        parse_config(cfg)


@pytest.mark.skipif(importlib.util.find_spec("opentelemetry.exporter.otlp.proto.grpc") is not None, reason="the gRPC exporter is installed here")
def test_grpc_without_its_package_is_named() -> None:
    with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-grpc"):
        parse_config(obs(otlp_endpoint="http://c:4317", sample_ratio=1, protocol="grpc"))
    parse_config(obs(otlp_endpoint="http://c:4317", protocol="grpc"))  # sampling 0: nothing to export, no package needed
