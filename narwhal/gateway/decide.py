"""The endpoint picker's decisions, sans-IO: what Envoy's external processor hears on one
stream and what it answers (docs/gateway.md).

One ext_proc stream is one client request through the gateway. Envoy sends, in order
(request and response bodies FULL_DUPLEX_STREAMED, headers and trailers SEND):
request headers, request body chunks, [request trailers], response headers, response
body chunks, [response trailers]. This module holds the values of that conversation
(frozen dataclasses) and the pure steps over them; `narwhal/gateway/exchange.py` drives
them against the door (narwhal/core/lease.py), `narwhal/gateway/server.py` is the gRPC
shell.

Invariants
  * A completion request through the gateway meets the same rows, in the same order, as
    one Narwhal answers directly (spec/tables/refusals.yaml): R01/R15/R16/R02 at
    arrival, R03 while the body arrives (a Content-Length over serving.max_request_bytes
    before any chunk; the first chunk past the limit otherwise), R04-R07 on the parsed
    body, R08-R14 at admission. A refusal is an `Immediate`: the row's status, its
    OpenAI error envelope and its headers (Retry-After) exactly as `generated/errors.py`
    renders them for the HTTP path, plus `x-request-id`.
  * A grant names the granted engine first, then its fallbacks (core/reroute.py, at most
    gateway.max_fallbacks): `x-gateway-destination-endpoint: ip:port[,ip:port...]` and the
    same value in dynamic metadata `envoy.lb` (the endpoint-picker protocol: header and
    metadata agree; the gateway tries them in order). The body Envoy forwards is the one Narwhal sends an engine itself
    (core/dialects.py decode_body: streamed from the engine, usage asked for, token IDs
    asked of the vllm dialect, T01), so the response can be checked and counted.
  * The response is read with the relay step of the direct path (core/relay.py): token
    IDs checked (T02-T04), stripped unless the client asked (T10), usage chunk stripped
    unless asked; a non-streaming client gets the assembled answer (core/assembly.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

from narwhal_generated import errors as E

from ..core.assembly import Assembler, Failure
from ..core.dialects import DIALECTS, decode_body
from ..core.refusals import render
from ..core.relay import StreamRelay

# E04/E05 in the engine's words as the direct path passes them; a failure after the stream
# began ends it with an error event (never a silent cut)
from ..worker.replies import engine_error_detail, error_event

__all__ = [
    "DESTINATION", "SUBSET", "SUBSET_NAMESPACE", "SERVED", "LB_NAMESPACE", "SERVICE", "Head", "Immediate", "Route", "Mutation", "Piece",
    "route_of", "subset_of", "BodyReader", "refusal", "grant", "ResponseReader", "header",
]

# the endpoint-picker protocol's names (Gateway API inference extension, proposal 004)
DESTINATION = "x-gateway-destination-endpoint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"  # the metadata namespace Envoy sends SUBSET in
LB_NAMESPACE = "envoy.lb"
# the gRPC service Envoy calls, and the name its health is reported under
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"

_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion"}


@dataclass(frozen=True, slots=True)
class Head:
    """Request or response headers as Envoy sent them (names lower-case, pseudo-headers
    included: `:path`, `:method`, `:status`)."""

    headers: tuple[tuple[str, bytes], ...]
    end_of_stream: bool = False


@dataclass(frozen=True, slots=True)
class Immediate:
    """A refusal answered by Envoy on Narwhal's behalf (ImmediateResponse)."""

    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    row: str
    cls: str  # the request's terminal class (the row's counter; "none" off the completion routes)


@dataclass(frozen=True, slots=True)
class Route:
    """A grant: the request headers' answer and the body Envoy forwards to `endpoint`."""

    endpoint: str  # ip:port[,ip:port...] (the value of the header and of the envoy.lb metadata)
    set_headers: tuple[tuple[str, bytes], ...]
    remove_headers: tuple[str, ...]
    body: bytes


@dataclass(frozen=True, slots=True)
class Mutation:
    """Response headers' answer."""

    set_headers: tuple[tuple[str, bytes], ...] = ()
    remove_headers: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Piece:
    """A body chunk's answer: the bytes Envoy passes on (FULL_DUPLEX_STREAMED: `end` once,
    with the last; an empty piece that is not the end need not be sent)."""

    body: bytes
    end: bool


@dataclass(frozen=True, slots=True)
class Ended:
    """How the response ended, for the lease and the books."""

    cls: str  # completed | failed
    row: str | None = None  # the failure row (E02-E04) when failed
    detail: str | None = None
    first_token: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def header(head: Head, name: str) -> bytes | None:
    for k, v in head.headers:
        if k == name:
            return v
    return None


def subset_of(value: str | list[str] | None) -> frozenset[str] | None:
    """Envoy's subset hint (`envoy.lb.subset_hint`, key SUBSET): the endpoints the picker
    may name, as a list or one comma-separated string; None when Envoy sent none."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value
    return frozenset(i.strip() for i in items if i.strip())


def route_of(head: Head) -> str | None:
    """`chat` or `completion` from `:path` (its query ignored), else None (H01)."""
    path = (header(head, ":path") or b"").split(b"?", 1)[0].decode("latin-1")
    return _ROUTES.get(path)


def refusal(row: E.ErrorRow, rid: str, *, param: str | None = None, overrun_s: float | None = None, **fields: object) -> Immediate:
    """A row's answer, as the HTTP path renders it (generated/errors.py), plus the
    request's id."""
    status, headers, body = render(row, param=param, overrun_s=overrun_s, **fields)
    return Immediate(status, (*headers, (b"x-request-id", rid.encode())), body, row.id, row.counter)


class TooLarge(Exception):
    """R03: the body passed serving.max_request_bytes."""


class BodyReader:
    """The request body from its chunks, bounded by `limit` (R03): nothing past the limit
    is kept. A Content-Length over the limit is refused before any chunk."""

    __slots__ = ("limit", "_buf", "done")

    def __init__(self, limit: int, head: Head) -> None:
        self.limit = limit
        self._buf = bytearray()
        self.done = head.end_of_stream
        cl = header(head, "content-length")
        if cl is not None and cl.strip().isdigit() and int(cl) > limit:
            raise TooLarge

    def feed(self, chunk: bytes, end: bool) -> None:
        if len(self._buf) + len(chunk) > self.limit:
            raise TooLarge
        self._buf += chunk
        if end:
            self.done = True

    @property
    def body(self) -> bytes:
        return bytes(self._buf)


def grant(endpoints: tuple[str, ...], body: dict[str, Any], *, dialect: str, model: str | None, rid: str) -> Route:
    """T01/T08: the engine's request body, as the direct path sends it (decode_body), and
    the headers that send Envoy to `endpoints` (the granted engine, then its fallbacks).
    The body's length changed: Content-Length is set anew (Envoy forwards exactly the
    bytes answered). The fallbacks are engines of the same dialect and model (the body is
    theirs too)."""
    out = orjson.dumps(decode_body(body, dialect=dialect, model=model))
    endpoint = ",".join(endpoints)
    headers: list[tuple[str, bytes]] = [(DESTINATION, endpoint.encode()), ("content-length", b"%d" % len(out))]
    if DIALECTS[dialect].propagate_request_id:
        headers.append(("x-request-id", rid.encode()))
    return Route(endpoint, tuple(headers), (), out)


def endpoint_of(url: str) -> str:
    """An engine's `ip:port` from its URL (engines[].url, or discovery's): the value
    Envoy's ORIGINAL_DST cluster connects to (an IP literal; docs/gateway.md)."""
    rest = url.split("://", 1)[-1].split("/", 1)[0]
    rest = rest.rsplit("@", 1)[-1]
    if rest.startswith("["):
        host, _, port = rest[1:].partition("]")
        port = port.lstrip(":")
        return f"[{host}]:{port or ('443' if url.startswith('https') else '80')}"
    host, _, port = rest.partition(":")
    return f"{host}:{port or ('443' if url.startswith('https') else '80')}"


class ResponseReader:
    """The response direction of one granted request: the engine's stream through the
    relay step (core/relay.py) and, for a non-streaming client, the assembler, as the
    direct path reads it (worker/request.py). Every chunk is answered at once with the
    bytes the client gets; a failure after the stream began ends it with an error event
    in the engine's shape, and the rest of the engine's bytes are answered empty."""

    __slots__ = ("relay", "stream", "route", "checks_ids", "prompt_tokens", "status", "ended", "failure", "_rid", "_usage_source", "_extra", "engine", "_error_body", "_max_error")

    def __init__(self, *, route: str, stream: bool, client_ids: bool, client_usage: bool, dialect: str, prompt_tokens: int,
                 exact_prompt: bool, max_event_bytes: int, max_answer_bytes: int, hosts: tuple[str, ...], rid: str,
                 extra_headers: tuple[tuple[str, bytes], ...] = (), engine: str = "") -> None:
        d = DIALECTS[dialect]
        self.checks_ids = d.token_accounting == "token_ids"
        assembler = None if stream else Assembler(route, content_null_when_empty=d.content_null_when_empty, include_token_ids=client_ids and self.checks_ids)
        self.relay = StreamRelay(checks_ids=self.checks_ids, client_ids=client_ids, client_usage=client_usage, assembler=assembler,
                                 normalise_tool_calls="repeated_tool_call_fields" in d.quirks, max_event_bytes=max_event_bytes,
                                 max_answer_bytes=max_answer_bytes, hosts=hosts)
        self.stream = stream
        self.route = route
        self.prompt_tokens = prompt_tokens
        self._usage_source = "prompt_token_ids" if exact_prompt else "estimate"
        self.status: int | None = None
        self.ended: Ended | None = None
        self.failure: tuple[str, str] | None = None
        self._rid = rid
        self._extra = extra_headers  # the response headers admission's facts add (predictive: the projection)
        self.engine = engine  # its name (the one serving: a fallback once the gateway reports it), in E04/E05 words (never its address)
        self._error_body = bytearray()
        self._max_error = max_event_bytes

    def headers(self, head: Head) -> Mutation:
        """The engine's response head. A non-streaming client is answered JSON (its body is
        assembled, so its length is only known at the end: Envoy chunks it)."""
        raw = header(head, ":status")
        self.status = int(raw) if raw is not None and raw.isdigit() else 0
        own = (("x-request-id", self._rid.encode()), *self._extra)
        if self.status != 200:  # E04/E05: the engine's error answer becomes the row's (its body is read first)
            row = self._error_row()
            return Mutation(set_headers=((":status", b"%d" % row.status), ("content-type", b"application/json"), *own), remove_headers=("content-length",))
        if self.stream:
            return Mutation(set_headers=own)
        return Mutation(set_headers=(("content-type", b"application/json"), *own), remove_headers=("content-length",))

    def _error_row(self) -> E.ErrorRow:
        return E.E05 if 0 < (self.status or 0) < 500 else E.E04

    def _engine_error(self, body: bytes, end: bool) -> Piece:
        """E04 (5xx) / E05 (4xx): the engine's error answer, read whole (bounded by
        upstream.max_event_bytes: past it, the words only), answered as the direct path
        answers it: the row's envelope, the engine's message as words only (addresses
        replaced), its param when it looks like a field path."""
        if len(self._error_body) + len(body) <= self._max_error:
            self._error_body += body
        if not end:
            return Piece(b"", False)
        row = self._error_row()
        msg, param = engine_error_detail(self.status or 0, bytes(self._error_body), self.relay.hosts)
        detail = f"engine {self.engine}: {msg}"
        self.ended = Ended("failed", row.id, detail)
        _, _, out = render(row, param=param, detail=detail)
        return Piece(out, True)

    def chunk(self, body: bytes, end: bool, now: float) -> tuple[Piece, bool]:
        """One engine body chunk: (its answer, whether the first token arrived in it)."""
        if self.ended is None and self.status != 200:
            return self._engine_error(body, end), False
        if self.ended is not None:
            return Piece(b"", end), False
        st = self.relay.feed(body, now)
        if st.failure is not None:
            return self._fail(st.out, st.failure, end), st.first_token
        if st.done or end:
            return self._finish(st.out, st.done, end), st.first_token
        return Piece(st.out if self.stream else b"", False), st.first_token

    def _fail(self, out: bytes, failure: tuple[str, str], end: bool) -> Piece:
        """A failure row (E02-E04) found in the engine's stream: the stream's end for the
        client (an error event; non-streaming: the row's envelope as the body)."""
        row = E.ROWS[failure[0]]
        self.failure = failure
        self.ended = Ended("failed", row.id, failure[1])
        if self.stream:
            return Piece(out + error_event(row, detail=failure[1]), end)
        _, _, body = render(row, detail=failure[1])
        return Piece(body, end)

    def _finish(self, out: bytes, done: bool, end: bool) -> Piece:
        relay = self.relay
        if not done:  # the engine's stream ended without [DONE]: E02's truncated stream
            return self._fail(out, ("E02", "the engine's stream ended before [DONE]"), end)
        if relay.engine_error is not None:  # streaming: passed on in the engine's shape (worker/request.py)
            self.ended = Ended("failed", "E04", "error event")
            return Piece(out, end)
        if self.stream:
            self.ended = Ended("completed")
            return Piece(out, end)
        a = relay.assembler
        assert a is not None
        src = "engine" if a.engine_usage else self._usage_source
        res = a.finish(prompt_tokens=self.prompt_tokens, completion_tokens=relay.token_count if self.checks_ids else None)
        if isinstance(res, Failure):
            return self._fail(b"", (res.row, f"{res.detail} ({res.rule})"), end)
        self.ended = Ended("completed", extra={"usage_source": src})
        return Piece(orjson.dumps(res), end)
