"""The relay step, sans-IO: engine stream bytes in, client bytes (or an assembly) out.

Per engine event, exactly once: parse (orjson), check token IDs (T02-T04, engines with
token_ids accounting), then either
  * streaming client: forward in the engine's shape. The payload bytes go out unchanged
    unless the router must strip what it asked for itself (T10: token IDs the client did
    not ask for; the usage-only chunk when the client did not ask for usage);
  * non-streaming client: normalise the dialect's quirks (D01) and feed the assembler.
Nothing is validated through models on this path.

Engine output is bounded: an event (or an unfinished line) longer than
`max_event_bytes` (upstream.max_event_bytes) fails the attempt as E02, after the events
completed before it; for a non-streaming client, the engine events the answer is
assembled from are bounded in all by `max_answer_bytes` (upstream.max_answer_bytes):
past it, E02 (a streaming client needs no such bound: what it has not read stays in
bounded buffers and the engine waits).

Failure words are for clients: they name no engine-supplied value (not an ID, not a field
name the engine made up, not its bytes). What the log needs besides is kept in
`failure_detail`. An engine's own error message, which E04 and E05 pass on, goes through
`engine_message`: a JSON string only, shortened, with addresses replaced.

Outcomes a caller acts on (`Step`): bytes to write, whether the first token arrived (the
moment response headers may go out), end of stream, a failure (row ID + detail), or an
engine error event (streaming: already forwarded in the engine's shape).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from functools import partial
from typing import Any, NamedTuple

import orjson

from narwhal_generated import errors as E

from .assembly import Assembler, Failure
from .dialects import ToolCallNormaliser
from .fastevent import event as _native
from .prediction import TokenArrivals
from .sse import DEFAULT_MAX_EVENT_BYTES, DONE, SSEParser
from .tokens import carries_output, token_id_failure

__all__ = ["StreamRelay", "Step", "engine_message", "DEFAULT_MAX_ANSWER_BYTES"]

DEFAULT_MAX_ANSWER_BYTES = 64 << 20  # the default of upstream.max_answer_bytes
MAX_ENGINE_MESSAGE = 1000  # characters of an engine's own error message passed on

# Addresses in an engine's own words: URLs, IPv4 (with a port), IPv6 (bracketed, or bare
# with "::" or five colons), localhost. Engines name their peers in errors (a KV
# connector that cannot reach its prefill engine); clients must not learn the fleet.
_ADDRESS = re.compile(
    r"[A-Za-z][A-Za-z0-9+.-]*://[^\s\"'<>]*"
    r"|\[[0-9A-Fa-f:.%\w]*:[0-9A-Fa-f:.%\w]*\](?::\d+)?"
    r"|(?<![\w.])(?:\d{1,3}\.){3}\d{1,3}(?::\d+)?(?![\w.])"
    r"|(?<![\w:.])(?=[0-9A-Fa-f:]*::|(?:[0-9A-Fa-f]*:){5})[0-9A-Fa-f:]{2,}(?:%\w+)?(?![\w:])"
    r"|\blocalhost(?::\d+)?\b",
    re.IGNORECASE,
)


def engine_message(value: Any, *, hosts: Iterable[str] = ()) -> str | None:
    """An engine's own error message as a client may read it (rows E04, E05), or None when
    `value` is not a non-empty string (an object, a list: engine data, not words).
    Shortened to MAX_ENGINE_MESSAGE characters at a word's end; addresses, and the names
    in `hosts` (the fleet's host names), replaced by `<address>`."""
    if type(value) is not str or not value.strip():
        return None
    text = value
    if len(text) > MAX_ENGINE_MESSAGE:
        # cut at a word's end: half an address would escape the patterns below
        head = text[:MAX_ENGINE_MESSAGE]
        cut = head.rsplit(None, 1)[0] if not text[MAX_ENGINE_MESSAGE].isspace() and any(c.isspace() for c in head) else head
        text = cut.rstrip() + " ..."
    for h in hosts:
        # a whole word; a single-label name ("decode", "vllm") only with its port, as
        # the same word is likely to mean something else in the message
        if h:
            port = r"(?::\d+)?" if "." in h else r":\d+"
            text = re.sub(r"(?<![\w.-])" + re.escape(h) + port + r"(?![\w-])", "<address>", text, flags=re.IGNORECASE)
    return _ADDRESS.sub("<address>", text)


def _event_error_words(err: Any, hosts: tuple[str, ...]) -> str:
    """The words of a non-streaming engine error event (E04)."""
    msg = engine_message(err.get("message") if type(err) is dict else err, hosts=hosts)
    return msg if msg is not None else "an error event without a message"


def _show(payload: bytes) -> str:
    """The start of an engine payload, for the log."""
    return repr(payload[:200]) + (" ..." if len(payload) > 200 else "")


_DATA = b"data: "
_END = b"\n\n"
_DONE_EVENT = b"data: [DONE]\n\n"


class Step(NamedTuple):
    """One feed's outcome (a named tuple: made once per engine read, so it stays cheap)."""

    out: bytes
    first_token: bool
    done: bool
    failure: tuple[str, str] | None  # (failure row ID, detail)
    engine_error: dict[str, Any] | None


def _strip_ids(obj: dict[str, Any]) -> bool:
    """T10: the IDs the router asked for itself never reach a client that did not ask.
    True when something was removed."""
    hit = obj.pop("prompt_token_ids", _NONE) is not _NONE
    for c in obj.get("choices") or ():
        if type(c) is dict:
            hit = c.pop("token_ids", _NONE) is not _NONE or hit
            hit = c.pop("prompt_token_ids", _NONE) is not _NONE or hit
    return hit


_NONE = object()
# a Step made without NamedTuple's Python-level __new__ (once per engine read: ~160 -> ~85 ns)
_step = partial(tuple.__new__, Step)


class StreamRelay:
    __slots__ = (
        "_parser", "checks_ids", "client_ids", "client_usage", "assembler", "_normalise",
        "started", "done", "token_count", "arrivals", "finish_reason", "usage", "engine_error", "events",
        "prompt_tokens_override", "max_answer_bytes", "answer_bytes", "failure_detail", "hosts", "recorder",
    )

    def __init__(
        self,
        *,
        checks_ids: bool,
        client_ids: bool,
        client_usage: bool,
        assembler: Assembler | None = None,
        normalise_tool_calls: bool = False,
        prompt_tokens_override: int | None = None,
        max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        hosts: tuple[str, ...] = (),
    ) -> None:
        self._parser = SSEParser(max_event_bytes)
        self.checks_ids = checks_ids
        self.client_ids = client_ids
        self.client_usage = client_usage
        self.assembler = assembler
        self._normalise = ToolCallNormaliser() if normalise_tool_calls else None
        self.started = False  # the first token (or any output) has arrived
        self.done = False
        self.token_count = 0
        self.arrivals = TokenArrivals()
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.engine_error: dict[str, Any] | None = None
        self.events = 0
        # P/D: usage reported to the client takes input counts from prefill
        self.prompt_tokens_override = prompt_tokens_override
        # non-streaming: the bytes of the engine events assembled so far, and their bound
        self.max_answer_bytes = max_answer_bytes
        self.answer_bytes = 0
        # a failure's detail for the log (engine values included); the Step's words are
        # for clients
        self.failure_detail: str | None = None
        self.hosts = hosts  # the fleet's host names, replaced in engine messages (E04)
        # stream migration (core/migration.py): sees every event whose IDs passed the checks
        self.recorder: Any = None

    def feed(self, raw: bytes, now: float) -> Step:
        """Every complete engine event in `raw`, in order, exactly once: parse, check token
        IDs (T02-T04), keep the books (tokens, arrivals, finish reason, usage), then forward
        (streaming) or assemble (non-streaming). The first failure ends the read with the
        bytes of the events before it. The common event (streaming, no error, nothing to
        rewrite) stays inline here: the rarer branches are the named steps below."""
        out: list[bytes] = []
        first = False
        for payload in self._parser.feed(raw):
            if self.done:
                break
            if payload == DONE:
                self.done = True
                if self.assembler is None:
                    out.append(_DONE_EVENT)
                break
            self.events += 1
            if self.assembler is not None:
                self.answer_bytes += len(payload)
                if self.answer_bytes > self.max_answer_bytes:
                    return self._answer_too_large(first)
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                return self._fail(out, first, E.E02.id, "an engine event is not JSON", _show(payload))
            if type(obj) is not dict:
                return self._fail(out, first, E.E02.id, "an engine event is not a JSON object", _show(payload))
            err = obj.get("error")
            if err is not None:
                failed = self._error_event(obj, err, payload, out, first)
                if failed is None:
                    continue
                return failed
            if self.checks_ids:
                k, bad = token_id_failure(obj)
                if bad is not None:
                    return self._fail(out, first, E.E03.id, bad.words, bad.detail)
                if k:
                    self.token_count += k
                    self.arrivals.add(now, k)
                    if not self.started:
                        self.started = first = True
                if self.recorder is not None:
                    self.recorder.see(obj)
            choices = obj.get("choices")
            usage = obj.get("usage")
            if usage is not None:
                self.usage = usage
            if choices:
                for c in choices:
                    if type(c) is dict:
                        fr = c.get("finish_reason")
                        if fr is not None:
                            self.finish_reason = fr
                        if not self.checks_ids and carries_output(c):
                            # no IDs (T08): one output event stands for one token
                            self.token_count += 1
                            self.arrivals.add(now, 1)
                            if not self.started:
                                self.started = first = True
            if self.assembler is not None:
                failed = self._assemble(obj, first)
                if failed is None:
                    continue
                return failed
            if not choices and usage is not None and not self.client_usage:
                continue  # the usage chunk the router asked for itself
            rewrite = self.prompt_tokens_override is not None and self._override_prompt_tokens(usage)
            if self.checks_ids and not self.client_ids and _strip_ids(obj):
                rewrite = True
            if rewrite:
                out.append(b"data: %b\n\n" % orjson.dumps(obj))
            else:
                out.append(b"data: %b\n\n" % payload)
        if self._parser.too_large and not self.done:
            detail = f"an event or line longer than upstream.max_event_bytes ({self._parser.max_event_bytes} bytes)"
            return Step(b"".join(out), first, False, (E.E02.id, detail), None)
        return _step((out[0] if len(out) == 1 else b"".join(out), first, self.done, None, None))

    def _fail(
        self, out: list[bytes], first: bool, row: str, words: str, detail: str | None, engine_error: dict[str, Any] | None = None
    ) -> Step:
        """A failed read: the bytes of the events before the failure still go out; `words`
        are for the client, `detail` (engine values included) for the log only."""
        self.failure_detail = detail
        return Step(b"".join(out), first, False, (row, words), engine_error)

    def _answer_too_large(self, first: bool) -> Step:
        """E02 for a non-streaming client: the engine events assembled so far outgrew
        upstream.max_answer_bytes (nothing was written: the answer is whole or nothing)."""
        self.failure_detail = f"{self.events} events, {self.answer_bytes} bytes"
        detail = f"the answer grew past upstream.max_answer_bytes ({self.max_answer_bytes} bytes)"
        return Step(b"", first, False, (E.E02.id, detail), None)

    def _error_event(self, obj: dict[str, Any], err: Any, payload: bytes, out: list[bytes], first: bool) -> Step | None:
        """An engine error event (E04). With migration on (a streaming client and a
        recorder), the caller decides: carry on, or pass this event on; the relay may read on
        a continuation, so it keeps no engine_error of its own. A streaming client otherwise
        gets the event in the engine's own shape (None: read on); a non-streaming one, E04."""
        if self.assembler is None and self.recorder is not None:
            return self._fail(out, first, E.E04.id, _event_error_words(err, self.hosts), _show(payload), obj)
        self.engine_error = obj
        if self.assembler is None:
            out.append(_DATA + payload + _END)  # the engine's own shape
            return None
        return self._fail(out, first, E.E04.id, _event_error_words(err, self.hosts), _show(payload), obj)

    def _assemble(self, obj: dict[str, Any], first: bool) -> Step | None:
        """Non-streaming: the event, its dialect's quirks normalised (D01), into the
        assembler; None while it takes it, else the assembler's failure as a Step."""
        if self._normalise is not None:
            self._normalise(obj)
        f = self.assembler.feed(obj)  # type: ignore[union-attr]  # the caller checked
        if isinstance(f, Failure):
            self.failure_detail = f.log_detail or None
            return Step(b"", first, False, (f.row, f"{f.detail} ({f.rule})"), None)
        return None

    def _override_prompt_tokens(self, usage: Any) -> bool:
        """P/D: the usage a client reads takes its input count from prefill. True when the
        event's usage was rewritten."""
        if type(usage) is not dict:
            return False
        ct = usage.get("completion_tokens")
        usage["prompt_tokens"] = self.prompt_tokens_override
        if type(ct) is int:
            usage["total_tokens"] = self.prompt_tokens_override + ct  # type: ignore[operator]  # checked by the caller
        return True

    @property
    def native(self) -> bool:
        """The compiled step (core/fastevent.py) may answer for this stream's common reads:
        it was built, IDs are checked, and nothing but `feed` handles every event (no
        assembly, no tool-call normalising, no record for migration)."""
        return _native is not None and self.checks_ids and self.assembler is None and self._normalise is None and self.recorder is None

    def whole(self, data: bytes) -> tuple[bytes, int] | None:
        """The compiled step's answer for `data`, one engine read taken at a chunk boundary
        of an HTTP/1.1 chunked body: (the client's bytes framed as one chunk, IDs counted),
        exactly what `feed` of the chunk's payload would give, or None (feed it). Changes
        nothing: `count` does, once its bytes are out. Only once the stream has started and
        the parser holds nothing (the step reads whole events only)."""
        p = self._parser
        if not self.started or self.done or p._buf is not None or p._data is not None or p._skip_lf or p.too_large:
            return None
        return _native(data, self.client_ids, p.max_event_bytes)  # type: ignore[misc]  # native: checked by the caller

    def count(self, now: float, k: int) -> None:
        """The books of an event `whole` answered for, as `feed` keeps them."""
        self.events += 1
        self.token_count += k
        self.arrivals.add(now, k)

    @property
    def pending(self) -> bool:
        return self._parser.pending

