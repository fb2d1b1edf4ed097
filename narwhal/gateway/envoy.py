"""The reference Envoy configuration for Narwhal as endpoint picker (`narwhal gateway
envoy-config`): a bootstrap for Envoy 1.40 (docs/gateway.md).

What it holds, and why:
  * a listener on `--listen` whose HTTP connection manager first removes any
    `x-gateway-destination-endpoint` the client sent (early header mutation: only the
    picker names the endpoint), then runs the ext_proc filter against the picker at
    `--epp`: request and response headers SEND, bodies FULL_DUPLEX_STREAMED, trailers SEND,
    `message_timeout` (the endpoint-picker protocol's reference configuration), the
    route cache cleared after the picker's header mutation, `failure_mode_allow` as
    asked (`--failure-mode-allow`: FailOpen; default FailClose);
  * route 1: a request carrying the picker's header goes to `inference_pool`. Without
    `--pool` (the protocol's reference shape), an ORIGINAL_DST cluster that connects where
    `x-gateway-destination-endpoint` says (`original_dst_lb_config: {use_http_header:
    true}`): one endpoint, no fallback, so the picker must name one
    (`gateway.max_fallbacks: 0`: a list is not an address to ORIGINAL_DST). With `--pool`,
    the `--pool` endpoints (the engines, IP literals) under Envoy's override-host load-balancing policy
    (`envoy.load_balancing_policies.override_host`), which connects to the endpoints the
    picker named in `envoy.lb` / `x-gateway-destination-endpoint`, in order: the route
    retries a connect failure (or a reset before the request went out) up to
    `--max-fallbacks` times, each retry on the list's next endpoint, and writes the
    endpoint it used to `envoy.lb` / `x-gateway-destination-endpoint-served`, which the
    ext_proc filter forwards to the picker with the response. Past the list the policy's
    fallback is a subset load balancer that matches no endpoint: a request never goes to
    an endpoint the picker did not name;
  * route 2, only with --failure-mode-allow: a request the picker did not answer (it is
    down) goes to `fail_open_pool`, the `--pool` endpoints round robin; without it the
    route answers 503 itself;
  * the picker's cluster over HTTP/2 with a gRPC health check of the service
    `envoy.service.ext_proc.v3.ExternalProcessor` (a standby picker answers
    NOT_SERVING, so Envoy sends it nothing).
"""

from __future__ import annotations

from typing import Any

from .decide import DESTINATION, LB_NAMESPACE, SERVED, SERVICE

__all__ = ["bootstrap", "host_port", "OBSERVED_UPSTREAM", "OBSERVED_PICKED"]

_T = "type.googleapis.com/envoy."


def host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not host or not 0 < int(port) < 65536:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


def _address(value: str) -> dict[str, Any]:
    host, port = host_port(value)
    return {"socket_address": {"address": host, "port_value": port}}


def _ext_proc(failure_mode_allow: bool, message_timeout_s: int) -> dict[str, Any]:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "narwhal_picker"}, "timeout": "10s"},
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
            },
            "message_timeout": f"{message_timeout_s}s",
            "failure_mode_allow": failure_mode_allow,
            "route_cache_action": "CLEAR",
            # the picker's dynamic metadata (envoy.lb: the endpoint it named) is taken
            # and Envoy's subset hint, when a load balancer sets one, is sent to the picker
            # and so is envoy.lb itself, where the load balancer wrote the endpoint it served
            "metadata_options": {"receiving_namespaces": {"untyped": [LB_NAMESPACE]},
                                 "forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint", LB_NAMESPACE]}},
        },
    }


# observation headers a test or the conformance suite may ask for (`observe`): where Envoy
# sent the request, and what the picker named in envoy.lb
OBSERVED_UPSTREAM = "x-epp-upstream-host"
OBSERVED_PICKED = "x-epp-picked"
_OBSERVE = [
    {"header": {"key": OBSERVED_UPSTREAM, "value": "%UPSTREAM_HOST%"}},
    {"header": {"key": OBSERVED_PICKED, "value": f"%DYNAMIC_METADATA(envoy.lb:{DESTINATION})%"}},
]


def _routes(failure_mode_allow: bool, max_fallbacks: int) -> list[dict[str, Any]]:
    route: dict[str, Any] = {"cluster": "inference_pool", "timeout": "0s"}
    if max_fallbacks:
        # the list's next endpoint when a connection could not be made (nothing reached the engine)
        route["retry_policy"] = {"retry_on": "connect-failure,reset-before-request", "num_retries": max_fallbacks}
    picked = {"match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]}, "route": route}
    if failure_mode_allow:
        rest: dict[str, Any] = {"match": {"prefix": "/"}, "route": {"cluster": "fail_open_pool", "timeout": "0s"}}
    else:
        rest = {"match": {"prefix": "/"}, "direct_response": {"status": 503, "body": {"inline_string": "no endpoint picked\n"}}}
    return [picked, rest]


def _listener(listen: str, failure_mode_allow: bool, message_timeout_s: int, max_fallbacks: int, observe: bool = False) -> dict[str, Any]:
    hcm = {
        "@type": _T + "extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "narwhal_gateway",
        "codec_type": "AUTO",
        "early_header_mutation_extensions": [{
            "name": "envoy.http.early_header_mutation.header_mutation",
            "typed_config": {
                "@type": _T + "extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation",
                "mutations": [{"remove": DESTINATION}],
            },
        }],
        "route_config": {"name": "inference", "virtual_hosts": [{"name": "inference", "domains": ["*"], "routes": _routes(failure_mode_allow, max_fallbacks),
                                                                 **({"response_headers_to_add": _OBSERVE} if observe else {})}]},
        "http_filters": [
            _ext_proc(failure_mode_allow, message_timeout_s),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _T + "extensions.filters.http.router.v3.Router"}},
        ],
    }
    return {
        "name": "narwhal_gateway",
        "address": _address(listen),
        "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager", "typed_config": hcm}]}],
    }


def _static(name: str, endpoints: list[str], *, http2: bool = False) -> dict[str, Any]:
    c: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "lb_policy": "ROUND_ROBIN",
        "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}]},
    }
    if http2:
        c["typed_extension_protocol_options"] = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": _T + "extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {"http2_protocol_options": {}},
        }}
    return c


_LB = _T + "extensions.load_balancing_policies."


def _override_host() -> dict[str, Any]:
    """The endpoints the picker named, in order (one more for each retry); past them, none."""
    nothing = {"name": "envoy.load_balancing_policies.subset", "typed_config": {
        "@type": _LB + "subset.v3.Subset", "fallback_policy": "NO_FALLBACK", "subset_selectors": [{"keys": ["narwhal-never-set"]}],
        "subset_lb_policy": {"policies": [{"typed_extension_config": {"name": "envoy.load_balancing_policies.round_robin",
                                                                       "typed_config": {"@type": _LB + "round_robin.v3.RoundRobin"}}}]}}}
    return {"policies": [{"typed_extension_config": {"name": "envoy.load_balancing_policies.override_host", "typed_config": {
        "@type": _LB + "override_host.v3.OverrideHost",
        "override_host_sources": [{"metadata": {"key": LB_NAMESPACE, "path": [{"key": DESTINATION}]}}],
        "selected_host_key": {"key": LB_NAMESPACE, "path": [{"key": SERVED}]},
        "fallback_policy": {"policies": [{"typed_extension_config": nothing}]},
    }}}]}


def _pool(pool: tuple[str, ...]) -> dict[str, Any]:
    """`inference_pool` (module docstring, route 1): the named endpoints of `pool` in order,
    or, with no pool, wherever the picker's header says."""
    if pool:
        return {**{k: v for k, v in _static("inference_pool", list(pool)).items() if k != "lb_policy"}, "load_balancing_policy": _override_host()}
    return {"name": "inference_pool", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "5s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}}


def bootstrap(*, epp: str, listen: str, pool: tuple[str, ...] = (), failure_mode_allow: bool = False, message_timeout_s: int = 1000,
              health_interval_ms: int = 1000, admin: str | None = None, observe: bool = False, max_fallbacks: int | None = None) -> dict[str, Any]:
    """The bootstrap as a mapping (YAML or JSON to Envoy). `pool`: the engines' IP:PORT
    (the endpoints the picker may name; none: the ORIGINAL_DST shape, one endpoint, no
    fallback). `max_fallbacks`: 2 with a pool, 0 without. `observe`: every response names
    the upstream Envoy used (x-epp-upstream-host) and what the picker named (x-epp-picked),
    for tests and the conformance suite's `epp` profile."""
    if max_fallbacks is None:
        max_fallbacks = 2 if pool else 0
    if not pool and max_fallbacks:
        raise ValueError("--max-fallbacks needs the --pool endpoints: ORIGINAL_DST follows one endpoint, and retries nowhere else")
    if failure_mode_allow and not pool:
        raise ValueError("--failure-mode-allow needs the --pool endpoints a request goes to when the picker is down")
    if not 0 <= max_fallbacks <= 8:
        raise ValueError("--max-fallbacks takes 0..8 (Narwhal's gateway.max_fallbacks)")
    picker = _static("narwhal_picker", [epp], http2=True)
    # a picker that is not SERVING gets nothing (Envoy's default panic threshold would send
    # to an unhealthy single host anyway): the ext_proc stream fails at once, and
    # failure_mode_allow decides
    picker["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}, "update_merge_window": "0s"}  # health applied at once
    every = f"{health_interval_ms / 1000:.3f}s"
    picker["health_checks"] = [{
        # the same interval while the picker has no traffic (Envoy's default there is 60 s:
        # a standby would be sent the first requests after a take-over elsewhere)
        "timeout": "1s", "interval": every, "no_traffic_interval": every, "no_traffic_healthy_interval": every,
        "unhealthy_threshold": 1, "healthy_threshold": 1,
        "grpc_health_check": {"service_name": SERVICE},
    }]
    clusters = [_pool(pool), picker]
    if failure_mode_allow:
        clusters.append(_static("fail_open_pool", list(pool)))
    out: dict[str, Any] = {"static_resources": {"listeners": [_listener(listen, failure_mode_allow, message_timeout_s, max_fallbacks, observe)], "clusters": clusters}}
    if admin is not None:
        out["admin"] = {"address": _address(admin)}
    return out
