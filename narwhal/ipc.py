"""The channel between the admission authority and its data-plane workers
(`serving.workers` > 1): the seam of narwhal/core/lease.py carried over a Unix socket.

Framing: a 4-byte big-endian length, then one orjson array `[tag, field, ...]` with the
fields of one message below in declaration order. A frame over MAX_FRAME_BYTES, a tag
not in MESSAGES or the wrong number of fields is a protocol error: the channel is closed
(both ends are the same version of this file; the authority restarts a worker whose
channel breaks).

A request makes a few messages, never one per token: Arrive/Arrived (R01, R02, offered),
Admit/Admitted (R08-R11, R14), when queued a Granted or Refused later, FirstToken,
Close and End; P/D adds PrefillDone and WantDecode/Granted, a retry Retry/Granted. The
worker sends Admit behind Arrive without waiting for Arrived (usually in the same write),
so arrival and admission cost one round trip; the authority ignores the Admit (and the
End) of an arrival it refused.
`rid` numbers a worker's requests (the authority keys them by worker too); `at` is the
worker's reading of the system-wide monotonic clock.

Writes are coalesced: the answers to one read leave in one write when the read is
handled; any other message sent in one turn of the event loop leaves in one write when
the turn ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import orjson

from narwhal_generated import errors as E

from .core.tickets import Refuse

__all__ = ["Message", "message", "MESSAGES", "MAX_FRAME_BYTES", "ProtocolError", "encode", "decode", "Channel",
           "Hello", "Up", "Arrive", "Arrived", "Admit", "Admitted", "Granted", "Refused", "NoRetry",
           "WantDecode", "Retry", "PrefillDone", "FirstToken", "Close", "End", "Call", "Answer", "Scrape", "Families", "Facts", "Penalise", "Reconfigure"]

MAX_FRAME_BYTES = 32 << 20  # the largest answer: /metrics or /v1/engines of a large fleet


class ProtocolError(Exception):
    pass


class Message:
    """A message of the channel: a frozen dataclass made by `message(tag)`."""

    __slots__ = ()
    TAG: ClassVar[int] = 0


MESSAGES: dict[int, type[Any]] = {}  # tag -> message class
_M = TypeVar("_M", bound=type[Message])

# Fields that carry the refusal table's rows travel by ID and come back as the generated
# constants (narwhal_generated.errors): a row is never a bare string on either side.
_Codec = tuple[Callable[[Any], Any], Callable[[Any], Any]]


def _refusal_out(r: Refuse | None) -> list[Any] | None:
    return None if r is None else [r.row.id, r.overrun_s, r.fields, r.param]


def _refusal_in(v: list[Any] | None) -> Refuse | None:
    return None if v is None else Refuse(E.ROWS[v[0]], v[1], v[2], v[3])


def _row_out(r: E.ErrorRow | None) -> str | None:
    return None if r is None else r.id


def _row_in(v: str | None) -> E.ErrorRow | None:
    return None if v is None else E.ROWS[v]


_CODECS: dict[str, _Codec] = {
    "E.ErrorRow": (_row_out, _row_in),
    "E.ErrorRow | None": (_row_out, _row_in),
    "Refuse": (_refusal_out, _refusal_in),
    "Refuse | None": (_refusal_out, _refusal_in),
    "tuple[Refuse, ...]": (lambda rs: [_refusal_out(r) for r in rs], lambda vs: tuple(_refusal_in(v) for v in vs)),
}
_TYPED: dict[type[Any], tuple[tuple[int, _Codec], ...]] = {}  # class -> (field index, codec) of its typed fields


def message(tag: int) -> Callable[[_M], _M]:
    """Make a class a message numbered `tag` (unique): frozen, slotted, registered for
    `decode`, its fields in declaration order on the wire, typed fields by their codec."""

    def make(cls: _M) -> _M:
        if tag in MESSAGES:
            raise ValueError(f"message tag {tag} is taken by {MESSAGES[tag].__name__}")
        made = dataclass(frozen=True, slots=True)(cls)
        made.TAG = tag
        MESSAGES[tag] = made
        _TYPED[made] = tuple((i, _CODECS[f.type]) for i, f in enumerate(fields(made)) if f.type in _CODECS)  # type: ignore[index]
        return made

    return make


# -- authority -> worker ------------------------------------------------------------------


@message(1)
class Hello(Message):
    """The first message to a new worker: who it is and what it serves."""

    worker: int
    config: dict[str, Any]  # the validated configuration, as JSON
    engines: list[dict[str, Any]]  # EngineSpec.as_dict()


@message(2)
class Arrived(Message):
    rid: int
    refused: Refuse | None  # None: offered and held; else the arrival's row (the books are closed)


@message(3)
class Admitted(Message):
    rid: int
    prompt_tokens: int
    projected_ttft_ms: float | None
    expected_cached: float
    engine: str | None  # the grant, when dispatched at once; None: queued (Granted or Refused follows)
    phase: str | None


@message(4)
class Granted(Message):
    rid: int
    engine: str
    phase: str


@message(5)
class Refused(Message):
    rid: int
    refused: Refuse


@message(6)
class NoRetry(Message):
    """Retry: no other engine to try (T05)."""

    rid: int


@message(7)
class Answer(Message):
    qid: int
    value: Any
    error: str | None


@message(8)
class Scrape(Message):
    """The worker's metric families, for a /metrics answer (Families)."""

    qid: int


@message(9)
class Facts(Message):
    """How an engine's prompts are counted (upstream/usage.py PromptCounter.facts)."""

    engine: str
    facts: list[Any]


@message(10)
class Reconfigure(Message):
    """A configuration reload changed the running configuration (authority/reconfig.py):
    the worker's data plane takes it whole."""

    config: dict[str, Any]  # the validated configuration, as JSON


# -- worker -> authority ------------------------------------------------------------------


@message(20)
class Up(Message):
    """The worker serves (its app is built; the shared socket is its to accept on)."""

    worker: int
    pid: int


@message(21)
class Arrive(Message):
    rid: int
    at: float
    denied: Refuse | None = None  # the data plane's R15/R16 on the request head (core/lease.py Door.arrive)
    tenant: str | None = None  # who the request acts for (auth), for R17/R18


@message(22)
class Admit(Message):
    rid: int
    route: str
    prompt_bytes: int
    exact_prompt_tokens: int | None
    max_tokens: int | None
    budget_ms: float
    arrival: float
    deadline_s: float | None
    prefix: list[int]
    token_prefix: list[int]
    tenant: str | None = None  # auth: core/lease.py Order.tenant
    key_id: str | None = None
    body: tuple[Refuse, ...] = ()  # the body rows that hold (core/lease.py Entry.admit); then no Order: its fields are unset
    ordered: bool = True  # False: the body could not be parsed (no Order)


@message(23)
class WantDecode(Message):
    rid: int


@message(24)
class Retry(Message):
    rid: int
    engine: str
    row: E.ErrorRow
    phase: str
    at: float


@message(25)
class PrefillDone(Message):
    rid: int
    at: float
    ok: bool


@message(26)
class FirstToken(Message):
    rid: int
    at: float
    movable: bool = False  # its decode leg can be carried on (core/preempt.py)


@message(27)
class Close(Message):
    """The lease's Outcome (narwhal/core/lease.py), field for field."""

    rid: int
    at: float
    ok_engine: str | None
    failed_engine: str | None
    failed_row: E.ErrorRow | None
    tpot_s: float | None
    tpot_engine: str | None
    output_tokens: int | None
    finish_reason: str | None
    reported_prompt_tokens: int | None
    cached_tokens: int | None


@message(28)
class End(Message):
    rid: int
    cls: str


@message(29)
class Call(Message):
    """One of the authority's operations or read models (core/lease.py Controls)."""

    qid: int
    op: str
    args: list[Any]


@message(30)
class Families(Message):
    qid: int
    families: list[Any]


@message(31)
class Penalise(Message):
    """A client address calmed by one worker (hyper.py defect 8): the authority passes it
    to every other worker, so its reconnects are refused whichever worker accepts them."""

    addr: str
    seconds: float


_NAMES: dict[type[Any], tuple[str, ...]] = {c: tuple(f.name for f in fields(c)) for c in MESSAGES.values()}
_ARITY: dict[int, int] = {t: len(_NAMES[c]) for t, c in MESSAGES.items()}
_LEN = 4


def encode(msg: Any) -> bytes:
    """One frame: length, then [tag, fields...]."""
    vals = [msg.TAG, *[getattr(msg, n) for n in _NAMES[type(msg)]]]
    for i, (out, _) in _TYPED[type(msg)]:
        vals[i + 1] = out(vals[i + 1])
    body = orjson.dumps(vals)
    if len(body) > MAX_FRAME_BYTES:
        raise ProtocolError(f"a {type(msg).__name__} message of {len(body)} bytes is over {MAX_FRAME_BYTES}")
    return len(body).to_bytes(_LEN, "big") + body


def decode(body: bytes | bytearray) -> Any:
    """One frame's body (without its length) -> its message."""
    try:
        arr = orjson.loads(body)
    except orjson.JSONDecodeError as x:
        raise ProtocolError(f"a frame that is not JSON: {x}") from None
    if not isinstance(arr, list) or not arr or type(arr[0]) is not int:
        raise ProtocolError("a frame that is not [tag, fields...]")
    tag = arr[0]
    cls = MESSAGES.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown message tag {tag}")
    if len(arr) - 1 != _ARITY[tag]:
        raise ProtocolError(f"{cls.__name__} with {len(arr) - 1} fields, not {_ARITY[tag]}")
    vals = arr[1:]
    try:
        for i, (_, back) in _TYPED[cls]:
            vals[i] = back(vals[i])
    except (KeyError, IndexError, TypeError) as x:
        raise ProtocolError(f"{cls.__name__} with a field that is not what it carries: {x!r}") from None
    return cls(*vals)


class Channel(asyncio.Protocol):
    """One end of a channel over a connected stream socket. `on_message(msg)` runs for
    each message in order; `on_lost(exc)` once, when the channel closes (EOF, an error, a
    protocol error)."""

    def __init__(self, on_message: Callable[[Any], None], on_lost: Callable[[BaseException | None], None]) -> None:
        self.on_message = on_message
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._out: list[bytes] = []
        self._flush_scheduled = False
        self._reading = False  # inside data_received: its answers leave when the read is done
        self.closed = False
        self.sent = 0  # messages, for the benchmark and the tests
        self.received = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos = 0
        n = len(buf)
        self._reading = True
        try:
            while n - pos >= _LEN:
                size = int.from_bytes(buf[pos:pos + _LEN], "big")
                if size > MAX_FRAME_BYTES:
                    raise ProtocolError(f"a frame of {size} bytes is over {MAX_FRAME_BYTES}")
                end = pos + _LEN + size
                if end > n:
                    break
                msg = decode(buf[pos + _LEN:end])
                pos = end
                self.received += 1
                self.on_message(msg)
        except ProtocolError as x:
            self._fail(x)
            return
        finally:
            self._reading = False
            if pos:
                del buf[:pos]
        # what the handlers answered leaves now, in one write, not a loop turn later
        if self._out:
            self._flush()

    def send(self, msg: Any) -> None:
        if self.closed:
            raise ConnectionResetError("the channel is closed")
        self._out.append(encode(msg))
        self.sent += 1
        if not self._flush_scheduled and not self._reading:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def send_now(self, msg: Any) -> None:
        """send, and write what is pending at once: a call whose caller now waits for the
        answer (nothing else of this turn would join it in time to matter)."""
        self.send(msg)
        if not self._reading:
            self._flush()

    def _flush(self) -> None:
        self._flush_scheduled = False
        if self._out and self.transport is not None and not self.closed:
            out = self._out
            self._out = []
            self.transport.write(out[0] if len(out) == 1 else b"".join(out))

    def _fail(self, exc: BaseException) -> None:
        if self.transport is not None:
            self.transport.abort()
        self.connection_lost(exc)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        self.closed = True
        self.on_lost(exc)

    def close(self) -> None:
        self._flush()
        if self.transport is not None:
            self.transport.close()
