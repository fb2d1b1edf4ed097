"""Health polling with a circuit breaker (router_states S05: the age of health data).

Every monitoring.poll_interval_ms each engine's dialect health path is polled (bounded by
monitoring.poll_timeout_ms). A poll that fails counts toward the breaker; a success after
the cooldown closes it. When an engine's eligibility changes, the authority reconciles its
queues. A healthy engine without a profile is (re)profiled from here.
"""

from __future__ import annotations

import asyncio
import logging

from narwhal_generated import dialects as D

from ..core.fleet import EngineState
from ..upstream.client import UpstreamError
from . import load, profiler
from .authority import Authority

__all__ = ["monitor", "poll_once", "poll_one"]

log = logging.getLogger("narwhal")


async def _poll(a: Authority, e: EngineState) -> None:
    if e.max_concurrency is not None and (e.prefill_in_use or e.decode_in_use):
        # a poll is a request too: an engine limited by engines[].max_concurrency may
        # serialise it behind, or cut a running generation for it (llama-cpp-python's
        # server does so for /v1/models); while it has requests in flight their own
        # progress and failures (E06/E07, the breaker) stand for the poll
        e.last_observed = a.clock.now()
        return
    path = D.BY_NAME[e.dialect].health_path
    timeout = a.config.monitoring.poll_timeout_ms / 1000.0
    try:
        status = await a.client.get(e.url + path, timeout_s=timeout)
        ok, err = status == 200, (None if status == 200 else f"health answered {status}")
    except UpstreamError as x:
        ok, err = False, str(x)
        if e.healthy:  # once per transition: the detail (address included) is for the log
            log.warning("engine %s: health poll failed: %s: %s", e.name, x.row.id, x.log_detail or x.detail)
    now = a.clock.now()
    was = e.eligible(a.state.maintenance_waves)
    e.healthy = ok
    e.last_error = err
    e.last_observed = now
    if ok:
        e.breaker.success(now, probe=True)
        profiler.maybe_reprofile(a, e, now)
        took = a.took_over_at
        if e.external and took is not None and now - took < load.TAKEOVER_WINDOW_S:
            await load.observe(a, e)  # the previous leader's requests, until they are gone
        elif e.external:
            e.external = 0
    else:
        e.breaker.failure(now)
    if was != e.eligible(a.state.maintenance_waves):
        a.reconcile()
    if e.lifecycle.state == "joining":
        a.observed(e)  # lifecycle M01


async def poll_one(a: Authority, e: EngineState) -> None:
    """A joining engine's first poll, at once rather than at the next round."""
    try:
        await _poll(a, e)
    except Exception:  # a bug must not stop the join; the next round polls it again
        log.exception("health poll of %s failed", e.name)
    a.health_observed()


async def poll_once(a: Authority) -> None:
    await asyncio.gather(*(_poll(a, e) for e in a.engines.values()))
    a.health_observed()
    a.first_poll.set()


async def monitor(a: Authority) -> None:
    while True:
        try:
            await poll_once(a)
        except Exception:  # a bug must not stop monitoring; staleness would show it
            log.exception("health poll failed")
        await asyncio.sleep(a.config.monitoring.poll_interval_ms / 1000.0)  # a reload may change it
