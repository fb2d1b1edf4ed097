"""The legs of one admitted request: the prefill and decode legs, retries (T05), stream
migration (G01-G10), relay or assembly, and what the router learns from it. Admission
(R08-R13) and the request's end are worker/request.py's (`run_request`).

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
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, NoReturn

import orjson

from narwhal_generated import errors as E
from narwhal_generated.migration import FAILURES as MIGRATED_FAILURES

from ..core.assembly import Assembler, Failure
from ..core.dialects import DIALECTS, decode_body, prefill_body
from ..core.lease import Grant, Lease, Order, Outcome
from ..core.migration import Recorder, stop_tail
from ..core.relay import StreamRelay
from ..core.requests import ParsedRequest, without_fields
from ..core.tickets import Refuse
from ..telemetry.logs import RequestRecord
from ..telemetry.tracing import DECODE, PREFILL, Leg, parse_traceparent
from ..upstream.client import H1Error, UpstreamError
from ..upstream.engines import EngineSpec
from ..upstream.usage import USAGE_SOURCE_HEADER
from .direct import DirectFeed
from .failures import Ended, Failed
from .migrate import Cont
from .moving import Migrating
from .plane import PREEMPTED, DataPlane
from .replies import Sink, cached, engine_error_detail, err_msg, merge_usage, refuse

__all__ = ["Run", "Failed", "Ended"]

log = logging.getLogger("narwhal")

_NO_TRACESTATE: Mapping[str, str] = MappingProxyType({})  # shared by every request without one

_ROUTE_PATH = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


class Run(Migrating):
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

    def outcome(self, failed: Failed | None = None) -> Outcome:
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

    def _upstream(self, x: UpstreamError, e: EngineSpec, leg: str = "engine") -> Failed:
        """A transport failure: the words for the client, the detail for the log."""
        level = logging.INFO if x.detail == PREEMPTED else logging.WARNING  # a fair preemption is routine
        log.log(level, "request %s: %s %s: %s %s", self.rid, leg, e.name, x.row.id, x.log_detail or x.detail)
        return Failed(x.row, f"{leg} {e.name}: {x.detail}", engine=e)

    def _http_error(self, status: int, raw: bytes, e: EngineSpec, leg: str = "engine") -> Failed:
        msg, param = engine_error_detail(status, raw, self.r.engine_hosts)
        log.log(logging.WARNING if status >= 500 else logging.INFO, "request %s: %s %s answered HTTP %d: %r", self.rid, leg, e.name, status, raw[:500])
        return Failed(E.E05 if status < 500 else E.E04, f"{leg} {e.name}: {msg}", param=param, engine=e)

    # -- legs --------------------------------------------------------------------------

    async def prefill(self, e: EngineSpec) -> dict[str, Any] | None:
        """The prefill leg of the vLLM two-phase protocol; returns kv_transfer_params."""
        body = prefill_body(self.body, route=self.req.route, model=e.model)
        ok = False
        r = self.r
        leg = self._leg(PREFILL, e, "prefill", 1)
        failed: Failed | None = None
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
                raise Failed(E.E02, f"prefill engine {e.name} answered with non-JSON", engine=e) from None
            if not isinstance(obj, dict) or "kv_transfer_params" not in obj:
                raise Failed(E.E02, f"prefill engine {e.name} returned no kv_transfer_params", engine=e)
            kv = obj["kv_transfer_params"]
            if kv is not None and not isinstance(kv, dict):
                raise Failed(E.E02, f"prefill engine {e.name} returned kv_transfer_params that is not an object", engine=e)
            usage = obj.get("usage")
            if isinstance(usage, dict) and isinstance(usage.get("prompt_tokens"), int):
                self.prefill_prompt_tokens = usage["prompt_tokens"]
            self.cached_tokens = cached(usage)
            ok = True
            return kv
        except Failed as f:
            failed = f
            raise
        finally:
            self.lease.prefill_done(self.r.clock.now(), ok=ok)
            if leg is not None:
                leg.end(row=failed.row.id if failed is not None else (None if ok else "interrupted"), detail=failed.detail if failed is not None else None,
                        **{"narwhal.prompt_tokens": self.prefill_prompt_tokens, "narwhal.cached_tokens": self.cached_tokens})
                self.leg = None

    async def decode(self, e: EngineSpec, kv: dict[str, Any] | None, cont: Cont | None = None) -> str:
        """Stream from a unified or decode engine; relay or assemble. Returns the class.
        `cont`: a continuation (stream migration), read on by the same relay through its
        Rejoin."""
        up, rejoin, checks_ids = await self._open_decode(e, kv, cont)
        relay = self.relay
        assert relay is not None
        buffered: list[bytes] = []
        last = await self._relay(e, up, relay, rejoin, buffered)
        now = self.r.clock.now()
        if relay.engine_error is not None:
            await self._relayed_error(e, relay.engine_error, last)
        self._learn(e, relay)
        if relay.assembler is not None:
            await self._respond_assembled(e, relay, relay.assembler, checks_ids, now)
        else:
            if not self.sink.headers_sent:
                await self._start(buffered)
            await self.sink.end_stream(last)
        self.ok_engine = e.name
        return "completed"

    async def _open_decode(self, e: EngineSpec, kv: dict[str, Any] | None, cont: Cont | None) -> tuple[Any, Any, bool]:
        """The decode leg's request, sent: (the exchange, a continuation's Rejoin or None,
        whether the engine's token IDs are checked). A new leg's relay is made once the
        request is out (`_sent`); a continuation reads on with the relay it has."""
        dialect = DIALECTS[e.dialect]
        checks_ids = dialect.token_accounting == "token_ids"
        rejoin = None
        if cont is not None and self.relay is not None:  # the relay read on
            body, path, rejoin = cont.body, "/v1/completions", cont.rejoin
            self._todo = None  # (never a new one: an earlier leg's that never went out is void)
        else:
            body = decode_body(self.body, dialect=e.dialect, model=e.model, kv_transfer_params=kv, disaggregated=e.role == "decode")
            path = _ROUTE_PATH[self.req.route]
            self._todo = (dialect, checks_ids)  # a new relay: made once the request is out (_sent)
        try:
            headers = self._leg_headers({"x-request-id": self.rid} if dialect.propagate_request_id else None)
            up = await self.r.client.open("POST", e.url + path, body=orjson.dumps(body), headers=headers, sent=self._sent if self._todo is not None else None)
        except UpstreamError as x:
            raise self._upstream(x, e) from None
        del body, headers  # sent: not held for the stream's life (memory per open stream)
        self._sent()  # (done already, unless the request went out some other way)
        return up, rejoin, checks_ids

    async def _relay(self, e: EngineSpec, up: Any, relay: StreamRelay, rejoin: Any, buffered: list[bytes]) -> bytes:
        """The decode leg's response read to `data: [DONE]`, every read through the relay
        step: response headers go out with the first token (a streaming client's events
        before it wait in `buffered`), a failure raises (E02-E07). Returns a streaming
        client's last bytes: they go with the stream's end (one write). The per-read loop
        stays inline: it is the request's hot path."""
        r, sink = self.r, self.sink
        assembler = relay.assembler
        last = b""
        complete = False
        legs, movers = self._reachable(e, up, relay)
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
            fast = self._direct_feed(relay, rejoin, buffered)
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
                        raise Failed(E.E06, f"engine {e.name}: the stream ended without data: [DONE]", engine=e)
                    if rejoin is not None:  # a continuation: in the client's stream's shape first
                        chunk = rejoin.feed(chunk)
                        if rejoin.too_large:
                            raise Failed(E.E02, f"engine {e.name}: an event or line longer than upstream.max_event_bytes", engine=e)
                        if not chunk:
                            continue
                    now = now_fn()
                    step = relay.feed(chunk, now)
                if step.failure is not None:
                    await self._step_failed(e, relay, step)
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
                if self.r.preempt:
                    self.r.preemptible.pop(self.lease.key, None)
            await up.aclose(complete=complete)
        return last

    def _reachable(self, e: EngineSpec, up: Any, relay: StreamRelay) -> tuple[set[Any], dict[Any, Any] | None]:
        """The leg, registered where the plane reaches it for as long as it is open: a cut
        (lifecycle M30) reaches every leg; a drain with discovery.drain: migrate may move
        one that keeps a record (worker/plane.py). Returns the two registers (movers None:
        not movable); `_relay` takes the leg out of them."""
        legs = self.r.legs.setdefault(e.name, set())
        legs.add(up)
        movers = None
        if relay.recorder is not None:
            movers = self.r.movers.setdefault(e.name, {})
            movers[up] = self._movable
            if self.r.preempt:  # fair preemption (core/preempt.py) reaches it by the lease's key
                self.r.preemptible[self.lease.key] = (up, self._movable)
        return legs, movers

    def _direct_feed(self, relay: StreamRelay, rejoin: Any, buffered: list[bytes]) -> DirectFeed | None:
        """serving.relay_path direct (worker/direct.py): reads fed from the connection's
        callback, a streaming client's head and first token included; None: the leg reads
        through `next_raw` (a continuation always does)."""
        r, sink = self.r, self.sink
        assembler = relay.assembler
        if r.direct_relay and rejoin is None and (assembler is not None or (sink.write_now is not None and sink.start_now is not None)):
            return DirectFeed(relay, r.now, None if assembler is not None else sink, buffered, self._first_token, native=r.native_relay)
        return None

    async def _step_failed(self, e: EngineSpec, relay: StreamRelay, step: Any) -> NoReturn:
        """A relay step's failure (E02-E04): the bytes of the events before it still reach a
        client that has its headers; after headers an engine error event is held back for
        migration (core/relay.py); the detail (engine values) goes to the log only."""
        row, detail = step.failure
        sink = self.sink
        if sink.headers_sent and step.out:
            await sink.write(step.out)
        if step.engine_error is not None and sink.headers_sent:  # migration on (core/relay.py)
            raise Failed(E.ROWS[row], f"engine {e.name}: {detail}", engine=e, event=step.engine_error)
        log.warning("request %s: engine %s: %s %s%s", self.rid, e.name, row, detail, f": {relay.failure_detail}" if relay.failure_detail else "")
        raise Failed(E.ROWS[row], f"engine {e.name}: {detail}", engine=e)

    async def _relayed_error(self, e: EngineSpec, event: dict[str, Any], last: bytes) -> NoReturn:
        """The stream ended on an engine error event (E04). Before response headers, the
        attempt failed (retryable); after them, the client has the engine's own event in its
        shape, and the stream ends with it (class "failed", the engine's breaker told)."""
        sink = self.sink
        if not sink.headers_sent:
            log.warning("request %s: engine %s: E04 error event %r", self.rid, e.name, orjson.dumps(event)[:500])
            raise Failed(E.E04, f"engine {e.name}: {err_msg(event, self.r.engine_hosts)}", engine=e)
        await sink.end_stream(last)
        f = Failed(E.E04, "error event", engine=e)
        raise Ended("failed", f)

    async def _respond_assembled(self, e: EngineSpec, relay: StreamRelay, assembler: Assembler, checks_ids: bool, now: float) -> None:
        """A non-streaming client's answer: the assembly finished (E01 on what it cannot
        make whole), usage from prefill merged (P/D), the prompt count's source named in
        x-narwhal-usage-source; `now`, the stream's end, is its first token when no token
        came before."""
        r = self.r
        prompt, source = self._prompt_usage(assembler, e)
        if source == "estimate":
            # the engine omits usage: it counts it now, after the stream (an engine that
            # serialises requests is idle for this one: it still holds the slot), its
            # tokenizer first, else its own non-streaming count (upstream/usage.py),
            # each bounded by usage.COUNT_TIMEOUT_S; the estimate only where neither can
            for pc in (r.prompt_counter(e.name), r.engine_count(e.name)):
                n = await pc.count(self.req.route, self.req.body) if pc is not None else None
                if n is not None:
                    prompt, source = n, pc.kind
                    self.reported_prompt = n
                    break
        res = assembler.finish(prompt_tokens=prompt, completion_tokens=relay.token_count if checks_ids else None)
        if isinstance(res, Failure):
            log.warning("request %s: engine %s: %s %s (%s)%s", self.rid, e.name, res.row, res.detail, res.rule, f": {res.log_detail}" if res.log_detail else "")
            raise Failed(E.ROWS[res.row], f"engine {e.name}: {res.detail} ({res.rule})", engine=e)
        if self.prefill_prompt_tokens is not None:
            merge_usage(res, self.prefill_prompt_tokens)
        if self.first_token_at is None:
            self._first_token(now)
        await self.sink.respond(200, [(b"content-type", b"application/json"), (USAGE_SOURCE_HEADER, source.encode())], orjson.dumps(res))

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
        self.lease.first_token(now, self.r.preempt and self._movable())  # movable: core/preempt.py may ask
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
            except Failed as f:
                row = f.row
                if self.sink.headers_sent and f.engine is not None and row.id in MIGRATED_FAILURES:
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
                log.info("request %s: retrying after %s on %s", self.rid, row.id, e.name)
                f.reported = True  # Lease.retry tells the engine's breaker
                nxt = await self.lease.retry(f.engine.name, row, g.phase, r.clock.now())
                if nxt is None:
                    raise
                if isinstance(nxt, Refuse):
                    return await refuse(self.sink, nxt.row, overrun_s=nxt.overrun_s, **nxt.fields)
                g = nxt

    async def _traced_decode(self, leg: Leg, e: EngineSpec, kv: dict[str, Any] | None, cont: Cont | None = None) -> str:
        """`decode` with its leg's span (and the relay's) ended however it ends."""
        row: str | None = "interrupted"
        detail: str | None = None
        cls: str | None = None
        try:
            cls = await self.decode(e, kv, cont)
            row = None
            return cls
        except Failed as f:
            row, detail = f.row.id, f.detail
            raise
        except Ended as x:
            row, detail, cls = x.failure.row.id, x.failure.detail, x.cls
            raise
        finally:
            self.leg = None
            leg.end(row=row, detail=detail, **{"narwhal.class": cls, "narwhal.output_tokens": self.output_tokens,
                                               "narwhal.finish_reason": self.finish_reason, "narwhal.events": self.events})
