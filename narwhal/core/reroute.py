"""A gateway's fallback list and the books that follow the endpoint it served
(docs/gateway.md, issue 41), sans-IO over the scheduler (core/admission.py).

An endpoint picker names the engine admission granted and, after it, fallbacks where the
gateway may retry a request whose connection failed (`x-gateway-destination-endpoint:
ip:port,ip:port,...`). The gateway reports the endpoint it served; when that is not the
granted engine, the request's slot moves there.

Invariants
  * A fallback is an engine the request could be placed on now without waiting: phase 1,
    role unified, of the granted engine's dialect and model (the body the gateway forwards
    is the one built for it), eligible (healthy, not draining, breaker closed, not in a maintenance
    wave), within the request's `only` (the subset hint), not the granted engine nor one
    it already failed on, with a free slot and nobody queued for it. Their order is
    Narwhal's choice of another engine for a request whose first failed (T05,
    Scheduler.retry_unified; placement.retry_rank): least projected prefill counting what
    its prefix cache is expected to hold of the prompt, within 10 ms a tie broken by the
    fewest requests on it.
  * Served elsewhere: the granted engine failed before the response began (the gateway
    moves on only after a connect failure): its slots are freed as for T05's failed
    attempt (it is excluded from the ticket's retries), and the served engine holds the
    request's slots from now, whether or not it had room (it is serving the request: the
    books follow the engines' real load).
"""

from __future__ import annotations

import heapq

from .admission import Scheduler
from .placement import retry_rank
from .tickets import Dispatch, Ticket

__all__ = ["fallbacks", "moved"]


def fallbacks(s: Scheduler, t: Ticket, n: int) -> tuple[str, ...]:
    """At most `n` engine names after the ticket's own, best first (module invariants)."""
    if n <= 0:
        return ()
    work = t.work
    only = work.only
    granted = s.engines.get(t.engine) if t.engine is not None else None
    if granted is None:
        return ()
    tokens = float(work.prompt_tokens)
    ranked: list[tuple[tuple[float, int, float], str]] = []
    for e in s._phase1:
        if e.role != "unified" or e.name == t.engine or e.name in t.excluded or (only is not None and e.name not in only):
            continue
        if e.dialect != granted.dialect or e.model != granted.model:
            continue
        if not s.eligible(e) or not e.phase1_free() or e.queue:
            continue
        ranked.append((retry_rank(s, e, work, tokens), e.name))
    return tuple(name for _, name in heapq.nsmallest(n, ranked))


def moved(s: Scheduler, t: Ticket, engine: str, now: float) -> list[Dispatch]:
    """The request is served by `engine`, not the one it was granted: the granted
    engine's slots freed (and excluded, T05's failed attempt), `engine`'s taken. Returns
    the grants the freed slots made (to be woken)."""
    grants = s.decode_failed(t, now)
    t.pred_prefill_ms = s.engines[engine].prefill.predict_ms(float(t.work.prompt_tokens))
    s._dispatch1(t, s.engines[engine], now)
    return grants
