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
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

from starlette.types import Receive, Scope, Send

from narwhal_generated import errors as E

from ..core.lease import Order
from ..core.prefix import rendered, text_keys
from ..core.requests import ParsedRequest, Rejection, parse_headers, parse_request
from ..core.tickets import Refuse
from ..telemetry.logs import RequestRecord, emit_request_end
from ..tenants import Identity
from ..worker.plane import DataPlane
from ..worker.request import error_event, run_request
from . import hyper
from .errors import RID_OK, drain_request, send_row
from .h1fast import PreparedHead
from .lean import LeanQueue

__all__ = ["CompletionEndpoint"]

log = logging.getLogger("narwhal")
_monotonic = time.monotonic

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
]


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


class AsgiSink:
    """pipeline.Sink over ASGI send. Every send is bounded by serving.send_stall_ms: a
    client that accepts no bytes for that long (HTTP/1.1: the TCP window; HTTP/2: the
    flow-control window, see hyper.py defect 1) is dropped by `Stalls`, which
    cancels the request (its engine request is cancelled, its slots freed; class
    cancelled). A send only notes when it began (no timer per event: an asyncio.timeout
    around every write cost ~8 us an event on the relay path)."""

    __slots__ = ("_send", "rid", "headers_sent", "finished", "stall_s", "sending_since", "extra_headers", "row", "status", "body_bytes", "ending", "_direct", "_prepared")

    def __init__(self, send: Send, rid: str, stall_s: float, direct: hyper.H1Direct | None = None) -> None:
        self._send = send
        # HTTP/1.1 under hypercorn: body bytes straight to the transport while that is what
        # ASGI would do (hyper.py item 11); the relay writes from the engine's reads with it
        self._direct = direct
        self._prepared: PreparedHead | None = None  # the stream's head, built ahead (prepare_start)
        self.ending = False  # the response's last message is being sent: its stream closing is its end
        self.rid = rid
        self.headers_sent = False
        self.finished = False
        self.stall_s = stall_s
        self.sending_since = 0.0  # monotonic time the pending send began; 0: none pending
        self.extra_headers: list[tuple[bytes, bytes]] = []
        # for the request's record (per response, never per event)
        self.row: str | None = None
        self.status: int | None = None
        self.body_bytes: int | None = None

    async def _out(self, msg: dict[str, Any]) -> None:
        self.sending_since = _monotonic()
        await self._send(msg)
        self.sending_since = 0.0

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
        h = [*headers, *self.extra_headers, (b"x-request-id", self.rid.encode()), (b"content-length", str(len(body)).encode())]
        self.headers_sent = True
        self.status = status
        self.body_bytes = len(body)
        await self._out({"type": "http.response.start", "status": status, "headers": h})
        self.ending = True
        await self._out({"type": "http.response.body", "body": body, "more_body": False})
        self.finished = True

    def _head(self) -> list[tuple[bytes, bytes]]:
        return [*_SSE_HEADERS, *self.extra_headers, (b"x-request-id", self.rid.encode())]

    # write_now and start_now (replies.Sink): made when read, not kept (two bound methods
    # per open stream); the relay reads write_now once per event (~0.1 us)
    @property
    def write_now(self) -> Callable[[bytes], bool] | None:
        d = self._direct
        return d.write if d is not None else None

    @property
    def chunk_writer(self) -> hyper.H1Direct | None:
        return self._direct

    @property
    def start_now(self) -> Callable[[bytes], bool] | None:
        return self._start_now if self._direct is not None else None

    def prepare_start(self) -> None:
        """The stream's head built now, while the engine works on the first token (item
        21: H1Direct.prepare), so that _start_now only writes it; nothing where the head is
        not written straight to the connection."""
        if self._direct is not None and not self.headers_sent:
            self._prepared = self._direct.prepare(200, self._head())

    def _start_now(self, first: bytes) -> bool:
        """The stream's head and its first bytes written now (hyper.py items 11, 15), or
        nothing (False)."""
        assert self._direct is not None
        prepared, self._prepared = self._prepared, None
        if not self._direct.start(200, self._head(), first, prepared):
            return False
        self.headers_sent = True
        self.status = 200
        return True

    async def start_stream(self) -> None:
        if self._direct is not None and self._start_now(b""):  # HTTP/1.1: straight out (hyper.py item 11)
            return
        self.headers_sent = True
        self.status = 200
        await self._out({"type": "http.response.start", "status": 200, "headers": self._head()})

    async def write(self, data: bytes) -> None:
        await self._out({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self, last: bytes = b"") -> None:
        d = self._direct
        if d is not None and d.end(last):  # HTTP/1.1: one write, the last chunk in it (hyper.py item 17)
            self.ending = True
            await d.closed()
        else:
            if last:
                await self.write(last)
            self.ending = True
            await self._out({"type": "http.response.body", "body": b"", "more_body": False})
        self.finished = True


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


class _Disconnected(Exception):
    pass


class _Cancellable(Protocol):
    def cancel(self) -> object: ...


class Stalls:
    """serving.send_stall_ms for every request of an endpoint: one task, waking every
    stall_s / 4 while any request is watched, cancels each request whose pending send
    began more than stall_s ago (a task per request cost 1.4 KiB per open stream)."""

    __slots__ = ("watched", "_task")

    def __init__(self) -> None:
        self.watched: dict[AsgiSink, _Cancellable] = {}
        self._task: asyncio.Task[None] | None = None

    def watch(self, sink: AsgiSink, task: _Cancellable) -> None:
        self.watched[sink] = task
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())

    def unwatch(self, sink: AsgiSink) -> None:
        self.watched.pop(sink, None)
        if not self.watched and self._task is not None:  # nothing left: no task outlives the requests
            self._task.cancel()
            self._task = None

    async def _run(self) -> None:
        while self.watched:
            await asyncio.sleep(min(4.0, next(iter(self.watched)).stall_s / 4))
            now = _monotonic()
            for sink, task in list(self.watched.items()):
                since = sink.sending_since
                if since and now - since > sink.stall_s:
                    log.info("request %s: the client accepted no bytes for %.0f ms; dropped", sink.rid, sink.stall_s * 1000)
                    del self.watched[sink]
                    task.cancel()


class _Cut:
    """Cancels the request's own task for its client (gone, or stalled) and remembers it
    did: that cancellation is the class `cancelled`, any other one goes on up."""

    __slots__ = ("task", "sink", "fired")

    def __init__(self, task: asyncio.Task[Any], sink: AsgiSink) -> None:
        self.task = task
        self.sink = sink
        self.fired = False

    def cancel(self) -> None:  # Stalls: the client accepted nothing for send_stall_ms
        if not self.fired:
            self.fired = True
            self.task.cancel()

    def gone(self) -> None:  # the stream closed: the client went away, unless it was the answer's end
        if not self.sink.ending:
            self.cancel()


async def _until_disconnect(work: Coroutine[Any, Any, str], receive: Receive, sink: AsgiSink, hook: hyper.CloseHook | None, stalls: Stalls) -> str:
    """Run the request; if the client disconnects first, or stops reading for
    serving.send_stall_ms, cancel it (which closes the engine connections and frees
    every slot) and report the class `cancelled`.

    hypercorn reports a disconnect only through receive(), and a send() to a gone client
    is silently dropped: without a watcher a stream would run on to its end. Under
    hypercorn the stream's CloseHook (hyper.py) cancels the request -- run here, in the
    app's own task (a task of its own cost a loop turn before the engine saw the request,
    and memory per open stream) -- when the stream closes; under any other server a task
    waits on receive()."""
    if hook is None:
        return await _until_received_disconnect(work, receive, sink, stalls)
    if hook.closed:  # reset right after it was sent (HTTP/2 rapid reset): no engine sees it
        work.close()
        return "cancelled"
    me = asyncio.current_task()
    assert me is not None
    cut = _Cut(me, sink)
    hook.cb = cut.gone
    stalls.watch(sink, cut)
    try:
        got = await work
    except asyncio.CancelledError:
        if cut.fired and me.uncancel() == 0:  # only the client's cut: the request's end
            return "cancelled"
        raise
    except BaseException:
        if cut.fired:  # cut, and the work ended with an error of its own: that goes on up alone
            me.uncancel()
        raise
    finally:
        hook.cb = None
        stalls.unwatch(sink)
    if cut.fired:  # cut as it ended, and the work let the cancellation pass: it is not pending
        me.uncancel()
    return got


async def _until_received_disconnect(work: Coroutine[Any, Any, str], receive: Receive, sink: AsgiSink, stalls: Stalls) -> str:
    """_until_disconnect for a server without CloseHooks: a task waits on receive()."""
    watch = asyncio.ensure_future(receive())
    # a client that reset its stream right after sending it (HTTP/2 rapid reset) has its
    # disconnect queued already: one turn of the loop lets the watcher see it, and the
    # request never reaches an engine
    await asyncio.sleep(0)
    if watch.done() and watch.result().get("type") == "http.disconnect":
        work.close()
        return "cancelled"
    task = asyncio.ensure_future(work)
    stalls.watch(sink, task)
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return "cancelled" if task.cancelled() else task.result()
        msg = watch.result()
        if msg.get("type") != "http.disconnect":  # not expected after the whole body
            try:
                return await task
            except asyncio.CancelledError:
                if task.cancelled() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                    return "cancelled"  # dropped by the stall watcher
                raise
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return "cancelled"
    finally:
        stalls.unwatch(sink)
        if not watch.done():
            watch.cancel()
        if not task.done():
            task.cancel()


def _rendered(row: E.ErrorRow, **fields: object) -> tuple[int, list[tuple[bytes, bytes]], bytes]:
    status, headers, body = E.render(row, **fields)
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
    """POST /v1/chat/completions or /v1/completions."""

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
        drain = 8 * r.config.serving.max_request_bytes
        who: Identity | None = None
        denied: Refuse | None = None
        if r.auth is not None:  # R15, R16 (issue 22): from the head alone
            checked = r.auth.check(scope["headers"])
            if isinstance(checked, Identity):
                who = checked
            else:
                denied = Refuse(checked)
        tel = r.telemetry
        tp = hdr.get(b"traceparent")
        rec: RequestRecord | None = None
        trace = tel.tracing.start(rid, tp) if tel.tracing is not None else None  # sampled once, here
        if trace is not None or tel.json_logs or tp is not None:  # else nothing is made: the no-op path
            rec = RequestRecord(rid, self.route, arrival, trace=trace, traceparent=tp, tracestate=hdr.get(b"tracestate"), log=tel.json_logs)
            if who is not None:
                rec.tenant, rec.key_id = who.tenant, who.key_id
        got = await r.door.arrive(arrival, denied, who.tenant if who is not None else None)
        if isinstance(got, Refuse):  # R01, R15/R16, R02: the authority has closed the books
            try:
                await drain_request(scope, receive, limit=drain)
                await send_row(send, got.row, rid=rid, overrun_s=got.overrun_s, **got.fields)
            finally:
                r.telemetry.child(r.telemetry.e2e, got.row.counter).observe(r.clock.now() - arrival)
                if rec is not None:
                    rec.refused(got.row)
                    _end(rec, got.row.counter, r.clock.now())
            return
        entry = got
        if denied is not None:  # over IPC: the authority's answer is R01 or `denied`; no body is read
            ended = "cancelled"
            try:
                refused = await entry.arrived() or denied
                ended = refused.row.counter
                if rec is not None:
                    rec.refused(refused.row)
                await drain_request(scope, receive, limit=drain)
                await send_row(send, refused.row, rid=rid, overrun_s=refused.overrun_s, **refused.fields)
            finally:
                entry.end(ended)  # the authority closed the books at arrival; this End is ignored there
                r.telemetry.child(r.telemetry.e2e, ended).observe(r.clock.now() - arrival)
                _end(rec, ended, r.clock.now())
            return
        sink = AsgiSink(send, rid, r.config.serving.send_stall_ms / 1000.0, (scope.get("extensions") or {}).get(hyper.DIRECT) if r.direct_relay else None)
        cls: str | None = None
        try:
            adm = r.config.admission
            limit = r.config.serving.max_request_bytes
            failed: _TooLarge | _Fragmented | _TooSlow | None = None
            try:
                body = await _read_body(scope, receive, limit, r.config.serving.read_timeout_ms / 1000.0)
            except (_TooLarge, _Fragmented, _TooSlow) as e:
                failed = e
            except _Gone:
                cls = "cancelled"
                return
            # With workers the arrival (R01, R02) is decided while the body is read: a
            # refused one answers with its own row, as it would have before the body.
            refused = await entry.arrived()
            if refused is not None:
                if rec is not None:
                    rec.refused(refused.row)
                if failed is not None and not (isinstance(failed, _TooLarge) and failed.ended):
                    await drain_request(scope, receive, limit=drain, timeout_s=1.0)
                await send_row(send, refused.row, rid=rid, overrun_s=refused.overrun_s, **refused.fields)
                cls = refused.row.counter
                return
            if isinstance(failed, _TooLarge):  # R03
                if not failed.ended:
                    await drain_request(scope, receive, limit=drain)
                if rec is not None:
                    rec.refused(E.R03)
                await send_row(send, E.R03, rid=rid, limit=limit)
                cls = E.R03.counter
                return
            if isinstance(failed, _Fragmented):  # H10
                sink.row = E.H10.id
                await sink.respond(*_rendered(E.H10, limit=FRAGMENT_PIECES, min_bytes=FRAGMENT_MIN_BYTES))
                cls = E.H10.counter
                # no client sends real bodies so: its reconnects are refused at accept
                # for serving.abuse_penalty_ms, else the next 4,096 pieces cost the same
                hyper.penalise(scope)
                # a short linger only: draining such a body costs what H10 saves
                await drain_request(scope, receive, limit=65536, timeout_s=0.2)
                return
            if isinstance(failed, _TooSlow):  # H07
                sink.row = E.H07.id
                await sink.respond(*_rendered(E.H07, limit_ms=r.config.serving.read_timeout_ms))
                cls = E.H07.counter
                # linger (bounded): a close while the client's bytes still arrive makes the
                # kernel send RST, which can destroy the 408 before the client reads it
                await drain_request(scope, receive, limit=drain, timeout_s=1.0)
                return
            ttft = hdr.get(b"x-narwhal-ttft-target-ms")
            dl = hdr.get(b"x-narwhal-deadline-ms")
            hv = parse_headers(
                ttft.decode("latin-1") if ttft is not None else None,
                dl.decode("latin-1") if dl is not None else None,
                budget_ms=adm.ttft_budget_ms,
                max_target_ms=adm.max_ttft_target_ms,
            )
            parsed: ParsedRequest | Rejection = hv if isinstance(hv, Rejection) else parse_request(self.route, body, model=r.config.serving.model)
            if rec is not None:
                rec.request_bytes = len(body)
            if isinstance(parsed, Rejection):  # R04-R07
                if rec is not None:
                    rec.refused(parsed.row)
                await send_row(send, parsed.row, rid=rid, param=parsed.param, **parsed.fields)
                cls = parsed.row.counter
                return
            assert not isinstance(hv, Rejection)
            if rec is not None:
                rec.stream = parsed.stream
            # workload sizing: an exact count here (token IDs, or serving.tokenizer on the
            # text), else the authority's learned estimate from the prompt's bytes
            exact = parsed.prompt_token_count
            if exact is None and r.count_tokens is not None and parsed.prompt_text is not None:
                exact = r.count_tokens(parsed.prompt_text)
            order = Order(
                route=self.route,
                prompt_bytes=parsed.prompt_bytes,
                exact_prompt_tokens=exact,
                max_tokens=parsed.max_tokens,
                budget_ms=float(hv.ttft_target_ms if hv.ttft_target_ms is not None else r.tenant_budget_ms(who.tenant if who is not None else None)),
                arrival=arrival,
                deadline_s=None if hv.deadline_ms is None else hv.deadline_ms / 1000.0,
                # the prompt's prefix blocks: which engine may hold its history cached
                prefix=text_keys(rendered(self.route, parsed.body)) if r.models_prefix else (),
                token_prefix=await r.token_prefix(self.route, parsed.body) if r.kv_tokenizer is not None else (),
                tenant=None if who is None else who.tenant,
                key_id=None if who is None else who.key_id,
            )
            # the parsed request holds what the rest needs: a long prompt's bytes go now, and
            # what was read from the head with them (this frame and the server's scope live
            # as long as the stream; hypercorn reads the scope's headers again only for its
            # access log, which Narwhal turns off, and for HTTP/2 push and trailers, which
            # it never sends): ~0.5 KiB per open stream
            del body, hdr, hv, ttft, dl, tp
            scope["headers"] = _HEAD_READ
            cls = await _until_disconnect(run_request(r, entry, parsed, order, sink, rid, rec), receive, sink, (scope.get("extensions") or {}).get(hyper.CLOSE), self.stalls)
        except asyncio.CancelledError:
            cls = "cancelled"
            raise
        except OSError:
            cls = "cancelled"  # the client's connection broke while we wrote to it
        except Exception:
            log.exception("request %s (key %s): router bug", rid, "-" if who is None else who.key_id)  # the key's id, never the key
            cls = E.H06.counter
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
        finally:
            entry.end(cls or "cancelled")
            r.telemetry.child(r.telemetry.e2e, cls or "cancelled").observe(r.clock.now() - arrival)
            _end(rec, cls or "cancelled", r.clock.now(), sink)
