"""One admitted request, from placement to its last byte: admission (R08-R13), the prefill
and decode legs, retries, relay or assembly, and what the router learns from it.

It sees admission only through its `Lease` (narwhal/core/lease.py): every grant, wait,
retry and phase event is one call on it, and the engines only as their static specs.

Rules
  * Response headers go out with the first token (or at the end of a stream without
    tokens). "Before response headers" therefore means "before the first token".
  * A decode attempt that fails before response headers with a retryable row (E02-E04,
    E06, E07) is retried once on another eligible engine (T05); the prefill leg is not
    retried (the spec asks it of decode attempts only).
  * After response headers, any failure or expiry ends the stream with an error event in
    the engine's shape (`data: {"error": {...}}` then `data: [DONE]`), never a silent cut.
  * P/D usage: input counts from prefill, output counts from decode.
  * Pass-through policy (docs/passthrough.md): every leg's body is the client's without
    the engine-side request IDs (request_id, rid) and upstream.deny_fields
    (`DataPlane.strip_fields`; the other router-only fields are gone since parse_request).
  * Engine output is bounded by upstream.max_event_bytes (an event, a line, a whole
    prefill or error body): more fails the attempt as E02; a non-streaming answer by
    upstream.max_answer_bytes in all (E02).
  * Client-facing messages name the engine, never its address, and carry no engine
    bytes or engine-supplied values; an engine's own error message (E04, E05) is passed
    on as words only (`engine_message`: a string, shortened, addresses replaced). The
    detail (address, bytes, values) goes to the log at WARNING under the request ID.
  * Observability (narwhal/telemetry): with a `RequestRecord` (JSON logs or tracing on)
    the request's facts are written into it once per request and per leg, never per
    event; a traced request has a span for admission and one per leg (a retry is a new
    one), the relay or assembly under its decode leg. Every leg sends the engine a
    `traceparent`: its own span's when traced, else the client's unchanged.
Returns the request's terminal class; the HTTP shell closes the books with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import orjson

from narwhal_generated import errors as E
from narwhal_generated.migration import FAILURES as MIGRATED_FAILURES

from ..core.assembly import Assembler, Failure
from ..core.dialects import DIALECTS, decode_body, prefill_body
from ..core.lease import Entry, Grant, Lease, Order, Outcome
from ..core.migration import Recorder, obstacle, stop_tail
from ..core.relay import StreamRelay
from ..core.requests import ParsedRequest, without_fields
from ..core.tickets import Refuse
from ..telemetry.logs import RequestRecord
from ..telemetry.tracing import DECODE, PREFILL, Leg, parse_traceparent
from ..upstream.client import H1Error, UpstreamError
from ..upstream.engines import EngineSpec
from ..upstream.usage import USAGE_SOURCE_HEADER
from . import migrate
from .direct import DirectFeed
from .migrate import Cont
from .plane import DataPlane
from .records import admitted
from .replies import DONE as _DONE
from .replies import Sink, cached, engine_error_detail, err_msg, error_event, merge_usage, refuse

# the TTFT admission projected for the request (ms, before the confidence margin), on its
# response: what docs/performance.md compares with the measured TTFT
PROJECTED_TTFT_HEADER = b"x-narwhal-projected-ttft-ms"
# the prompt tokens admission expected the engine to hold in its prefix cache (predictive
# mode): compare with usage.prompt_tokens_details.cached_tokens (docs/performance.md)
EXPECTED_CACHED_HEADER = b"x-narwhal-expected-cached-tokens"

__all__ = ["Sink", "run_request", "error_event"]

log = logging.getLogger("narwhal")

_NO_TRACESTATE: Mapping[str, str] = MappingProxyType({})  # shared by every request without one

_ROUTE_PATH = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class _Failed(Exception):
    def __init__(self, row: str, detail: str, *, param: str | None = None, engine: EngineSpec | None = None, event: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.row = row
        self.detail = detail
        self.param = param
        self.engine = engine
        self.event = event  # an engine's error event held back for migration (E04 after headers)
        self.reported = False  # the engine's breaker has been told (Lease.retry)


class _Run:
    """State of one request across its legs and attempts."""

    __slots__ = ("r", "req", "order", "lease", "sink", "rid", "prefill_prompt_tokens", "first_token_at", "body", "ok_engine", "tpot",
                 "output_tokens", "finish_reason", "reported_prompt", "cached_tokens", "max_migrations", "relay", "migrations", "rec", "trace", "leg",
                 "events", "client_tp", "tracestate", "_todo")

    def __init__(self, plane: DataPlane, req: ParsedRequest, order: Order, lease: Lease, sink: Sink, rid: str, rec: RequestRecord | None = None) -> None:
        self.r = plane
        self.req = req
        self.order = order
        self.lease = lease
        self.sink = sink
        self.rid = rid
        self.prefill_prompt_tokens: int | None = None
        self.first_token_at: float | None = None
        self.body = without_fields(req.body, plane.strip_fields)  # the pass-through policy
        # what the lease is told when it closes (Outcome)
        self.ok_engine: str | None = None
        self.tpot: tuple[str, float] | None = None
        self.output_tokens: int | None = None
        self.finish_reason: str | None = None
        self.reported_prompt: int | None = None
        self.cached_tokens: int | None = None  # the phase-1 engine's usage.prompt_tokens_details.cached_tokens
        # stream migration (worker/migrate.py): the relay read on by continuations, how many
        self.max_migrations = plane.config.upstream.migration.max_attempts
        self.relay: StreamRelay | None = None
        self._todo: tuple[Any, bool] | None = None  # a leg's relay to make once its request is out (_sent)
        self.migrations = 0
        # observability: the record (None: JSON logs and tracing off), the trace when
        # sampled, the leg being run, the client's trace context passed on when not traced
        self.rec = rec
        self.trace = rec.trace if rec is not None else None
        self.leg: Leg | None = None
        self.events: int | None = None
        self.client_tp: dict[str, str] | None = None
        self.tracestate: Mapping[str, str] = _NO_TRACESTATE  # the client's, passed on with our traceparent too (W3C)
        if rec is not None and rec.traceparent is not None and parse_traceparent(rec.traceparent) is not None:
            if rec.tracestate is not None and len(rec.tracestate) <= 512:
                self.tracestate = {"tracestate": rec.tracestate.decode("latin-1")}
            if self.trace is None:
                self.client_tp = {"traceparent": rec.traceparent.decode("latin-1"), **self.tracestate}

    def _leg(self, name: str, e: EngineSpec, phase: str, attempt: int) -> Leg | None:
        if self.rec is not None:
            self.rec.engines.append(e.name)
        self.leg = self.trace.leg(name, e.name, phase, attempt) if self.trace is not None else None
        return self.leg

    def _leg_headers(self, base: dict[str, str] | None) -> dict[str, str] | None:
        """The engine request's headers: `base` plus the trace context (module rules)."""
        if self.leg is not None:
            return {**(base or {}), "traceparent": self.leg.traceparent, **self.tracestate}
        if self.client_tp is not None:
            return {**base, **self.client_tp} if base else self.client_tp
        return base

    def outcome(self, failed: _Failed | None = None) -> Outcome:
        fe = failed.engine.name if failed is not None and failed.engine is not None and not failed.reported else None
        return Outcome(
            at=self.r.clock.now(),
            ok_engine=self.ok_engine,
            failed_engine=fe,
            failed_row=failed.row if fe is not None and failed is not None else None,
            tpot_s=self.tpot[1] if self.tpot else None,
            tpot_engine=self.tpot[0] if self.tpot else None,
            output_tokens=self.output_tokens,
            finish_reason=self.finish_reason,
            reported_prompt_tokens=self.reported_prompt,
            cached_tokens=self.cached_tokens,
        )

    def _upstream(self, x: UpstreamError, e: EngineSpec, leg: str = "engine") -> _Failed:
        """A transport failure: the words for the client, the detail for the log."""
        log.warning("request %s: %s %s: %s %s", self.rid, leg, e.name, x.row, x.log_detail or x.detail)
        return _Failed(x.row, f"{leg} {e.name}: {x.detail}", engine=e)

    def _http_error(self, status: int, raw: bytes, e: EngineSpec, leg: str = "engine") -> _Failed:
        msg, param = engine_error_detail(status, raw, self.r.engine_hosts)
        log.log(logging.WARNING if status >= 500 else logging.INFO, "request %s: %s %s answered HTTP %d: %r", self.rid, leg, e.name, status, raw[:500])
        return _Failed("E05" if status < 500 else "E04", f"{leg} {e.name}: {msg}", param=param, engine=e)

    # -- legs --------------------------------------------------------------------------

    async def prefill(self, e: EngineSpec) -> dict[str, Any] | None:
        """The prefill leg of the vLLM two-phase protocol; returns kv_transfer_params."""
        body = prefill_body(self.body, route=self.req.route, model=e.model)
        ok = False
        r = self.r
        leg = self._leg(PREFILL, e, "prefill", 1)
        failed: _Failed | None = None
        try:
            try:
                up = await r.client.open("POST", e.url + _ROUTE_PATH[self.req.route], body=orjson.dumps(body), headers=self._leg_headers({"x-request-id": self.rid}))
                legs = r.legs.setdefault(e.name, set())  # a cut (lifecycle M30) reaches this leg
                legs.add(up)
                try:
                    status, raw = up.status, await up.read(r.client.max_body_bytes)
                finally:
                    legs.discard(up)
                    await up.aclose()
            except UpstreamError as x:
                raise self._upstream(x, e, "prefill engine") from None
            if status >= 400:
                raise self._http_error(status, raw, e, "prefill engine")
            try:
                obj = orjson.loads(raw)
            except orjson.JSONDecodeError:
                log.warning("request %s: prefill engine %s: E02 answer not JSON: %r", self.rid, e.name, raw[:200])
                raise _Failed("E02", f"prefill engine {e.name} answered with non-JSON", engine=e) from None
            if not isinstance(obj, dict) or "kv_transfer_params" not in obj:
                raise _Failed("E02", f"prefill engine {e.name} returned no kv_transfer_params", engine=e)
            kv = obj["kv_transfer_params"]
            if kv is not None and not isinstance(kv, dict):
                raise _Failed("E02", f"prefill engine {e.name} returned kv_transfer_params that is not an object", engine=e)
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                self.prefill_prompt_tokens = usage["prompt_tokens"]
            self.cached_tokens = cached(usage)
            ok = True
            return kv
        except _Failed as f:
            failed = f
            raise
        finally:
            self.lease.prefill_done(self.r.clock.now(), ok=ok)
            if leg is not None:
                leg.end(row=failed.row if failed is not None else (None if ok else "interrupted"), detail=failed.detail if failed is not None else None,
                        **{"narwhal.prompt_tokens": self.prefill_prompt_tokens, "narwhal.cached_tokens": self.cached_tokens})
                self.leg = None

    async def decode(self, e: EngineSpec, kv: dict[str, Any] | None, cont: Cont | None = None) -> str:
        """Stream from a unified or decode engine; relay or assemble. Returns the class.
        `cont`: a continuation (stream migration), read on by the same relay through its
        Rejoin."""
        r, req = self.r, self.req
        dialect = DIALECTS[e.dialect]
        checks_ids = dialect.token_accounting == "token_ids"
        rejoin = None
        if cont is not None and self.relay is not None:  # the relay read on
            body, path, rejoin = cont.body, "/v1/completions", cont.rejoin
            self._todo = None  # (never a new one: an earlier leg's that never went out is void)
        else:
            body = decode_body(self.body, dialect=e.dialect, model=e.model, kv_transfer_params=kv, disaggregated=e.role == "decode")
            path = _ROUTE_PATH[req.route]
            self._todo = (dialect, checks_ids)  # a new relay: made once the request is out (_sent)
        try:
            headers = self._leg_headers({"x-request-id": self.rid} if dialect.propagate_request_id else None)
            up = await r.client.open("POST", e.url + path, body=orjson.dumps(body), headers=headers, sent=self._sent if self._todo is not None else None)
        except UpstreamError as x:
            raise self._upstream(x, e) from None
        del body, headers  # sent: not held for the stream's life (memory per open stream)
        self._sent()  # (done already, unless the request went out some other way)
        relay = self.relay
        assert relay is not None
        assembler = relay.assembler
        sink = self.sink
        buffered: list[bytes] = []
        last = b""  # a streaming client's last bytes: they go with the stream's end (one write)
        complete = False
        legs = r.legs.setdefault(e.name, set())  # a cut (lifecycle M30) reaches this leg
        legs.add(up)
        movers = None
        if relay.recorder is not None:  # discovery.drain: migrate may move it (worker/plane.py)
            movers = r.movers.setdefault(e.name, {})
            movers[up] = self._movable
        try:
            if up.status >= 400:
                raw = await up.read(min(1 << 20, r.client.max_body_bytes))
                raise self._http_error(up.status, raw, e)
            if self.leg is not None:
                self.leg.start_relay(assembler is not None)
            now_fn = r.now  # (the plane's: bound methods made here would live as long as the stream)
            # a continuation's own first token frees the slot admission gave it (the
            # scheduler's first_token), as any first token does; the relay has started long ago
            awaiting = relay.token_count if rejoin is not None else None
            # serving.relay_path direct (worker/direct.py): reads fed from the connection's
            # callback, a streaming client's head and first token included
            fast = None
            if r.direct_relay and rejoin is None and (assembler is not None or (sink.write_now is not None and sink.start_now is not None)):
                fast = DirectFeed(relay, now_fn, None if assembler is not None else sink, buffered, self._first_token, native=r.native_relay)
            while True:
                if fast is not None and fast.pending is None:
                    await up.direct(fast)
                if fast is not None and fast.pending is not None:
                    (step, now), fast.pending = fast.pending, None
                else:
                    try:
                        chunk = await up.next_raw()
                    except H1Error as x:
                        raise up.mapped(x) from None
                    if not chunk:
                        raise _Failed("E06", f"engine {e.name}: the stream ended without data: [DONE]", engine=e)
                    if rejoin is not None:  # a continuation: in the client's stream's shape first
                        chunk = rejoin.feed(chunk)
                        if rejoin.too_large:
                            raise _Failed("E02", f"engine {e.name}: an event or line longer than upstream.max_event_bytes", engine=e)
                        if not chunk:
                            continue
                    now = now_fn()
                    step = relay.feed(chunk, now)
                if step.failure is not None:
                    row, detail = step.failure
                    if sink.headers_sent and step.out:
                        await sink.write(step.out)
                    if step.engine_error is not None and sink.headers_sent:  # migration on (core/relay.py)
                        raise _Failed(row, f"engine {e.name}: {detail}", engine=e, event=step.engine_error)
                    log.warning("request %s: engine %s: %s %s%s", self.rid, e.name, row, detail, f": {relay.failure_detail}" if relay.failure_detail else "")
                    raise _Failed(row, f"engine {e.name}: {detail}", engine=e)
                if awaiting is not None and relay.token_count > awaiting:
                    awaiting = None
                    self.lease.first_token(now)
                try:
                    if assembler is None:
                        if sink.headers_sent:
                            if step.done:  # written with the end, below: nothing awaits before it
                                last = self._marked(step.out) if self.migrations and step.out else step.out
                            elif step.out:
                                await sink.write(step.out)
                        else:
                            if step.out:
                                buffered.append(step.out)
                            if relay.started or step.done:
                                await self._start(buffered)
                finally:
                    if step.first_token:  # its books after its bytes are out: they are not on the client's TTFT
                        self._first_token(now)
                if step.done:
                    complete = True
                    break
                if fast is not None:  # the stream's life is spent in up.direct: the last read's bytes go now
                    del step
                    chunk = b""
        except UpstreamError as x:
            raise self._upstream(x, e) from None
        finally:
            legs.discard(up)
            if movers is not None:
                movers.pop(up, None)
            await up.aclose(complete=complete)
        now = r.clock.now()
        if relay.engine_error is not None:
            # a streaming client got the engine's own error event (E04 shape of the engine)
            if not sink.headers_sent:
                log.warning("request %s: engine %s: E04 error event %r", self.rid, e.name, orjson.dumps(relay.engine_error)[:500])
                raise _Failed("E04", f"engine {e.name}: {err_msg(relay.engine_error, r.engine_hosts)}", engine=e)
            await sink.end_stream(last)
            f = _Failed("E04", "error event", engine=e)
            raise _Ended("failed", f)
        self._learn(e, relay)
        if assembler is not None:
            prompt, source = self._prompt_usage(assembler, e)
            if source == "estimate" and (pc := r.prompt_counters.get(e.name)) is not None:
                # the engine omits usage but can count: ask it now, after the stream (an
                # engine that serialises requests is idle for this one: it still holds
                # the slot), bounded by usage.COUNT_TIMEOUT_S
                n = await pc.count(self.req.route, self.req.body)
                if n is not None:
                    prompt, source = n, pc.kind
                    self.reported_prompt = n
            res = assembler.finish(prompt_tokens=prompt, completion_tokens=relay.token_count if checks_ids else None)
            if isinstance(res, Failure):
                log.warning("request %s: engine %s: %s %s (%s)%s", self.rid, e.name, res.row, res.detail, res.rule, f": {res.log_detail}" if res.log_detail else "")
                raise _Failed(res.row, f"engine {e.name}: {res.detail} ({res.rule})", engine=e)
            if self.prefill_prompt_tokens is not None:
                merge_usage(res, self.prefill_prompt_tokens)
            if self.first_token_at is None:
                self._first_token(now)
            await sink.respond(200, [(b"content-type", b"application/json"), (USAGE_SOURCE_HEADER, source.encode())], orjson.dumps(res))
        else:
            if not sink.headers_sent:
                await self._start(buffered)
            await sink.end_stream(last)
        self.ok_engine = e.name
        return "completed"

    def _sent(self) -> None:
        """Item 21: once the engine has the request (H1Pool.request's `sent`), while it
        works on it, not on the request's way there: the leg's relay is made (only the
        response's body needs it) and a streaming client's head built (only its first
        token needs it)."""
        todo, self._todo = self._todo, None
        if todo is not None:
            self._new_relay(*todo)
            if self.req.stream and not self.sink.headers_sent:
                self.sink.prepare_start()

    def _new_relay(self, dialect: Any, checks_ids: bool) -> None:
        """A new leg's relay (with an assembler, for a non-streaming client): self.relay."""
        req, r = self.req, self.r
        assembler = None
        if not req.stream:
            assembler = Assembler(req.route, content_null_when_empty=dialect.content_null_when_empty, include_token_ids=req.return_token_ids and checks_ids)
        relay = StreamRelay(
            checks_ids=checks_ids,
            client_ids=req.return_token_ids,
            client_usage=req.client_usage,
            assembler=assembler,
            normalise_tool_calls="repeated_tool_call_fields" in dialect.quirks,
            prompt_tokens_override=self.prefill_prompt_tokens,
            max_event_bytes=r.config.upstream.max_event_bytes,
            max_answer_bytes=r.config.upstream.max_answer_bytes,
            hosts=r.engine_hosts,
        )
        if self.max_migrations and checks_ids and assembler is None:  # G01/G02: only then a record
            relay.recorder = Recorder(tail_len=stop_tail(self.body))
        self.relay = relay

    def _prompt_usage(self, assembler: Assembler, e: EngineSpec) -> tuple[int, str]:
        """The assembled answer's prompt tokens and their source (x-narwhal-usage-source):
        the prefill engine's count (P/D), the engine's own usage, an exact prompt (token
        IDs, or serving.tokenizer on a text prompt), else the estimate."""
        if self.prefill_prompt_tokens is not None:
            return self.prefill_prompt_tokens, "prefill"
        n = self.lease.prompt_tokens
        if assembler.engine_usage:
            return n, "engine"
        if self.req.prompt_token_count is not None:
            return n, "prompt_token_ids"
        if self.req.route == "completion" and self.req.prompt_text is not None and self.r.count_tokens is not None:
            return n, "tokenizer"  # serving.tokenizer on a text prompt (no chat template)
        return n, "estimate"

    async def _start(self, buffered: list[bytes]) -> None:
        sink = self.sink
        await sink.start_stream()
        if buffered:
            data = b"".join(buffered)
            buffered.clear()
            if sink.write_now is None or not sink.write_now(data):  # relay_path direct: no ASGI send
                await sink.write(data)

    def _first_token(self, now: float) -> None:
        if self.first_token_at is not None:
            return
        self.first_token_at = now
        self.lease.first_token(now)
        if self.leg is not None:
            self.leg.first_token()
        self.r.telemetry.child(self.r.telemetry.ttft, self.req.route).observe(now - self.order.arrival)
        if self.r.tenant_labels is not None:  # tenants configured: the tenant's TTFT too
            t = self.order.tenant
            self.r.telemetry.tenant_ttft.labels("default" if t is None else t if t in self.r.tenant_labels else "other").observe(now - self.order.arrival)

    def _learn(self, e: EngineSpec, relay: StreamRelay) -> None:
        """What the authority learns when the lease closes (decode model, output length,
        the sizer's bytes per token)."""
        tpot = relay.arrivals.tpot()
        if tpot is not None:
            self.tpot = (e.name, tpot)
            if e.name in self.r.engines:  # (one gone meanwhile had its children removed: telemetry.forget_engine)
                self.r.telemetry.child(self.r.telemetry.tpot, e.name).observe(tpot)
        self.output_tokens = relay.token_count
        self.finish_reason = relay.finish_reason
        self.events = relay.events
        usage = relay.usage
        pt = self.prefill_prompt_tokens
        if pt is None and isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
            pt = usage["prompt_tokens"]
        if pt is not None:
            self.reported_prompt = pt
        if self.prefill_prompt_tokens is None:  # unified: this engine did the prefill
            self.cached_tokens = cached(usage)

    # -- attempts ------------------------------------------------------------------------

    async def attempts(self, g: Grant) -> str:
        r = self.r
        kv: dict[str, Any] | None = None
        slot_wait: float | None = None
        if g.phase == "prefill":
            kv = await self.prefill(r.engines[g.engine])
            t0 = r.clock.now()
            d = await self.lease.decode_slot()
            slot_wait = r.clock.now() - t0
            if isinstance(d, Refuse):
                return await refuse(self.sink, d.row, overrun_s=d.overrun_s, **d.fields)
            g = d
        retries = 1
        attempt = 0
        cont: Cont | None = None
        while True:
            e = r.engines[g.engine]
            attempt += 1
            leg = self._leg(DECODE, e, g.phase, attempt)
            if leg is not None and cont is not None:  # a continuation (stream migration): its own decode leg
                leg.span.set_attribute("narwhal.migration", self.migrations)
            if leg is not None and slot_wait is not None:  # P/D: the decode slot, chosen by the authority
                leg.span.set_attribute("narwhal.slot_wait_ms", round(slot_wait * 1000.0, 3))
                leg.span.set_attribute("narwhal.placement", "decode engine with the smallest share of its slots in use")
                slot_wait = None
            try:
                cls = await self.decode(e, kv, cont) if leg is None else await self._traced_decode(leg, e, kv, cont)
                return cls
            except _Failed as f:
                row = E.ROWS[f.row]
                if self.sink.headers_sent and f.engine is not None and f.row in MIGRATED_FAILURES:
                    moved = await self._migrate(f, g.phase)
                    if moved is None:
                        raise
                    g, cont, kv = moved[0], moved[1], None
                    continue
                if self.sink.headers_sent or not row.retryable or retries <= 0 or f.engine is None:
                    raise
                retries -= 1
                if self.rec is not None:
                    self.rec.retries += 1
                log.info("request %s: retrying after %s on %s", self.rid, f.row, e.name)
                f.reported = True  # Lease.retry tells the engine's breaker
                nxt = await self.lease.retry(f.engine.name, f.row, g.phase, r.clock.now())
                if nxt is None:
                    raise
                if isinstance(nxt, Refuse):
                    return await refuse(self.sink, nxt.row, overrun_s=nxt.overrun_s, **nxt.fields)
                g = nxt

    async def _migrate(self, f: _Failed, phase: str) -> tuple[Grant, Cont] | None:
        """A decode leg failed after response headers (f.row in spec/tables/migration.yaml's
        failures): the continuation's grant and body, or None: the error event (G01-G10).
        Counted on /metrics by cause (the failure row) and decision (the row's reason)."""
        r, req = self.r, self.req
        assert f.engine is not None
        rec = self.relay.recorder if self.relay is not None else None
        now = r.clock.now()
        why = self._obstacle(rec, now)
        cont = nxt = None
        if why is None:
            assert rec is not None
            f.reported = True  # Lease.retry tells the engine's breaker
            nxt = await self.lease.retry(f.engine.name, f.row, phase, now)  # placed like a retry: another eligible engine
            why = "placement_refused"  # G10, unless all of the below holds
            if isinstance(nxt, Grant) and DIALECTS[r.engines[nxt.engine].dialect].token_accounting == "token_ids":
                e2 = r.engines[nxt.engine]
                model = e2.model or r.config.serving.model
                mig = r.config.upstream.migration
                prompt = await migrate.prompt_ids(r.client, e2, req, rec, model, mig.tokenize_timeout_ms / 1000.0)
                if prompt is not None:
                    cont = migrate.prepare(req, self.body, e2, model, rec, prompt, prompt_tokens=len(prompt),
                                           cached_tokens=self.cached_tokens, max_event_bytes=r.config.upstream.max_event_bytes)
                    if cont is not None:
                        why = None
        r.telemetry.migrations.labels(f.row, why or "carry_on").inc()
        if why is not None or cont is None or not isinstance(nxt, Grant):
            log.info("request %s: %s on %s after response headers: not migrated (%s)", self.rid, f.row, f.engine.name, why)
            if f.event is not None:  # the engine's error event held back: the client gets it now
                await self.sink.write(b"data: " + orjson.dumps(f.event) + b"\n\n" + _DONE)
                await self.sink.end_stream()
                raise _Ended("failed", f)
            return None
        self.migrations += 1
        if self.rec is not None:
            self.rec.migrations += 1
        log.info("request %s: %s on %s after %d tokens: carried on by %s (migration %d)", self.rid, f.row, f.engine.name, len(rec.output_ids), nxt.engine, self.migrations)
        return nxt, cont

    def _movable(self) -> bool:
        """Could this request's decode leg be carried on now (G01-G09 hold none)? Asked
        by a drain with discovery.drain: migrate before it cuts the leg."""
        rec = self.relay.recorder if self.relay is not None else None
        if not self.sink.headers_sent or rec is None:
            return False
        return self._obstacle(rec, self.r.clock.now()) is None

    def _obstacle(self, rec: Recorder | None, now: float) -> str | None:
        """G01-G09 for this request now (core/migration.obstacle): the first reason its
        decode leg may not be carried on, or None."""
        left = None if self.order.deadline_s is None else (self.order.deadline_s - (now - self.order.arrival)) * 1000.0
        return obstacle(self.req.route, self.body, migrate.progress(rec, attempts=self.migrations, deadline_left_ms=left),
                        max_attempts=self.max_migrations, token_ids=rec is not None and not rec.overflow,
                        projected_ttft_ms=self.lease.projected_ttft_ms or 0.0)

    def _marked(self, out: bytes) -> bytes:
        """The stream's last bytes with the migrations it took (an SSE comment before
        `data: [DONE]`: clients ignore comments)."""
        if out.endswith(_DONE):
            return out[: -len(_DONE)] + migrate.MIGRATIONS_COMMENT % self.migrations + _DONE
        return out

    async def _traced_decode(self, leg: Leg, e: EngineSpec, kv: dict[str, Any] | None, cont: Cont | None = None) -> str:
        """`decode` with its leg's span (and the relay's) ended however it ends."""
        row: str | None = "interrupted"
        detail: str | None = None
        cls: str | None = None
        try:
            cls = await self.decode(e, kv, cont)
            row = None
            return cls
        except _Failed as f:
            row, detail = f.row, f.detail
            raise
        except _Ended as x:
            row, detail, cls = x.failure.row, x.failure.detail, x.cls
            raise
        finally:
            self.leg = None
            leg.end(row=row, detail=detail, **{"narwhal.class": cls, "narwhal.output_tokens": self.output_tokens,
                                               "narwhal.finish_reason": self.finish_reason, "narwhal.events": self.events})


class _Ended(Exception):
    """The request ended with its class after the stream was closed (an engine's error
    event relayed to a streaming client); `failure` is the engine's, for its breaker."""

    def __init__(self, cls: str, failure: _Failed) -> None:
        super().__init__(cls)
        self.cls = cls
        self.failure = failure


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
    run = _Run(r, req, order, lease, sink, rid, rec)
    failed: _Failed | None = None
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
        except _Ended as x:
            failed = x.failure
            return x.cls
        except _Failed as f:
            failed = f
            row = E.ROWS[f.row]
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


def _ended(rec: RequestRecord, run: _Run, failed: _Failed | None) -> None:
    """What the request's record learns at its end (once)."""
    if failed is not None:
        rec.row = failed.row
    rec.ttft_s = None if run.first_token_at is None else run.first_token_at - run.order.arrival
    rec.tpot_s = run.tpot[1] if run.tpot else None
    rec.output_tokens = run.output_tokens
    rec.finish_reason = run.finish_reason
    rec.cached_tokens = run.cached_tokens
    rec.events = run.events if run.req.stream else None
    if run.reported_prompt is not None:
        rec.prompt_tokens = run.reported_prompt
