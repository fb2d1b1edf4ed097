"""The engines' own load, for a router that takes over a fleet it did not place
(leader election, spec/tables/leadership.yaml L01 take_over).

A new leader's scheduler knows only the requests it placed itself: none. The previous
leader's requests may still run: it died (its engine connections closed, so vLLM and
SGLang abort them within a moment) or it was fenced (its streams run to their end).
Where the dialect publishes its load (dialects.yaml `load_metrics`: requests running and
waiting, GET /metrics), the engine's count minus our own is `EngineState.external`: it
takes slots in every capacity check and in the projections until the engine reports it
gone. Every health poll refreshes it while it is above zero, for at most
TAKEOVER_WINDOW_S. Without load metrics (the openai dialect) the new leader trusts its
own count from the start and learns the rest from the engine's latency (drift).
"""

from __future__ import annotations

import logging

from narwhal_generated import dialects as D

from ..core.fleet import EngineState
from ..upstream.client import UpstreamError
from .authority import Authority

__all__ = ["observe", "reported", "TAKEOVER_WINDOW_S"]

log = logging.getLogger("narwhal")

TAKEOVER_WINDOW_S = 120.0  # external load is followed this long after a take-over at most
METRICS_BYTES = 4 << 20  # an engine's /metrics the router reads


def reported(text: str, names: dict[str, str]) -> int | None:
    """Running + waiting from a Prometheus text exposition (summed over label sets), or
    None when neither gauge is there."""
    total = 0.0
    seen = False
    want = (names["running"], names["waiting"])
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in want:
            try:
                total += float(line.rsplit(" ", 1)[-1])
                seen = True
            except ValueError:
                continue
    return round(total) if seen else None


async def observe(a: Authority, e: EngineState) -> None:
    """Read `e`'s load from the engine; set e.external (0 when unknown)."""
    names = D.BY_NAME[e.dialect].load_metrics
    if names is None:
        e.external = 0
        return
    try:
        status, body = await a.client.get_body(e.url + "/metrics", timeout_s=a.config.monitoring.poll_timeout_ms / 1000.0, limit=METRICS_BYTES)
    except UpstreamError as x:
        log.info("engine %s: load metrics unavailable: %s", e.name, x)
        e.external = 0
        return
    n = reported(body.decode("utf-8", "replace"), names) if status == 200 else None
    if n is None:
        e.external = 0
        return
    ours = e.decode_in_use if e.role != "prefill" else e.prefill_in_use
    before = e.external
    e.external = max(0, n - ours)
    if e.external != before:
        log.info("engine %s: %d requests this router did not place (the engine reports %d)", e.name, e.external, n)
