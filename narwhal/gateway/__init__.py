"""Narwhal as the endpoint picker of an Envoy-based gateway (docs/gateway.md): the
decisions (decide.py, sans-IO), one stream against the door (exchange.py), the gRPC shell
(server.py) and the reference Envoy configuration (envoy.py)."""
