"""The completion routes, as raw ASGI (the hot path: no middleware, no Request objects).

Order of decisions, as the refusal table orders them:
  R01 router not ready, R15/R16 (auth: no valid key; the verdict is the data plane's,
  from the head, and the door ranks it after R01) and R02 retention full are decided
  before the body is read;
  R03 while it is read (a Content-Length over the limit is refused before reading, and
  reading stops at the first byte past the limit, so nothing past it is buffered);
  R04-R07 on the parsed body (narwhal/core/requests.py); then workload sizing, and
  R08-R13 in narwhal/worker/request.py.
Observability (narwhal/telemetry, docs/observability.md): tracing decides sampling once, at
arrival; a sampled request, every request with JSON logs, and one with a client's
`traceparent` (passed on to the engines) get a `RequestRecord`; its end writes the
request_end line and ends the root span. Any other request makes nothing.
Books: the authority's. `door.arrive` offers the request (and decides R01/R02, closing
the books itself when it refuses); from then on exactly one terminal class when it ends,
whatever happens (the `finally` below is the only place an admitted entry is closed).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace

from starlette.types import Receive, Scope, Send

from narwhal_generated import errors as E

from ..core import refusals as answers
from ..core.lease import Entry, Order
from ..core.prefix import rendered, text_keys
from ..core.requests import HeaderValues, ParsedRequest, body_facts
from ..core.tickets import Refuse
from ..telemetry.logs import RequestRecord, emit_request_end
from ..tenants import Identity
from ..worker.plane import DataPlane
from ..worker.request import error_event, run_request
from . import hyper
from .errors import RID_OK, drain_request, send_row
from .lean import LeanQueue
from .sink import AsgiSink, Stalls, until_disconnect

__all__ = ["CompletionEndpoint"]

log = logging.getLogger("narwhal")
_monotonic = time.monotonic



class _Gone(Exception):
    """The client went away while its body was read."""


class _TooSlow(Exception):
    """The request did not arrive whole within serving.read_timeout_ms (H07)."""


class _Fragmented(Exception):
    """The body arrives in absurdly small pieces (H10)."""


# H10: past FRAGMENT_PIECES body pieces, their average must reach FRAGMENT_MIN_BYTES
FRAGMENT_PIECES = 4096
FRAGMENT_MIN_BYTES = 64


class _TooLarge(Exception):
    def __init__(self, ended: bool = False) -> None:
        super().__init__()
        self.ended = ended  # the client had sent its whole body


async def _read_body(scope: Scope, receive: Receive, limit: int, deadline_s: float) -> bytes:
    """The whole body within deadline_s (H07) and `limit` bytes (R03), in one buffer:
    a body sent one byte per chunk costs one byte per byte, not a bytes object each."""
    for k, v in scope["headers"]:
        if k == b"content-length":
            try:
                if int(v) > limit:
                    raise _TooLarge
            except ValueError:
                pass
            break
    buf = bytearray()
    first: bytes | None = None
    pieces = 0
    # hypercorn's receive() is its LeanQueue's get (hyper.py item 12): a whole body already
    # queued -- read with the head, the common case -- is taken without a timer
    # (asyncio.timeout costs a timer and three loop lookups); anything else is read as
    # before, all of it within deadline_s
    queued = getattr(receive, "__self__", None)
    msg = queued.get_nowait() if type(queued) is LeanQueue and queued.qsize() else None
    if msg is not None and msg["type"] == "http.request" and not msg.get("more_body", False):
        body = msg.get("body", b"")
        if len(body) > limit:
            raise _TooLarge(ended=True)
        return body
    try:
        async with asyncio.timeout(deadline_s):
            while True:
                if msg is None:
                    msg = await receive()
                if msg["type"] == "http.disconnect":
                    raise _Gone
                body = msg.get("body", b"")
                more = msg.get("more_body", False)
                msg = None
                if body:
                    pieces += 1
                    if pieces > FRAGMENT_PIECES and more and len(buf) < FRAGMENT_MIN_BYTES * pieces:
                        raise _Fragmented  # H10
                    if len(buf) + len(body) > limit:
                        raise _TooLarge(ended=not more)
                    if first is None and not buf and not more:
                        first = body  # the whole body in one message, no copy
                    else:
                        if first is not None:
                            buf += first
                            first = None
                        buf += body
                if not more:
                    break
    except TimeoutError:
        raise _TooSlow from None
    return first if first is not None else bytes(buf)


def _rendered(row: E.ErrorRow, **fields: object) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, headers, body = answers.render(row, **fields)
    return status, [(b"connection", b"close"), *headers], body


def new_request_id() -> str:
    """A request id where the client sent none: a random UUID's 32 hex digits, version 4
    and the RFC 4122 variant, as `uuid.uuid4().hex` writes them, from os.urandom alone
    (0.7 µs against uuid4's 2.0, on every such request's way to the engine)."""
    b = bytearray(_urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    return b.hex()


_urandom = os.urandom


def _headers(scope: Scope) -> dict[bytes, bytes]:
    return {k: v for k, v in scope["headers"] if k in _READ}


_HEAD_READ: tuple[tuple[bytes, bytes], ...] = ()  # a running request's scope["headers"] once read

_READ = (b"x-request-id", b"x-narwhal-ttft-target-ms", b"x-narwhal-deadline-ms", b"traceparent", b"tracestate")


def _end(rec: RequestRecord | None, cls: str, now: float, sink: AsgiSink | None = None) -> None:
    """The request's record at its end (request_end line, root span); never raises."""
    if rec is None:
        return
    try:
        if sink is not None:
            if rec.status is None:
                rec.status = sink.status
            if sink.row is not None and rec.row is None:
                rec.row = sink.row
            rec.response_bytes = sink.body_bytes
        emit_request_end(rec, cls, now)
    except Exception:  # noqa: BLE001 - observability never fails a request
        log.exception("request %s: its end record failed", rec.request_id)


class CompletionEndpoint:
    """POST /v1/chat/completions or /v1/completions, in stages: the head (identity, the
    record, the door's arrival walk), the body (read, then its facts), admission and
    the request's life (worker/request.py), and its end (the books, exactly once)."""

    def __init__(self, plane: DataPlane, route: str) -> None:
        self.plane = plane
        self.route = route
        self.stalls = Stalls()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        r = self.plane
        hdr = _headers(scope)
        raw_rid = hdr.get(b"x-request-id")
        rid = raw_rid.decode() if raw_rid is not None and RID_OK.fullmatch(raw_rid) else new_request_id()
        if scope["method"] != "POST":
            await send_row(send, E.H02, rid=rid, method=scope["method"], path=scope["path"])
            return
        arrival = r.clock.now()
        who, denied = self._identity(scope)
        rec = self._record(rid, hdr, arrival, who)
        got = await r.door.arrive(arrival, denied, who.tenant if who is not None else None)
        if isinstance(got, Refuse):  # a head row: the authority has closed the books
            try:
                await self._answer(scope, receive, send, rid, got, rec)
            finally:
                self._ended(arrival, got.row.counter, rec)
            return
        if denied is not None and await self._denied(scope, receive, send, rid, arrival, got, rec):
            return
        await self._serve(scope, receive, send, rid, hdr, arrival, got, who, rec)

    async def _denied(self, scope: Scope, receive: Receive, send: Send, rid: str, arrival: float, entry: Entry, rec: RequestRecord | None) -> bool:
        """The data plane denied the key (R15/R16) and the arrival's walk goes on over IPC:
        its answer, with no body read; False when the table puts a later stage's row
        above the key's (the walk goes on with the body)."""
        ended = "cancelled"
        try:
            refused = await entry.arrived()
            if refused is None:
                ended = ""
                return False
            ended = refused.row.counter
            await self._answer(scope, receive, send, rid, refused, rec)
            return True
        finally:
            if ended:
                entry.end(ended)  # the authority closed the books at arrival; this End is ignored there
                self._ended(arrival, ended, rec)

    def _identity(self, scope: Scope) -> tuple[Identity | None, Refuse | None]:
        """R15, R16 (auth): the head's facts, from the head alone."""
        auth = self.plane.auth
        if auth is None:
            return None, None
        checked = auth.check(scope["headers"])
        if isinstance(checked, Identity):
            return checked, None
        return None, Refuse(checked)

    def _record(self, rid: str, hdr: dict[bytes, bytes], arrival: float, who: Identity | None) -> RequestRecord | None:
        """A RequestRecord when tracing samples it (decided once, here), with JSON logs,
        or with a client's traceparent; else nothing is made (the no-op path)."""
        tel = self.plane.telemetry
        tp = hdr.get(b"traceparent")
        trace = tel.tracing.start(rid, tp) if tel.tracing is not None else None
        if trace is None and not tel.json_logs and tp is None:
            return None
        rec = RequestRecord(rid, self.route, arrival, trace=trace, traceparent=tp, tracestate=hdr.get(b"tracestate"), log=tel.json_logs)
        if who is not None:
            rec.tenant, rec.key_id = who.tenant, who.key_id
        return rec

    async def _answer(self, scope: Scope, receive: Receive, send: Send, rid: str, refused: Refuse, rec: RequestRecord | None,
                      drain: bool = True, timeout_s: float = 2.0) -> None:
        """A refusal row's answer (from the row alone), the body drained first."""
        if rec is not None:
            rec.refused(refused.row)
        if drain:
            await drain_request(scope, receive, limit=8 * self.plane.config.serving.max_request_bytes, timeout_s=timeout_s)
        await send_row(send, refused.row, rid=rid, param=refused.param, overrun_s=refused.overrun_s, **refused.fields)

    def _ended(self, arrival: float, cls: str, rec: RequestRecord | None, sink: AsgiSink | None = None) -> None:
        r = self.plane
        r.telemetry.child(r.telemetry.e2e, cls).observe(r.clock.now() - arrival)
        _end(rec, cls, r.clock.now(), sink)

    async def _serve(self, scope: Scope, receive: Receive, send: Send, rid: str, hdr: dict[bytes, bytes], arrival: float,
                     entry: Entry, who: Identity | None, rec: RequestRecord | None) -> None:
        """An offered request from its body on; `entry.end` here is the only place an
        offered entry's books are closed (exactly one terminal class)."""
        r = self.plane
        sink = AsgiSink(send, rid, r.config.serving.send_stall_ms / 1000.0, (scope.get("extensions") or {}).get(hyper.DIRECT) if r.direct_relay else None)
        cls: str | None = None
        try:
            cls = await self._body_on(scope, receive, send, rid, hdr, arrival, entry, who, rec, sink)
        except asyncio.CancelledError:
            cls = "cancelled"
            raise
        except OSError:
            cls = "cancelled"  # the client's connection broke while we wrote to it
        except Exception:
            log.exception("request %s (key %s): router bug", rid, "-" if who is None else who.key_id)  # the key's id, never the key
            cls = E.H06.counter
            await self._bug(send, rid, sink, rec)
        finally:
            entry.end(cls or "cancelled")
            self._ended(arrival, cls or "cancelled", rec, sink)

    async def _bug(self, send: Send, rid: str, sink: AsgiSink, rec: RequestRecord | None) -> None:
        """H06: the router's own fault, told to the client as well as it still can be."""
        sink.row = E.H06.id
        try:
            if not sink.headers_sent:
                if rec is not None:
                    rec.status = E.H06.status
                await send_row(send, E.H06, rid=rid, request_id=rid)
            elif not sink.finished:
                await sink.write(error_event(E.H06, request_id=rid))
                await sink.end_stream()
        except Exception:  # noqa: BLE001 - the client may be gone too
            pass

    async def _body_on(self, scope: Scope, receive: Receive, send: Send, rid: str, hdr: dict[bytes, bytes], arrival: float,
                       entry: Entry, who: Identity | None, rec: RequestRecord | None, sink: AsgiSink) -> str | None:
        """Read the body (H07, H10 are the reader's own answers, not refusal rows), hear
        the arrival's walk, then the body's facts and the rest of the walk."""
        r = self.plane
        limit = r.config.serving.max_request_bytes
        failed: _TooLarge | _Fragmented | _TooSlow | None = None
        try:
            body = await _read_body(scope, receive, limit, r.config.serving.read_timeout_ms / 1000.0)
        except (_TooLarge, _Fragmented, _TooSlow) as e:
            failed, body = e, b""
        except _Gone:
            return "cancelled"
        # With workers the arrival is walked while the body is read: a refused one
        # answers with its own row, as it would have before the body.
        refused = await entry.arrived()
        if refused is not None:
            unread = failed is not None and not (isinstance(failed, _TooLarge) and failed.ended)
            await self._answer(scope, receive, send, rid, refused, rec, drain=unread, timeout_s=1.0)
            return refused.row.counter
        if isinstance(failed, (_Fragmented, _TooSlow)):
            return await self._unread(scope, receive, sink, failed)
        facts, parsed, hv = self._facts(body, hdr, limit, failed)
        if rec is not None:
            rec.request_bytes = len(body)
        if facts:  # a body row holds: the walk decides which row answers (it refuses)
            order = self._order(parsed, hv, arrival, who) if parsed is not None else None
            got = await entry.admit(order, facts)
            assert isinstance(got, Refuse), "a body row holds: the walk refuses"
            await self._answer(scope, receive, send, rid, got, rec, drain=isinstance(failed, _TooLarge) and not failed.ended)
            return got.row.counter
        assert parsed is not None and hv is not None
        if rec is not None:
            rec.stream = parsed.stream
        order = self._order(parsed, hv, arrival, who)
        if r.kv_tokenizer is not None:
            order = replace(order, token_prefix=await r.token_prefix(self.route, parsed.body))
        # the parsed request holds what the rest needs: a long prompt's bytes go now, and
        # what was read from the head with them (this frame and the server's scope live
        # as long as the stream; hypercorn reads the scope's headers again only for its
        # access log, which Narwhal turns off, and for HTTP/2 push and trailers, which
        # it never sends): ~0.5 KiB per open stream
        del body, hdr, hv
        scope["headers"] = _HEAD_READ
        return await until_disconnect(run_request(r, entry, parsed, order, sink, rid, rec), receive, sink, (scope.get("extensions") or {}).get(hyper.CLOSE), self.stalls)

    async def _unread(self, scope: Scope, receive: Receive, sink: AsgiSink, failed: _Fragmented | _TooSlow) -> str:
        """H10 (a body in absurdly small pieces) or H07 (not whole within
        serving.read_timeout_ms): the reader's answers."""
        r = self.plane
        drain = 8 * r.config.serving.max_request_bytes
        if isinstance(failed, _Fragmented):  # H10
            sink.row = E.H10.id
            await sink.respond(*_rendered(E.H10, limit=FRAGMENT_PIECES, min_bytes=FRAGMENT_MIN_BYTES))
            # no client sends real bodies so: its reconnects are refused at accept
            # for serving.abuse_penalty_ms, else the next 4,096 pieces cost the same
            hyper.penalise(scope)
            # a short linger only: draining such a body costs what H10 saves
            await drain_request(scope, receive, limit=65536, timeout_s=0.2)
            return E.H10.counter
        sink.row = E.H07.id  # H07
        await sink.respond(*_rendered(E.H07, limit_ms=r.config.serving.read_timeout_ms))
        # linger (bounded): a close while the client's bytes still arrive makes the
        # kernel send RST, which can destroy the 408 before the client reads it
        await drain_request(scope, receive, limit=drain, timeout_s=1.0)
        return E.H07.counter

    def _facts(self, body: bytes, hdr: dict[bytes, bytes], limit: int, failed: _TooLarge | None) -> tuple[tuple[Refuse, ...], ParsedRequest | None, HeaderValues | None]:
        """The body stage's facts (core/requests.py body_facts)."""
        adm = self.plane.config.admission
        ttft = hdr.get(b"x-narwhal-ttft-target-ms")
        dl = hdr.get(b"x-narwhal-deadline-ms")
        return body_facts(self.route, body, ttft.decode("latin-1") if ttft is not None else None, dl.decode("latin-1") if dl is not None else None,
                          too_large=limit if failed is not None else None, model=self.plane.config.serving.model,
                          budget_ms=adm.ttft_budget_ms, max_target_ms=adm.max_ttft_target_ms)

    def _order(self, parsed: ParsedRequest, hv: HeaderValues | None, arrival: float, who: Identity | None) -> Order:
        """What admission knows of the request: workload sizing here is an exact count
        (token IDs, or serving.tokenizer on the text), else the authority's learned
        estimate from the prompt's bytes."""
        r = self.plane
        exact = parsed.prompt_token_count
        if exact is None and r.count_tokens is not None and parsed.prompt_text is not None:
            exact = r.count_tokens(parsed.prompt_text)
        target = hv.ttft_target_ms if hv is not None else None
        return Order(
            route=self.route,
            prompt_bytes=parsed.prompt_bytes,
            exact_prompt_tokens=exact,
            max_tokens=parsed.max_tokens,
            budget_ms=float(target if target is not None else r.tenant_budget_ms(who.tenant if who is not None else None)),
            arrival=arrival,
            deadline_s=None if hv is None or hv.deadline_ms is None else hv.deadline_ms / 1000.0,
            # the prompt's prefix blocks: which engine may hold its history cached
            prefix=text_keys(rendered(self.route, parsed.body)) if r.models_prefix else (),
            tenant=None if who is None else who.tenant,
            key_id=None if who is None else who.key_id,
        )
