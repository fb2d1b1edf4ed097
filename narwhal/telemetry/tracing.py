"""Traces (issue 23 item 1): OpenTelemetry, exported over OTLP, one trace per completion
request.

Rules
  * Sampling is decided once, at arrival (`Tracing.start`): a request not sampled gets
    None and no span object is ever made for it (every hook is `if trace is not None`);
    the relay's per-event path has no hook at all: spans are per request and per leg.
  * observability.sample_ratio decides, for every request, a client's traceparent or
    not; except that a client's traceparent with the sampled flag is honoured (traced)
    up to observability.client_sampled_per_s per process (a token bucket), so a client
    of a public router cannot make it trace (and export) everything. A traced request
    with a client's traceparent continues the client's trace (its span is the parent).
  * Engines get a `traceparent` on every leg: the leg's own span when traced, else the
    client's header unchanged (W3C: a proxy that does not trace passes it on), else none.
  * The exporter runs on the SDK's own thread behind a queue of
    observability.max_queue_size ended spans; a span that finds the queue full is
    dropped, never waited for, and counted (narwhal_trace_spans_dropped_total); an export
    that fails or times out (observability.export_timeout_ms) loses its batch, counted
    (narwhal_trace_export_failures_total).
  * Span tree and attribute names: docs/observability.md (WARNING: keep them in sync).

Nothing here imports the router: the data plane and the HTTP shell call it.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from opentelemetry import trace as otel
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import (
    NonRecordingSpan,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
)

__all__ = ["Tracing", "RequestTrace", "Leg", "parse_traceparent", "traceparent_of", "grpc_available",
           "ROOT", "ADMISSION", "PREFILL", "DECODE", "RELAY", "ASSEMBLY"]

# span names (docs/observability.md)
ROOT = "narwhal.request"
ADMISSION = "narwhal.admission"
PREFILL = "narwhal.prefill"
DECODE = "narwhal.decode"
RELAY = "narwhal.relay"
ASSEMBLY = "narwhal.assembly"

# W3C trace context, version 00 (a later version is read by its first four fields)
_TRACEPARENT = re.compile(rb"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


def parse_traceparent(value: bytes | None) -> tuple[int, int, bool] | None:
    """(trace id, parent span id, sampled) of a valid W3C traceparent, else None (an
    invalid one is ignored, as the W3C says: the request starts a new trace)."""
    if value is None or len(value) > 512:
        return None
    m = _TRACEPARENT.match(value.strip())
    if m is None:
        return None
    version, tid, sid, flags, rest = m.groups()
    if version == b"ff" or (version == b"00" and rest):
        return None
    t, s = int(tid, 16), int(sid, 16)
    if t == 0 or s == 0:
        return None
    return t, s, bool(int(flags, 16) & 1)


def traceparent_of(ctx: SpanContext) -> str:
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags) & 0xFF:02x}"


def grpc_available() -> bool:
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
    except ImportError:
        return False
    return True


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting what it exported and the batches it lost."""

    def __init__(self, inner: SpanExporter, on_failed: Callable[[int], None]) -> None:
        self.inner = inner
        self.on_failed = on_failed
        self.exported = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        try:
            res = self.inner.export(spans)
        except Exception:  # noqa: BLE001 - an exporter's failure loses its batch, never the router
            res = SpanExportResult.FAILURE
        if res is SpanExportResult.SUCCESS:
            self.exported += len(spans)
        else:
            self.on_failed(len(spans))
        return res

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _BoundedProcessor(BatchSpanProcessor):
    """The SDK's batch processor with the drop counted here: a span that finds the queue
    full is dropped at once (the SDK would log a warning per span and drop the oldest)."""

    def __init__(self, exporter: SpanExporter, *, max_queue_size: int, on_dropped: Callable[[int], None], **kw: Any) -> None:
        super().__init__(exporter, max_queue_size=max_queue_size, **kw)
        self.max_queue_size = max_queue_size
        self.on_dropped = on_dropped
        self._queue = getattr(self._batch_processor, "_queue", None)  # the SDK's deque (opentelemetry-sdk 1.45)

    def on_end(self, span: ReadableSpan) -> None:
        q = self._queue
        if q is not None and len(q) >= self.max_queue_size:
            self.on_dropped(1)
            return
        super().on_end(span)


class _Bucket:
    """observability.client_sampled_per_s: a token bucket (burst = rate, at least 1)."""

    __slots__ = ("rate", "burst", "tokens", "at", "_lock")

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self.burst = max(1.0, rate)
        self.tokens = self.burst
        self.at = time.monotonic()
        self._lock = threading.Lock()

    def take(self) -> bool:
        if self.rate <= 0:
            return False
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
            self.at = now
            if self.tokens >= 1.0:
                self.tokens -= 1.0
                return True
            return False


class Leg:
    """One engine leg's span (prefill, a decode attempt) and the relay/assembly under it."""

    __slots__ = ("span", "traceparent", "_tracer", "relay")

    def __init__(self, tracer: otel.Tracer, span: otel.Span) -> None:
        self._tracer = tracer
        self.span = span
        self.traceparent = traceparent_of(span.get_span_context())
        self.relay: otel.Span | None = None

    def start_relay(self, assembling: bool) -> None:
        self.relay = self._tracer.start_span(ASSEMBLY if assembling else RELAY, context=otel.set_span_in_context(self.span))

    def first_token(self) -> None:
        if self.relay is not None:
            self.relay.add_event("first_token")

    def end(self, *, row: str | None = None, detail: str | None = None, **attrs: Any) -> None:
        """The leg ended: ok (row None) or failed with its row."""
        relay = self.relay
        for s in (relay, self.span) if relay is not None else (self.span,):
            for k, v in attrs.items():
                if v is not None:
                    s.set_attribute(k, v)
            if row is not None:
                s.set_attribute("narwhal.row", row)
                s.set_status(Status(StatusCode.ERROR, detail or row))
            s.end()


class RequestTrace:
    """One sampled request's spans. The root span lives from arrival to the last byte."""

    __slots__ = ("_tracer", "root", "ctx", "admission", "legs")

    def __init__(self, tracer: otel.Tracer, root: otel.Span) -> None:
        self._tracer = tracer
        self.root = root
        self.ctx = otel.set_span_in_context(root)
        self.admission: otel.Span | None = None
        self.legs = 0

    @property
    def trace_id(self) -> str:
        return f"{self.root.get_span_context().trace_id:032x}"

    def set(self, **attrs: Any) -> None:
        for k, v in attrs.items():
            if v is not None:
                self.root.set_attribute(k, v)

    def start_admission(self) -> None:
        self.admission = self._tracer.start_span(ADMISSION, context=self.ctx)

    def end_admission(self, *, decision: str, row: str | None = None, code: str | None = None, **attrs: Any) -> None:
        s = self.admission
        if s is None:
            return
        self.admission = None
        s.set_attribute("narwhal.admission.decision", decision)
        if row is not None:
            s.set_attribute("narwhal.row", row)
            if code is not None:
                s.set_attribute("narwhal.code", code)
        for k, v in attrs.items():
            if v is not None:
                s.set_attribute(k, v)
        s.end()

    def leg(self, name: str, engine: str, phase: str, attempt: int) -> Leg:
        self.legs += 1
        span = self._tracer.start_span(name, context=self.ctx, kind=SpanKind.CLIENT,
                                       attributes={"narwhal.engine": engine, "narwhal.phase": phase, "narwhal.attempt": attempt})
        if attempt > 1:
            span.set_attribute("narwhal.retry", True)
        return Leg(self._tracer, span)

    def end(self, *, error: bool = False, **attrs: Any) -> None:
        if self.admission is not None:  # the request ended while it waited (cancelled)
            self.end_admission(decision="abandoned")
        self.set(**attrs)
        if error:
            self.root.set_status(Status(StatusCode.ERROR))
        self.root.end()


class Tracing:
    """observability.*: this process's tracer provider, sampler and bounded exporter.
    `start` decides a request's sampling; `shutdown` flushes (bounded) at exit."""

    def __init__(self, obs: Any, *, on_dropped: Callable[[int], None] = lambda n: None,
                 on_failed: Callable[[int], None] = lambda n: None, exporter: SpanExporter | None = None,
                 worker: int | None = None) -> None:
        self.ratio = float(obs.sample_ratio)
        self.bucket = _Bucket(float(obs.client_sampled_per_s))
        self._random = random.random
        if exporter is None:
            exporter = _otlp_exporter(obs)
        self.exporter = _CountingExporter(exporter, on_failed)
        attrs: dict[str, Any] = {"service.name": obs.service_name}
        if worker is not None:
            attrs["narwhal.worker"] = worker
        self.provider = TracerProvider(sampler=ALWAYS_ON, resource=Resource.create(attrs))
        self.processor = _BoundedProcessor(
            self.exporter,
            max_queue_size=obs.max_queue_size,
            max_export_batch_size=min(obs.max_export_batch_size, obs.max_queue_size),
            schedule_delay_millis=obs.schedule_delay_ms,
            export_timeout_millis=obs.export_timeout_ms,
            on_dropped=on_dropped,
        )
        self.provider.add_span_processor(self.processor)
        self.tracer = self.provider.get_tracer("narwhal")

    @classmethod
    def of(cls, obs: Any, **kw: Any) -> Tracing | None:
        """The tracing observability.* asks for, or None (off: sample_ratio 0 or no endpoint)."""
        if obs is None or not obs.otlp_endpoint or obs.sample_ratio <= 0:
            return None
        return cls(obs, **kw)

    def start(self, rid: str, traceparent: bytes | None) -> RequestTrace | None:
        """Sampling, once, at arrival (module rules); the root span when sampled."""
        parent = parse_traceparent(traceparent) if traceparent is not None else None
        if parent is not None and parent[2] and self.bucket.take():
            pass  # the client's sampled flag, within client_sampled_per_s
        elif self._random() >= self.ratio:
            return None
        ctx = None
        if parent is not None:
            sc = SpanContext(parent[0], parent[1], is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED))
            ctx = otel.set_span_in_context(NonRecordingSpan(sc))
        root = self.tracer.start_span(ROOT, context=ctx, kind=SpanKind.SERVER, attributes={"narwhal.request_id": rid})
        return RequestTrace(self.tracer, root)

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Flush what is queued, then stop: bounded by timeout_s (and the exporter's own)."""
        t = threading.Thread(target=self.provider.shutdown, daemon=True, name="narwhal-trace-shutdown")
        t.start()
        t.join(timeout_s)


def _otlp_exporter(obs: Any) -> SpanExporter:
    timeout_s = obs.export_timeout_ms / 1000.0
    if obs.protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )
        except ImportError:
            raise ValueError("observability.protocol grpc needs the opentelemetry-exporter-otlp-proto-grpc package "
                             "(pip install opentelemetry-exporter-otlp-proto-grpc)") from None
        return GrpcExporter(endpoint=obs.otlp_endpoint, timeout=timeout_s)  # type: ignore[no-any-return]
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=obs.otlp_endpoint.rstrip("/") + "/v1/traces", timeout=timeout_s)
