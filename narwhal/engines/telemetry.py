"""Prometheus instruments of one router (its own registry, so many routers can live in
one process, as tests do). Counters of the books are exported by a collector that reads
them at scrape time, so the request path increments plain integers only."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from narwhal_generated import accounting as A

__all__ = ["Telemetry"]

_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)


class _StateCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        s = self._read()
        books = s["books"]
        off = CounterMetricFamily(A.COUNTER_METRICS["offered"].removesuffix("_total"), "Requests offered to a completion route (C01).")
        off.add_metric([], books["offered"])
        yield off
        uns = CounterMetricFamily(A.COUNTER_METRICS["unsized_offered"].removesuffix("_total"), "Offered requests that ended before workload sizing (C02).")
        uns.add_metric([], books["unsized_offered"])
        yield uns
        term = CounterMetricFamily(A.TERMINAL_METRIC.removesuffix("_total"), "Offered requests by terminal class.", labels=["class"])
        for cls in A.TERMINAL_CLASSES:
            term.add_metric([cls], books["terminal"][cls])
        yield term
        g = GaugeMetricFamily("narwhal_requests_open", "Offered requests not yet ended (0 at rest).")
        g.add_metric([], books["open"])
        yield g
        g = GaugeMetricFamily("narwhal_http_retained", "Client requests the router holds (R02 counts these).")
        g.add_metric([], s["held"])
        yield g
        q = GaugeMetricFamily("narwhal_queue_depth", "Requests waiting in the admission queue, by phase.", labels=["phase"])
        q.add_metric(["first"], s["queued"])
        q.add_metric(["decode"], s["decode_queued"])
        yield q
        ready = GaugeMetricFamily("narwhal_router_state", "1 for the router's current state.", labels=["state"])
        for st in ("active", "standby", "fenced", "maintenance", "monitoring_degraded"):
            ready.add_metric([st], 1.0 if s["state"] == st else 0.0)
        yield ready
        inflight = GaugeMetricFamily("narwhal_engine_inflight", "Requests holding a phase slot, per engine and phase.", labels=["engine", "phase"])
        queued = GaugeMetricFamily("narwhal_engine_queued", "Phase-1 requests waiting for this engine.", labels=["engine"])
        healthy = GaugeMetricFamily("narwhal_engine_healthy", "1 when the last health poll succeeded.", labels=["engine"])
        eligible = GaugeMetricFamily("narwhal_engine_eligible", "1 when the engine is placement-eligible.", labels=["engine"])
        breaker = GaugeMetricFamily("narwhal_engine_circuit_open", "1 when the engine's circuit breaker is open.", labels=["engine"])
        drift = GaugeMetricFamily("narwhal_engine_drift_score", "Drift score z of measured vs profiled time, per phase.", labels=["engine", "phase"])
        tpot = GaugeMetricFamily("narwhal_engine_profile_tpot_seconds", "Profiled TPOT at batch 1 (with decode correction).", labels=["engine"])
        prof = GaugeMetricFamily("narwhal_engine_profile_status", "1 for the engine's profile status (failed: predictive admission uses default models for it).", labels=["engine", "status"])
        for e in s["engines"]:
            for st in PROFILE_STATUSES:
                prof.add_metric([e["name"], st], 1.0 if e["profile"]["status"] == st else 0.0)
            inflight.add_metric([e["name"], "prefill"], e["load"]["prefill_in_use"])
            inflight.add_metric([e["name"], "decode"], e["load"]["decode_in_use"])
            queued.add_metric([e["name"]], e["load"]["queued"])
            healthy.add_metric([e["name"]], 1.0 if e["healthy"] else 0.0)
            eligible.add_metric([e["name"]], 1.0 if e["eligible"] else 0.0)
            breaker.add_metric([e["name"]], 1.0 if "circuit_open" in e["ineligible_reasons"] else 0.0)
            drift.add_metric([e["name"], "prefill"], e["drift"]["prefill"]["score"])
            drift.add_metric([e["name"], "decode"], e["drift"]["decode"]["score"])
            tpot.add_metric([e["name"]], e["profile"]["decode"]["tpot_ms_at_batch_1"] / 1000.0)
        yield from (inflight, queued, healthy, eligible, breaker, drift, tpot, prof)


PROFILE_STATUSES = ("pending", "running", "ok", "failed")


class Telemetry:
    def __init__(self, read_state: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.ttft = Histogram("narwhal_ttft_seconds", "Time from arrival to the first token sent to the client.", ["route"], buckets=_LAT, registry=self.registry)
        self.tpot = Histogram("narwhal_tpot_seconds", "Time per output token, measured from token IDs (T11).", ["engine"], buckets=_TPOT, registry=self.registry)
        self.e2e = Histogram("narwhal_request_duration_seconds", "Time from arrival to the response's end, by terminal class.", ["class"], buckets=_LAT, registry=self.registry)
        self.refusal = Histogram("narwhal_refusal_seconds", "Time from arrival to a refusal's answer.", ["code"], buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.25, 1.0), registry=self.registry)
        self.registry.register(_StateCollector(read_state))
