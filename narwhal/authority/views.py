"""Read models of the authority: what /v1/engines, /ready and /metrics show. Every data
plane (in process or a worker) answers these routes from here, so whichever worker a
client reaches gives the same answer."""

from __future__ import annotations

import asyncio
from typing import Any

from narwhal_generated import dialects as D

from ..core.fleet import EngineState
from . import profiler
from .authority import Authority
from .control import ControlPlane

__all__ = ["engine_view", "engines", "ready", "state_snapshot"]


def engine_view(a: ControlPlane, e: EngineState) -> dict[str, Any]:
    now = a.clock.now()
    reasons = e.ineligible_reasons(a.state.maintenance_waves)
    pc = a.prompt_counters.get(e.name)
    return {
        "name": e.name,
        "url": e.url,
        "role": e.role,
        "dialect": e.dialect,
        "wave": e.wave,
        "model": e.model or a.config.serving.model,
        "healthy": e.healthy,
        "eligible": not reasons,
        "ineligible_reasons": reasons,
        "draining": e.draining,
        "lifecycle": {**e.lifecycle.snapshot(now), "source": e.source,
                      "leave_in_s": round(max(0.0, e.leave_by - now), 3) if e.leave_by is not None and e.lifecycle.state == "draining" else None,
                      "rejoins_after": e.pending is not None},
        "circuit_breaker": e.breaker.snapshot(),
        "last_health_age_ms": None if e.last_observed is None else round((now - e.last_observed) * 1000.0, 1),
        "last_error": e.last_error,
        "token_accounting": D.BY_NAME[e.dialect].token_accounting,
        "prompt_count": pc.kind if pc is not None else None,
        "max_concurrency": e.max_concurrency,
        "profile": {
            "status": e.profile_status,
            "error": e.profile_error,
            "consecutive_failures": e.profile_failures,
            "next_retry_s": round(max(0.0, profiler.retry_s(e) - (now - e.profile_attempted)), 1) if e.profile_status == "failed" and e.profile_attempted is not None else None,
            "prefill": e.prefill.snapshot(),
            "decode": e.decode.snapshot(),
            "decode_start": {"k0_ms": round(e.start_model.theta[0], 4), "k1_ms_per_ktoken": round(e.start_model.theta[1], 4), "samples": e.start_model.samples},
            "measurements": e.profile_samples,
        },
        "drift": {"prefill": e.prefill.drift.snapshot(), "decode": e.decode.drift.snapshot()},
        "output_length": a.scheduler.output_lengths.snapshot(),
        "load": e.load_snapshot(now),
        "prefix_cache": {**a.scheduler.prefix[e.name].snapshot(), **_feed(a, e.name)} if e.name in a.scheduler.prefix else None,
    }


def _feed(a: ControlPlane, name: str) -> dict[str, Any]:
    feed = a.kv_feeds.get(name)
    return {"events": feed.snapshot()} if feed is not None else {}


def engines(a: ControlPlane, *, sizing: dict[str, Any]) -> dict[str, Any]:
    """GET /v1/engines. `sizing`: the data plane's prompt sizing method (tokenizer or
    estimate) over the authority's learned ratio."""
    return {
        "object": "list",
        "data": [engine_view(a, e) for e in a.engines.values()],
        "router": {
            "state": a.state.reason(a.clock.now()) or "active",
            "scheduler": a.scheduler.snapshot(),
            "sizing": {**a.sizer.snapshot(), **sizing},
            "books": a.books.snapshot(),
            "held": a.held,
            "ha": _ha(a),
            "fleet": {**(f := a.membership.snapshot()), "source_errors": {**dict.fromkeys(a.sources, 0), **f["source_errors"]}},  # configured sources at 0 (issue 40 item 9)
            "tenants": tenants(a),
            "config": {"path": a.config_path, "sha256": a.config_hash, "loaded_at": a.config_loaded_at},
        },
    }


def _ha(a: ControlPlane) -> dict[str, Any] | None:
    """Leader election (ha): state, fencing token, lease, the recent state changes."""
    el = a.elector
    if el is None:
        return None
    took = a.took_over_at
    return {"name": el.name, "key": el.cfg.key, "took_over_at": None if took is None else round(took, 3), **el.leadership.snapshot(a.clock.now())}


def ready(a: Authority) -> tuple[int, dict[str, Any]]:
    """GET /ready: (status, body). It names the engines predictive admission runs on
    default models for (their profile failed): informational, never a reason to be
    unready."""
    failed = sorted(e.name for e in a.engines.values() if e.profile_status == "failed")
    extra: dict[str, Any] = {"unprofiled_engines": failed} if failed else {}
    reason = a.state.reason(a.clock.now())
    if reason is None:
        return 200, {"ready": True, "state": "active", **extra}
    return 503, {"ready": False, "state": reason, "reason": reason, **extra}


def tenants(a: Authority) -> dict[str, dict[str, Any]] | None:
    """Per tenant label (configured tenants, default, other): requests in flight, queued
    (every engine's phase-1 queue), weight; None when no tenants are configured."""
    q = a.quotas
    if q is None:
        return None
    out: dict[str, dict[str, Any]] = {}

    def row(label: str) -> dict[str, Any]:
        return out.setdefault(label, {"in_flight": 0, "queued": 0, "weight": q.limits_of(None if label == "default" else label).weight})

    for name in sorted(q.configured):
        row(name)
    for name, b in q.books.items():
        row(q.label(None if name == "default" else name))["in_flight"] += b.in_flight
    if q.overflow is not None and q.overflow.in_flight:  # tenants past the books' bound (core/quota.py)
        row("other")["in_flight"] += q.overflow.in_flight
    for e in a.engines.values():
        for t in e.queue:
            row(q.label(t.work.tenant))["queued"] += 1
    return out


# a scrape's engines are read this many at a time, the event loop let go between two
# batches (issue 40 item 4: 7,000 engines held the loop 2.7 s; now no batch holds it
# more than about a millisecond; the rendering runs in a thread, service.py)
SCRAPE_BATCH = 64


async def state_snapshot_paced(a: ControlPlane) -> dict[str, Any]:
    """state_snapshot, the engines read SCRAPE_BATCH at a time with the loop let go in
    between (bounded staleness: one scrape's engines are read within a few ms, each
    engine's own view whole; an engine gone meanwhile is left out)."""
    out = state_snapshot(a, engines=False)
    views: list[dict[str, Any]] = []
    names = list(a.engines)
    for i in range(0, len(names), SCRAPE_BATCH):
        if i:
            await asyncio.sleep(0)
        views.extend(engine_view(a, e) for n in names[i:i + SCRAPE_BATCH] if (e := a.engines.get(n)) is not None)
    out["engines"] = views
    return out


def state_snapshot(a: ControlPlane, *, engines: bool = True) -> dict[str, Any]:
    """What the authority's metrics collector exports."""
    return {
        "tenants": tenants(a),
        "fleet": {**(f := a.membership.snapshot()), "source_errors": {**dict.fromkeys(a.sources, 0), **f["source_errors"]}},  # configured sources at 0 (issue 40 item 9)
        "books": a.books.snapshot(),
        "held": a.held,
        "queued": a.scheduler.queued,
        "decode_queued": len(a.scheduler.decode_queue),
        "preemptions": a.preemptions,
        "state": a.state.reason(a.clock.now()) or "active",
        "engines": [engine_view(a, e) for e in a.engines.values()] if engines else [],
    }
