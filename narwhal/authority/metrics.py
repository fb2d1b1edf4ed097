"""The authority's metrics, and one exposition for the whole router.

The books, queues, router state and engine gauges are read from the authority at scrape
time (a collector: the request path only increments plain integers). Each data plane
(in process, or a worker process) sends its own families (narwhal/worker/telemetry.py
`families`: request
histograms, client connections), every sample labelled with its `worker`; `render`
merges them family by family, so a scrape shows each metric once (one HELP and TYPE)
with one series per worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from narwhal_generated import accounting as A
from narwhal_generated import lifecycle as M
from narwhal_generated import router_states as S

from ..core.lifecycle import CHANGES

__all__ = ["render", "PROFILE_STATUSES", "Family"]

PROFILE_STATUSES = ("pending", "running", "ok", "failed")

# one family as plain data: [name, help, type, unit, [[sample name, labels, value], ...]]
Family = list[Any]
_ZERO_BOOKS = {"offered": 0, **dict.fromkeys(A.TERMINAL_CLASSES, 0)}




class _StateCollector(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]) -> None:
        self._read = read

    def collect(self) -> Iterator[Any]:
        s = self._read()
        for part in (self._books, self._tenants, self._router, self._fleet, self._engines):
            yield from part(s)

    @staticmethod
    def _books(s: dict[str, Any]) -> Iterator[Any]:
        """The books: offered (C01), unsized (C02), terminal classes."""
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

    @staticmethod
    def _tenants(s: dict[str, Any]) -> Iterator[Any]:
        """Each tenant's books and load (tenants configured; configured tenants from 0)."""
        books = s["books"]
        by_tenant = {**{t: _ZERO_BOOKS for t in (s.get("tenants") or ())}, **books.get("by_tenant", {})}  # configured tenants from 0 (issue 40 item 9)
        if by_tenant:  # tenants configured: each tenant's books (labels bounded: configured, default, other)
            toff = CounterMetricFamily("narwhal_tenant_requests_offered", "Requests offered, per tenant (the fleet's offered is their sum).", labels=["tenant"])
            tterm = CounterMetricFamily("narwhal_tenant_requests_terminal", "Offered requests by terminal class, per tenant.", labels=["tenant", "class"])
            for name, tb in sorted(by_tenant.items()):
                toff.add_metric([name], tb["offered"])
                for cls in A.TERMINAL_CLASSES:
                    tterm.add_metric([name, cls], tb[cls])
            yield toff
            yield tterm
        tv = s.get("tenants")
        if tv:
            tin = GaugeMetricFamily("narwhal_tenant_in_flight", "Requests offered and not yet ended, per tenant (tenants.NAME.max_in_flight: R17).", labels=["tenant"])
            tq = GaugeMetricFamily("narwhal_tenant_queued", "Requests waiting in the admission queue, per tenant (tenants.NAME.queue_limit: R20).", labels=["tenant"])
            for name, v in sorted(tv.items()):
                tin.add_metric([name], v["in_flight"])
                tq.add_metric([name], v["queued"])
            yield tin
            yield tq

    @staticmethod
    def _router(s: dict[str, Any]) -> Iterator[Any]:
        """The router's own gauges: open requests, retention (R02), queues, its state."""
        books = s["books"]
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
        p = CounterMetricFamily("narwhal_fair_preemptions", "Requests asked to leave their engine's slot for a lighter tenant's waiting request and be carried on after it (admission.fair_preempt, core/preempt.py).")
        p.add_metric([], s.get("preemptions", 0))
        yield p
        ready = GaugeMetricFamily("narwhal_router_state", "1 for the router's current state.", labels=["state"])
        for st in ("active", *S.NOT_READY_PRECEDENCE):
            ready.add_metric([st], 1.0 if s["state"] == st else 0.0)
        yield ready

    @staticmethod
    def _fleet(s: dict[str, Any]) -> Iterator[Any]:
        """Fleet membership changes and source errors (spec/tables/lifecycle.yaml)."""
        fleet = s["fleet"]
        ch = CounterMetricFamily("narwhal_fleet_changes", "Fleet membership changes by kind (spec/tables/lifecycle.yaml): join, ready (joined: takes traffic), update (settings in place), leave (draining to go; a replace leaves too), cut (drain timeout), gone, drain_on/drain_off (the operator's drain).", labels=["change"])
        for k in CHANGES:
            ch.add_metric([k], fleet["changes"].get(k, 0))
        yield ch
        se = CounterMetricFamily("narwhal_fleet_source_errors", "Reads of a fleet source (discovery file, etcd) that changed nothing because they could not be read or validated.", labels=["source"])
        for src, n in sorted(fleet["source_errors"].items()):
            se.add_metric([src], n)
        yield se

    @staticmethod
    def _engines(s: dict[str, Any]) -> Iterator[Any]:
        """Per engine: lifecycle, profile, load, health, breaker, drift, prefix index."""
        inflight = GaugeMetricFamily("narwhal_engine_inflight", "Requests holding a phase slot, per engine and phase.", labels=["engine", "phase"])
        queued = GaugeMetricFamily("narwhal_engine_queued", "Phase-1 requests waiting for this engine.", labels=["engine"])
        healthy = GaugeMetricFamily("narwhal_engine_healthy", "1 when the last health poll succeeded.", labels=["engine"])
        eligible = GaugeMetricFamily("narwhal_engine_eligible", "1 when the engine is placement-eligible.", labels=["engine"])
        breaker = GaugeMetricFamily("narwhal_engine_circuit_open", "1 when the engine's circuit breaker is open.", labels=["engine"])
        drift = GaugeMetricFamily("narwhal_engine_drift_score", "Drift score z of measured vs profiled time, per phase.", labels=["engine", "phase"])
        tpot = GaugeMetricFamily("narwhal_engine_profile_tpot_seconds", "Profiled TPOT at batch 1 (with decode correction).", labels=["engine"])
        pblocks = GaugeMetricFamily("narwhal_prefix_index_blocks", "Prompt blocks the router believes the engine holds in its prefix cache (core/prefix.py).", labels=["engine"])
        pcap = GaugeMetricFamily("narwhal_prefix_index_capacity_blocks", "The prefix index's size limit for the engine, in blocks (follows the engine's reports).", labels=["engine"])
        life = GaugeMetricFamily("narwhal_engine_lifecycle", "1 for the engine's lifecycle state (spec/tables/lifecycle.yaml).", labels=["engine", "state"])
        prof = GaugeMetricFamily("narwhal_engine_profile_status", "1 for the engine's profile status (failed: predictive admission uses default models for it).", labels=["engine", "status"])
        for e in s["engines"]:
            for st in M.STATES[:-1]:  # gone engines are not listed
                life.add_metric([e["name"], st], 1.0 if e["lifecycle"]["state"] == st else 0.0)
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
            if e.get("prefix_cache") is not None:
                pblocks.add_metric([e["name"]], e["prefix_cache"]["blocks"])
                pcap.add_metric([e["name"]], e["prefix_cache"]["capacity_blocks"])
        yield from (inflight, queued, healthy, eligible, breaker, drift, tpot, prof, pblocks, pcap, life)

class _Merged(Collector):
    def __init__(self, families: Iterable[Family]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for name, doc, typ, unit, samples in self._families:
            m = merged.get(name)
            if m is None:
                m = merged[name] = Metric(name, doc, typ, unit)
            for sname, labels, value in samples:
                m.add_sample(sname, labels, value)
        yield from merged.values()


def render(read_state: Callable[[], dict[str, Any]], planes: Iterable[list[Family]]) -> bytes:
    """The Prometheus text exposition of the authority and every data plane."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(_StateCollector(read_state))
    reg.register(_Merged([f for fams in planes for f in fams]))
    return generate_latest(reg)
