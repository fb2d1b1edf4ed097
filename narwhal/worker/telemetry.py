"""Prometheus instruments of one data plane (its own registry, so many routers can live
in one process, as tests do): the request histograms. The books, queues and engine gauges
are the authority's (narwhal/authority/metrics.py); a scrape merges both, and every
sample from here carries the plane's `worker` label."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

__all__ = ["Telemetry", "families"]

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
CHILDREN = 4096  # labelled children Telemetry.child keeps (routes x classes, engines, codes, tenants)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class Telemetry:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("narwhal_ttft_seconds", "Time from arrival to the first token sent to the client.", ["route"], buckets=_LAT, registry=self.registry)
        self.tpot = Histogram("narwhal_tpot_seconds", "Time per output token, measured from token IDs (T11).", ["engine"], buckets=_TPOT, registry=self.registry)
        self.e2e = Histogram("narwhal_request_duration_seconds", "Time from arrival to the response's end, by terminal class.", ["class"], buckets=_LAT, registry=self.registry)
        self.refusal = Histogram("narwhal_refusal_seconds", "Time from arrival to a refusal's answer.", ["code"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0), registry=self.registry)
        # observability (narwhal/telemetry, issue 23): set by `observe`
        # per tenant (issue 22): observed only with tenants configured; the label is bounded
        # as the books' are (a configured tenant's name, `default`, or `other`)
        self.tenant_ttft = Histogram("narwhal_tenant_ttft_seconds", "Time from arrival to the first token sent to the client, per tenant (tenants configured).", ["tenant"], buckets=_LAT, registry=self.registry)
        self.migrations = Counter("narwhal_migrations", "Decode legs that failed after response headers, by cause (the failure row) and decision (spec/tables/migration.yaml: carry_on, or the reason it was not carried on).", ["cause", "decision"], registry=self.registry)
        self.trace_dropped = Counter("narwhal_trace_spans_dropped", "Ended spans dropped because the exporter's queue (observability.max_queue_size) was full.", registry=self.registry)
        self.trace_failed = Counter("narwhal_trace_spans_export_failed", "Spans lost in exports that failed or timed out (observability.export_timeout_ms).", registry=self.registry)
        self.tracing: Any = None  # narwhal.telemetry.tracing.Tracing when observability samples
        self.json_logs = False  # serving.log_format json: a request_end line per request
        self._children: dict[tuple[str, str], Any] = {}
        self._zero()

    def _zero(self) -> None:
        """Labelled counters whose label values are known start at 0 (issue 40 item 9):
        a series that first appears at 1 is no increase() to Prometheus, and an alert on
        the first event missed it. Bounded: the refusal rows' codes, the migration
        table's failures x decisions."""
        from narwhal_generated import errors as E
        from narwhal_generated import migration as G

        for row in E.ROWS.values():
            if row.id.startswith("R"):
                self.child(self.refusal, row.code)
        for cause in G.FAILURES:
            for decision in G.REASONS:
                self.migrations.labels(cause, decision)

    def child(self, metric: Any, label: str) -> Any:
        """`metric.labels(label)`, kept: prometheus_client's labels() checks its arguments
        and takes a lock on every call, several times per request. At most CHILDREN kept
        (then forgotten and made again: prometheus_client keeps every child anyway)."""
        key = (metric._name, label)
        c = self._children.get(key)
        if c is None:
            if len(self._children) >= CHILDREN:
                self._children.clear()
            c = self._children[key] = metric.labels(label)
        return c

    def forget_engine(self, name: str) -> None:
        """An engine left the fleet for good: its labelled children go (TPOT), so a fleet
        whose engines come and go under new names does not grow the scrape or the
        process without bound (a request still streaming from it adds its child back
        only while that engine is in the plane's fleet: Run._learn, worker/legs.py)."""
        self._children.pop((self.tpot._name, name), None)
        try:
            self.tpot.remove(name)
        except KeyError:
            pass  # never observed

    def observe(self, config: Any, *, worker: int | None = None) -> None:
        """observability.* and serving.log_format of this process (at start; both need a restart)."""
        from ..telemetry.tracing import Tracing

        self.tracing = Tracing.of(config.observability, on_dropped=self.trace_dropped.inc, on_failed=self.trace_failed.inc, worker=worker)
        self.json_logs = config.serving.log_format == "json"

    def close(self) -> None:
        """Flush the spans still queued (bounded), at exit."""
        if self.tracing is not None:
            self.tracing.shutdown()
            self.tracing = None


def families(registry: CollectorRegistry, worker: int) -> list[list[Any]]:
    """This plane's families as plain data for the authority's merge
    ([name, help, type, unit, [[sample, labels, value], ...]]), every sample labelled
    with its worker."""
    w = str(worker)
    return [[m.name, m.documentation, m.type, m.unit, [[s.name, {**s.labels, "worker": w}, s.value] for s in m.samples]] for m in registry.collect()]
