"""Observability (issue 23): traces (`tracing.py`: OpenTelemetry over OTLP, bounded) and
logs (`logs.py`: `serving.log_format` json, the request-end record, the router's events,
stable field names). docs/observability.md describes both.

Imports nothing of the router: the data plane, the HTTP shell and the authority call in.
`tracing` (the OpenTelemetry SDK) is imported only where tracing is configured.
"""
