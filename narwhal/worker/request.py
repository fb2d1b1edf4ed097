"""One admitted request, from placement to its last byte: admission (R08-R13), its legs
(worker/legs.py: prefill and decode, retries, relay or assembly), the deadline (R13) and
the failure that ends it, mapped to a refusal before response headers or an error event
after. Returns the request's terminal class; the HTTP shell closes the books with it.
"""

from __future__ import annotations

import asyncio

from narwhal_generated import errors as E

from ..core.lease import Entry, Order
from ..core.requests import ParsedRequest
from ..core.tickets import Refuse
from ..telemetry.logs import RequestRecord
from .failures import Ended, Failed
from .legs import Run
from .plane import DataPlane
from .records import admitted
from .replies import Sink, error_event, refuse

# the TTFT admission projected for the request (ms, before the confidence margin), on its
# response: what docs/performance.md compares with the measured TTFT
PROJECTED_TTFT_HEADER = b"x-narwhal-projected-ttft-ms"
# the prompt tokens admission expected the engine to hold in its prefix cache (predictive
# mode): compare with usage.prompt_tokens_details.cached_tokens (docs/performance.md)
EXPECTED_CACHED_HEADER = b"x-narwhal-expected-cached-tokens"

__all__ = ["Sink", "run_request", "error_event"]


async def run_request(plane: DataPlane, entry: Entry, req: ParsedRequest, order: Order, sink: Sink, rid: str, rec: RequestRecord | None = None) -> str:
    """Admission (R08-R13) and the whole life of one sized request; returns its class."""
    r = plane
    if rec is not None:
        admitted_at = r.clock.now()
        if rec.trace is not None:
            rec.trace.start_admission()
    lease = await entry.admit(order)
    if isinstance(lease, Refuse):
        if rec is not None:
            admitted(rec, lease, None, admitted_at, r.clock.now(), r.config.admission.mode)
        cls = await refuse(sink, lease.row, overrun_s=lease.overrun_s, **lease.fields)
        r.telemetry.child(r.telemetry.refusal, lease.row.code).observe(r.clock.now() - order.arrival)
        return cls
    if lease.projected_ttft_ms is not None:  # predictive mode: what admission projected
        sink.extra_headers.append((PROJECTED_TTFT_HEADER, b"%d" % round(lease.projected_ttft_ms)))
        sink.extra_headers.append((EXPECTED_CACHED_HEADER, b"%d" % round(lease.expected_cached)))
    run = Run(r, req, order, lease, sink, rid, rec)
    failed: Failed | None = None
    try:
        g = await lease.granted()
        if rec is not None:
            admitted(rec, lease, g, admitted_at, r.clock.now(), r.config.admission.mode)
        if isinstance(g, Refuse):
            return await refuse(sink, g.row, overrun_s=g.overrun_s, **g.fields)
        limit_ms = round(order.deadline_s * 1000) if order.deadline_s is not None else 0
        try:
            if order.deadline_s is not None:
                left = order.deadline_s - (r.clock.now() - order.arrival)
                async with asyncio.timeout(max(0.0, left)):
                    return await run.attempts(g)
            return await run.attempts(g)
        except TimeoutError:
            # R13: the original request deadline expired while in flight
            if sink.headers_sent:
                sink.row = E.R13.id
                await sink.write(error_event(E.R13, limit=limit_ms))
                await sink.end_stream()
                return E.R13.counter
            return await refuse(sink, E.R13, limit=limit_ms)
        except Ended as x:
            failed = x.failure
            return x.cls
        except Failed as f:
            failed = f
            row = f.row
            fields = {"detail": f.detail, "limit": r.config.upstream.idle_timeout_ms}
            if sink.headers_sent:
                await sink.write(error_event(row, param=f.param, **fields))
                await sink.end_stream()
                return "failed"
            return await refuse(sink, row, param=f.param, **fields)
    finally:
        lease.close(run.outcome(failed))
        if rec is not None:
            _ended(rec, run, failed)


def _ended(rec: RequestRecord, run: Run, failed: Failed | None) -> None:
    """What the request's record learns at its end (once)."""
    if failed is not None:
        rec.row = failed.row.id
    rec.ttft_s = None if run.first_token_at is None else run.first_token_at - run.order.arrival
    rec.tpot_s = run.tpot[1] if run.tpot else None
    rec.output_tokens = run.output_tokens
    rec.finish_reason = run.finish_reason
    rec.cached_tokens = run.cached_tokens
    rec.events = run.events if run.req.stream else None
    if run.reported_prompt is not None:
        rec.prompt_tokens = run.reported_prompt
