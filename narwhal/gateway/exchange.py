"""One ext_proc stream driven against the door: the picker's side of one gateway request.

What arrives (`Heard`) and what is answered (`Said`) are values; the gRPC shell
(narwhal/gateway/server.py) turns them into Envoy's messages and back. The decisions are
narwhal/gateway/decide.py's; admission is the data plane's door (narwhal/core/lease.py:
`Door.arrive` -> `Entry` -> `Lease`), called through its public methods exactly as the
HTTP path calls them, so a request through the gateway meets the same rows.

The books (spec/tables/accounting.yaml): a completion request is offered once, at its
request headers (`Door.arrive`), and ends in exactly one terminal class: the row's class
for a refusal, `completed` or `failed` from the response, and `cancelled` when the
stream ends first (the client or Envoy went away, Envoy's message timeout, or nothing
heard for gateway.stream_idle_ms). The `finally` below is the only place an entry is
closed and a lease freed.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from narwhal_generated import errors as E

from ..core.lease import Entry, Grant, Lease, Order, Outcome, Rerouting
from ..core.prefix import rendered, text_keys
from ..core.requests import ParsedRequest, Rejection, parse_headers, parse_request, without_fields
from ..core.tickets import Refuse
from ..http.completions import new_request_id
from ..http.errors import RID_OK
from ..telemetry.logs import RequestRecord, emit_request_end
from ..tenants import Identity
from ..worker.plane import DataPlane
from ..worker.replies import cached
from ..worker.request import EXPECTED_CACHED_HEADER, PROJECTED_TTFT_HEADER
from .decide import (
    BodyReader,
    Head,
    Immediate,
    Mutation,
    Piece,
    ResponseReader,
    Route,
    TooLarge,
    endpoint_of,
    grant,
    header,
    refusal,
    route_of,
)

__all__ = ["Heard", "Said", "Exchange", "BODY_PIECE"]

log = logging.getLogger("narwhal")

BODY_PIECE = 60 * 1024  # the forwarded request body is answered in pieces of at most this many bytes


@dataclass(frozen=True, slots=True)
class Heard:
    """One message from Envoy."""

    kind: str  # request_headers | request_body | request_trailers | response_headers | response_body | response_trailers
    head: Head | None = None
    body: bytes = b""
    end: bool = False
    served: str | None = None  # the endpoint Envoy reports it served (x-gateway-destination-endpoint-served)
    subset: frozenset[str] | None = None  # request headers: Envoy's subset hint, the endpoints the picker may name


@dataclass(frozen=True, slots=True)
class Said:
    """One answer to Envoy: `kind` names the message it answers (or `immediate`)."""

    kind: str
    answer: Route | Immediate | Mutation | Piece | None = None
    metadata: dict[str, dict[str, str]] | None = None  # dynamic metadata, namespace -> key -> value


def _projection(lease: Lease) -> tuple[tuple[str, bytes], ...]:
    """Predictive mode: what admission projected for the request, on its response, as the
    direct path sends it (worker/request.py)."""
    if lease.projected_ttft_ms is None:
        return ()
    return ((PROJECTED_TTFT_HEADER.decode(), b"%d" % round(lease.projected_ttft_ms)), (EXPECTED_CACHED_HEADER.decode(), b"%d" % round(lease.expected_cached)))


class _Ended(Exception):
    """Envoy ended the stream (or sent nothing for gateway.stream_idle_ms)."""


def _rid(head: Head) -> str:
    """The client's x-request-id when it is one the HTTP path keeps, else a new one."""
    raw = header(head, "x-request-id")
    return raw.decode() if raw is not None and RID_OK.fullmatch(raw) else new_request_id()


class Exchange:
    """One stream's state; `run` returns the request's terminal class."""

    def __init__(self, plane: DataPlane, heard: AsyncIterator[Heard], say: Callable[[Said], Awaitable[None]], *, idle_s: float) -> None:
        self.r = plane
        self._heard = heard
        self._say = say
        self.idle_s = idle_s
        self.lease: Lease | None = None
        self.engine: str | None = None
        self.endpoint: str | None = None  # the engine the books hold the request on (ip:port): the grant's first, or the one served
        self.named: dict[str, str] = {}  # what the grant named, endpoint -> engine (the first, then the fallbacks)
        self.reader: ResponseReader | None = None
        self.first_at: float | None = None
        self.served: str | None = None
        self.arrival = 0.0
        self.rid = ""
        self.subset: frozenset[str] | None = None
        self.rec: RequestRecord | None = None  # JSON logs or a sampled trace: the request_end line, the root span
        # the terminal class once the answer's last message is handed to gRPC: Envoy ends
        # the stream as soon as it has it, which may cancel this task inside that write
        self.decided: str | None = None

    async def next(self) -> Heard:
        try:
            async with asyncio.timeout(self.idle_s):
                return await anext(self._heard)
        except (StopAsyncIteration, TimeoutError):
            raise _Ended from None

    async def refuse(self, im: Immediate) -> str:
        if self.rec is not None:
            self.rec.row, self.rec.status = im.row, im.status
        self.decided = im.cls  # handed to Envoy: Envoy may close the stream before the write returns
        await self._say(Said("immediate", im))
        return im.cls

    async def run(self) -> str:
        first = await self.next()
        if first.kind != "request_headers" or first.head is None:
            return "none"
        head = first.head
        self.subset = first.subset
        rid = self.rid = _rid(head)
        route = route_of(head)
        method = (header(head, ":method") or b"").decode("latin-1")
        if route is None:  # H01: not a completion route (neither offered nor in the books)
            return await self.refuse(refusal(E.H01, rid, method=method, path=(header(head, ":path") or b"").decode("latin-1")))
        if method != "POST":
            return await self.refuse(refusal(E.H02, rid, method=method, path=(header(head, ":path") or b"").decode("latin-1")))
        r = self.r
        arrival = self.arrival = r.clock.now()
        tel = r.telemetry
        tp = header(head, "traceparent")
        trace = tel.tracing.start(rid, tp) if tel.tracing is not None else None  # sampled once, here (the root span only)
        if trace is not None or tel.json_logs:
            self.rec = RequestRecord(rid, route, arrival, trace=trace, traceparent=tp, tracestate=header(head, "tracestate"), log=tel.json_logs)
        who: Identity | None = None
        denied: Refuse | None = None
        if r.auth is not None:  # R15, R16: from the head alone (narwhal/tenants)
            checked = r.auth.check((k.encode(), v) for k, v in head.headers if not k.startswith(":"))
            if isinstance(checked, Identity):
                who = checked
            else:
                denied = Refuse(checked)
        got = await r.door.arrive(arrival, denied, who.tenant if who is not None else None)
        if isinstance(got, Refuse):  # R01, R15/R16, R02: the authority has closed the books
            r.telemetry.child(r.telemetry.e2e, got.row.counter).observe(r.clock.now() - arrival)
            try:
                return await self.refuse(refusal(got.row, rid, overrun_s=got.overrun_s, **got.fields))
            finally:
                self._record(got.row.counter)
        cls: str | None = None
        try:
            cls = await self._admitted(got, head, route, rid, arrival, who, denied)
            return cls
        except _Ended:
            cls = self.decided or "cancelled"
            return cls
        finally:
            cls = cls or self.decided
            self._close(cls or "cancelled")
            got.end(cls or "cancelled")
            r.telemetry.child(r.telemetry.e2e, cls or "cancelled").observe(r.clock.now() - arrival)
            self._record(cls or "cancelled")

    async def _body(self, head: Head) -> bytes | None:
        """The request body (R03: None past serving.max_request_bytes; the rest of the
        chunks are still heard, never kept)."""
        try:
            reader = BodyReader(self.r.config.serving.max_request_bytes, head)
        except TooLarge:
            return None
        too_large = False
        while not reader.done:
            m = await self.next()
            if m.kind == "request_trailers":
                break
            if m.kind != "request_body":
                continue
            if too_large:
                if m.end:
                    break
                continue
            try:
                reader.feed(m.body, m.end)
            except TooLarge:
                too_large = True
                if m.end:
                    break
        return None if too_large else reader.body

    async def _admitted(self, entry: Entry, head: Head, route: str, rid: str, arrival: float, who: Identity | None, denied: Refuse | None) -> str:
        """From an offered request to its terminal class: R01/R02 as decided at arrival,
        R03-R07 on the body, R08-R14 at admission, then the grant and the response."""
        r = self.r
        if denied is not None:  # the authority's answer is R01 or `denied`; the body is not needed
            refused = await entry.arrived() or denied
            return await self.refuse(refusal(refused.row, rid, overrun_s=refused.overrun_s, **refused.fields))
        body = await self._body(head)
        refused = await entry.arrived()
        if refused is not None:
            return await self.refuse(refusal(refused.row, rid, overrun_s=refused.overrun_s, **refused.fields))
        if body is None:  # R03
            return await self.refuse(refusal(E.R03, rid, limit=r.config.serving.max_request_bytes))
        parsed, order = await self._parse(head, route, body, arrival, who)
        if isinstance(parsed, Rejection):  # R04-R07
            return await self.refuse(refusal(parsed.row, rid, param=parsed.param, **parsed.fields))
        assert order is not None
        if self.subset is not None:
            only = frozenset(n for n, s in r.engines.items() if endpoint_of(s.url) in self.subset)
            if not only:  # the subset hint names no engine this router places on: R09 before any slot
                return await self.refuse(refusal(E.R09, rid, phase="unified"))
            order = replace(order, only=only)  # admission places on the subset's engines alone
        lease = await entry.admit(order)
        if isinstance(lease, Refuse):  # R08-R11, R14 (and R17-R20 with tenants)
            return await self.refuse(refusal(lease.row, rid, overrun_s=lease.overrun_s, **lease.fields))
        self.lease = lease
        g = await lease.granted()
        if isinstance(g, Refuse):  # R12/R13: expired in the queue
            return await self.refuse(refusal(g.row, rid, overrun_s=g.overrun_s, **g.fields))
        return await self._granted(g, lease, parsed, rid)

    async def _parse(self, head: Head, route: str, body: bytes, arrival: float, who: Identity | None) -> tuple[ParsedRequest | Rejection, Order | None]:
        """R04-R07 and the request's sizing, as the HTTP path makes its Order."""
        r = self.r
        adm = r.config.admission
        ttft, dl = header(head, "x-narwhal-ttft-target-ms"), header(head, "x-narwhal-deadline-ms")
        hv = parse_headers(None if ttft is None else ttft.decode("latin-1"), None if dl is None else dl.decode("latin-1"),
                           budget_ms=adm.ttft_budget_ms, max_target_ms=adm.max_ttft_target_ms)
        if isinstance(hv, Rejection):
            return hv, None
        parsed = parse_request(route, body, model=r.config.serving.model)
        if isinstance(parsed, Rejection):
            return parsed, None
        exact = parsed.prompt_token_count
        if exact is None and r.count_tokens is not None and parsed.prompt_text is not None:
            exact = r.count_tokens(parsed.prompt_text)
        tenant = None if who is None else who.tenant
        order = Order(
            route=route, prompt_bytes=parsed.prompt_bytes, exact_prompt_tokens=exact, max_tokens=parsed.max_tokens,
            budget_ms=float(hv.ttft_target_ms if hv.ttft_target_ms is not None else r.tenant_budget_ms(tenant)),
            arrival=arrival, deadline_s=None if hv.deadline_ms is None else hv.deadline_ms / 1000.0,
            prefix=text_keys(rendered(route, parsed.body)) if r.models_prefix else (),
            token_prefix=await r.token_prefix(route, parsed.body) if r.kv_tokenizer is not None else (),
            tenant=tenant, key_id=None if who is None else who.key_id,
        )
        return parsed, order

    async def _granted(self, g: Grant, lease: Lease, parsed: ParsedRequest, rid: str) -> str:
        """The grant answered (destination header, envoy.lb metadata, the engine's body),
        then the response read through to its end."""
        r = self.r
        spec = r.engines.get(g.engine)
        if g.phase == "prefill" or spec is None:
            # a prefill/decode pair needs two engine requests; Envoy sends one (docs/gateway.md)
            log.error("request %s: granted %s (%s), which the gateway cannot serve: gateway mode needs unified engines", rid, g.engine, g.phase)
            return await self.refuse(refusal(E.H06, rid, request_id=rid))
        endpoint = endpoint_of(spec.url)
        if self.subset is not None and endpoint not in self.subset:
            # the picker names only endpoints of Envoy's subset hint (admission placed within
            # it: Order.only; an engine's address changed meanwhile): R09, the slot freed
            log.info("request %s: granted %s, outside the gateway's subset hint; answered R09", rid, g.engine)
            return await self.refuse(refusal(E.R09, rid, phase=g.phase))
        self.engine, self.endpoint = g.engine, endpoint
        self.named = {endpoint: g.engine, **self._fallbacks(lease)}
        route = grant(tuple(self.named), without_fields(parsed.body, r.strip_fields), dialect=spec.dialect, model=spec.model, rid=rid)
        await self._say(Said("request_headers", route, {"envoy.lb": {"x-gateway-destination-endpoint": route.endpoint}}))
        body = route.body
        for i in range(0, max(len(body), 1), BODY_PIECE):
            await self._say(Said("request_body", Piece(body[i:i + BODY_PIECE], i + BODY_PIECE >= len(body))))
        self.reader = ResponseReader(
            route=parsed.route, stream=parsed.stream, client_ids=parsed.return_token_ids, client_usage=parsed.client_usage,
            dialect=spec.dialect, prompt_tokens=lease.prompt_tokens, exact_prompt=parsed.prompt_token_count is not None,
            max_event_bytes=r.config.upstream.max_event_bytes, max_answer_bytes=r.config.upstream.max_answer_bytes,
            hosts=r.engine_hosts, rid=rid, extra_headers=_projection(lease), engine=g.engine)
        return await self._response(self.reader, lease, parsed.route)

    def _fallbacks(self, lease: Lease) -> dict[str, str]:
        """endpoint -> engine for the grant's fallbacks (core/reroute.py: of the granted
        engine's dialect and model, inside the subset hint), in order, at most
        gateway.max_fallbacks."""
        n = self.r.config.gateway.max_fallbacks if self.r.config.gateway is not None else 0
        if not n or not isinstance(lease, Rerouting):
            return {}
        out: dict[str, str] = {}
        for name in lease.fallbacks(n):
            s = self.r.engines.get(name)
            ep = endpoint_of(s.url) if s is not None else None
            if ep is not None and ep != self.endpoint and (self.subset is None or ep in self.subset):
                out.setdefault(ep, name)
        return out

    def _served(self, served: str, lease: Lease) -> None:
        """The gateway reports the endpoint it served (x-gateway-destination-endpoint-served):
        a fallback the grant named takes the request's slot on the books (core/reroute.py);
        one it did not name is logged (the books cannot follow)."""
        self.served = served
        if served == self.endpoint:
            return
        engine = self.named.get(served)
        if engine is not None and self.first_at is None and isinstance(lease, Rerouting) and lease.served(engine, self.r.clock.now()):
            log.info("request %s: served by %s (%s), a fallback; %s failed to connect", self.rid, engine, served, self.engine)
            self.engine, self.endpoint = engine, served
            if self.reader is not None:
                self.reader.engine = engine
            return
        log.warning("the gateway reports it served %s, not %s (engine %s), the endpoint the picker named", served, self.endpoint, self.engine)

    async def _response(self, reader: ResponseReader, lease: Lease, route: str) -> str:
        """The response direction until Envoy's last message of it has been answered (a
        stream's failure ends it for the client first; what the engine sends after is
        answered empty)."""
        r = self.r
        done = False
        while not done:
            m = await self.next()
            if m.served is not None and m.served != self.served:
                self._served(m.served, lease)
            if m.kind == "response_headers" and m.head is not None:
                await self._say(Said("response_headers", reader.headers(m.head)))
                if m.head.end_of_stream:  # a response without a body
                    reader.chunk(b"", True, r.clock.now())
                    self.decided = reader.ended.cls if reader.ended is not None else None
                    done = True
            elif m.kind == "response_body":
                now = r.clock.now()
                piece, first = reader.chunk(m.body, m.end, now)
                if first and self.first_at is None:
                    self.first_at = now
                    lease.first_token(now)  # learning; the TTFT the client sees
                    r.telemetry.child(r.telemetry.ttft, route).observe(now - self.arrival)
                if m.end and reader.ended is not None:
                    self.decided = reader.ended.cls
                if piece.body or piece.end:  # FULL_DUPLEX_STREAMED: answers need not match chunks one to one
                    await self._say(Said("response_body", piece))
                done = m.end
            elif m.kind == "response_trailers":
                if reader.ended is None:
                    piece, _ = reader.chunk(b"", True, r.clock.now())
                    await self._say(Said("response_body", Piece(piece.body, False)))
                self.decided = reader.ended.cls if reader.ended is not None else None
                await self._say(Said(m.kind))
                done = True
            elif m.kind == "request_trailers":
                await self._say(Said(m.kind))
        assert reader.ended is not None
        return reader.ended.cls

    def _record(self, cls: str) -> None:
        """The request_end line (serving.log_format json) and the root span (when sampled):
        what the stream learnt; never raises."""
        rec = self.rec
        if rec is None:
            return
        try:
            reader = self.reader
            if reader is not None:
                relay = reader.relay
                rec.stream, rec.status = reader.stream, rec.status or reader.status
                rec.output_tokens, rec.finish_reason, rec.events = relay.token_count, relay.finish_reason, relay.events
                rec.tpot_s = relay.arrivals.tpot()
                rec.prompt_tokens = reader.prompt_tokens
                rec.row = rec.row or (reader.ended.row if reader.ended is not None else None)
            if self.engine is not None:
                rec.engines.append(self.engine)
            if self.first_at is not None:
                rec.ttft_s = self.first_at - self.arrival
            emit_request_end(rec, cls, self.r.clock.now())
        except Exception:  # noqa: BLE001 - observability never fails a request
            log.exception("gateway request %s: its end record failed", rec.request_id)

    def _close(self, cls: str) -> None:
        """The lease freed, with what the response taught (exactly once)."""
        lease, self.lease = self.lease, None
        if lease is None:
            return
        reader = self.reader
        ended = reader.ended if reader is not None else None
        kw: dict[str, Any] = {}
        if reader is not None and ended is not None:
            relay = reader.relay
            tpot = relay.arrivals.tpot()
            usage = relay.usage
            pt = usage.get("prompt_tokens") if isinstance(usage, dict) else None
            kw = {"tpot_s": tpot, "tpot_engine": self.engine if tpot is not None else None, "output_tokens": relay.token_count,
                  "finish_reason": relay.finish_reason, "reported_prompt_tokens": pt if type(pt) is int else None, "cached_tokens": cached(usage)}
        if cls == "completed":
            kw["ok_engine"] = self.engine
        elif ended is not None and ended.row in ("E02", "E03", "E04") and self.engine is not None:
            kw["failed_engine"], kw["failed_row"] = self.engine, ended.row  # the breaker counts the engine's failures
        lease.close(Outcome(at=self.r.clock.now(), **kw))

