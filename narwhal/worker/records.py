"""The request's record (narwhal/telemetry/logs.RequestRecord) and its admission span, from
what the authority sent this process: the Lease and the grant (docs/observability.md).
Written once per request, never per event."""

from __future__ import annotations

from ..core.lease import Grant, Lease
from ..core.tickets import Refuse
from ..telemetry.logs import RequestRecord

__all__ = ["admitted"]


def admitted(rec: RequestRecord, lease: Lease | Refuse, g: Grant | Refuse | None, admitted_at: float, now: float, mode: str) -> None:
    """The admission's facts (the Lease and grant the authority sent, in any process) into
    the record and, when traced, the admission span (docs/observability.md)."""
    t = rec.trace
    if isinstance(lease, Refuse) or isinstance(g, Refuse):
        ref = lease if isinstance(lease, Refuse) else g
        assert isinstance(ref, Refuse)
        rec.refused(ref.row)
        if t is not None:
            t.end_admission(decision="refused", row=ref.row.id, code=ref.row.code, **{"narwhal.admission.overrun_s": ref.overrun_s,
                            "narwhal.admission.queue_wait_ms": None if g is None else round((now - admitted_at) * 1000.0, 3)})
        if isinstance(lease, Refuse):
            return
    assert not isinstance(lease, Refuse)
    rec.projected_ttft_ms = lease.projected_ttft_ms
    rec.expected_cached = lease.expected_cached if lease.projected_ttft_ms is not None else None
    rec.prompt_tokens = lease.prompt_tokens
    if g is not None:
        rec.queue_s = now - admitted_at
    if t is not None and isinstance(g, Grant):
        why = "least projected TTFT (cache-aware)" if mode == "predictive" else "least loaded"
        t.end_admission(decision="granted", **{
            "narwhal.admission.mode": mode, "narwhal.admission.engine": g.engine, "narwhal.admission.phase": g.phase,
            "narwhal.admission.placement": why, "narwhal.admission.queue_wait_ms": round((now - admitted_at) * 1000.0, 3),
            "narwhal.admission.projected_ttft_ms": lease.projected_ttft_ms,
            "narwhal.admission.expected_cached_tokens": rec.expected_cached, "narwhal.admission.prompt_tokens": lease.prompt_tokens})
