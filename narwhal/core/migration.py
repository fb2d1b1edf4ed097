"""A generation carried on by another engine from its validated token IDs (issue 24), sans-IO.

When a decode leg breaks after response headers, what the client has been sent is exactly
the prompt the engine saw followed by the output token IDs the router validated and
relayed (rows T01-T12). Another engine given that sequence as a token-ID prompt, with
`max_tokens` (and `min_tokens`) reduced by what was generated and the same sampling
parameters, continues the same generation: with greedy decoding token for token the
uninterrupted answer; with sampling a valid continuation (the sampler's random state, a
`seed`'s included, is not carried; presence and frequency penalties count the earlier
output as prompt on the new engine).

This module decides *whether* a break may be carried on, builds the continuation's body
(`continuation`), and turns the continuation's stream back into the client's (`Rejoin`).

Decisions: spec/tables/migration.yaml, rows G01-G13, the first row whose reason holds, in
the table's order (a walk over the generated ROWS, like the refusal table's); the row's
`outcome` is what the relay does (`error_event`, or `migrate`). Each reason is one fact:
`obstacle` walks the rows before the continuation is placed, and stops (None) at the
first row whose fact needs the placement (`placement_refused`, `carry_on`); `placed`
walks the rest once admission has answered. The facts:
  * `not_enabled`: upstream.migration.max_attempts is 0 (the default): every existing row
    unchanged.
  * `no_token_ids`: the engine does not account by token IDs: nothing validated to carry.
  * `nothing_left`: the output relayed holds max_tokens tokens already: the stream ends
    as a complete answer (outcome `finish`), nothing is placed.
  * `attempts_spent`: the request has been carried on max_attempts times already.
  * `deadline`: less time is left before the request's deadline (R13) than the new
    engine's projected time to first token: the continuation could not deliver a token.
  * `echo`: a completions request with `echo` or `suffix`: the continuation's prompt is not
    the client's, so neither can be kept.
  * `logprobs`: logprobs were asked: the continuation (a completions request) returns them
    in another shape, and top_logprobs across the cut would come from two engines; not
    carried on in this version.
  * `structured`: tools, a tool choice, a response_format or a guided-decoding field: the
    engine's grammar or parser state at the cut cannot be given to another engine.
  * `not_plain`: the answer so far holds anything but plain content (reasoning, tool-call
    or refusal deltas): the continuation's text would not be parsed alike.
  * `stop_straddles`: the text sent so far ends with a proper prefix of one of the
    request's `stop` strings: the new engine, which checks stop strings on its own text
    only, would miss a stop string that began before the cut.
  * `several_prompts`: a completions request with a batch of prompts: its choices'
    token IDs interleave on the one stream, so no one sequence continues it.
  * `placement_refused`: admission refused the continuation, or the engine it placed it
    on cannot take it (no token IDs, no prompt IDs, nothing left to generate).
  * `carry_on`: placed: carry it on (outcome `migrate`).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from narwhal_generated import migration as G

from .sse import DEFAULT_MAX_EVENT_BYTES, DONE, SSEParser

__all__ = ["REASONS", "MIGRATE", "FINISH", "Progress", "Recorder", "stop_tail", "obstacle", "placed", "continuation", "Rejoin", "STRUCTURED_FIELDS", "DROPPED_FIELDS", "MAX_RECORDED_IDS"]

REASONS = G.REASONS  # the rows' reasons, in their order

# A request holding any of these is never carried on (`structured`).
STRUCTURED_FIELDS = frozenset((
    "tools", "tool_choice", "functions", "function_call", "response_format",
    "guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs", "json_schema", "regex", "ebnf",
))

# Fields of the client's body the continuation does not carry (the rest passes through as
# the pass-through policy says, docs/passthrough.md): the prompt's own fields, which the
# token-ID prompt replaces, chat-only fields a completions request has no use for, and the
# fields the continuation sets itself.
DROPPED_FIELDS = frozenset((
    "messages", "prompt", "max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of",
    "stream", "stream_options", "echo", "suffix", "logprobs", "top_logprobs", "return_token_ids",
    "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
    "documents", "include_reasoning", "reasoning_effort", "parallel_tool_calls", "modalities", "audio",
    "prompt_logprobs", "kv_transfer_params",
)) | STRUCTURED_FIELDS


MAX_RECORDED_IDS = 1 << 20  # output IDs a recorder keeps (8 MiB); past it the stream is not carried on
_NOT_PLAIN = ("reasoning_content", "reasoning", "tool_calls", "function_call", "refusal")


class Recorder:
    """What a continuation needs, kept while the relay reads the stream (only with
    migration on: one call per event, after the event's IDs passed T02-T04):
    the first event's id, created and model (the client's stream identity), the prompt's
    token IDs when the engine returns them (vLLM: `prompt_token_ids` on the first event,
    top level for chat, in the choice for completions), every output ID in order (an
    array of 8-byte integers, bounded by MAX_RECORDED_IDS), the tail of the content text
    (for G09; as long as the longest stop string), and whether anything but plain content
    was seen (G08)."""

    __slots__ = ("output_ids", "prompt_ids", "id", "created", "model", "tail", "tail_len", "plain", "overflow")

    def __init__(self, *, tail_len: int = 0) -> None:
        self.output_ids = array("q")
        self.prompt_ids: list[int] | None = None
        self.id: str | None = None
        self.created: int | None = None
        self.model: str | None = None
        self.tail = ""
        self.tail_len = tail_len
        self.plain = True
        self.overflow = False

    def see(self, obj: dict[str, Any]) -> None:
        if self.id is None:
            i, c, m = obj.get("id"), obj.get("created"), obj.get("model")
            if type(i) is str:
                # the model's name is the same for every stream of an engine: one string for all
                self.id, self.created, self.model = i, c if type(c) is int else 0, sys.intern(m) if type(m) is str else ""
        p = obj.get("prompt_token_ids")
        if p is not None and self.prompt_ids is None and type(p) is list:
            self.prompt_ids = p
        choices = obj.get("choices")
        if type(choices) is not list:
            return
        for c in choices:
            if type(c) is not dict:
                continue
            ids = c.get("token_ids")
            if ids:
                if len(self.output_ids) + len(ids) > MAX_RECORDED_IDS:
                    self.overflow = True
                else:
                    self.output_ids.extend(ids)  # checked by T03 before: nonnegative ints
            pids = c.get("prompt_token_ids")
            if pids is not None and self.prompt_ids is None and type(pids) is list:
                self.prompt_ids = pids
            d = c.get("delta")
            if type(d) is dict:
                if self.plain and any(d.get(k) for k in _NOT_PLAIN):
                    self.plain = False
                t = d.get("content")
            else:
                t = c.get("text")
            if self.tail_len and type(t) is str and t:
                self.tail = (self.tail + t)[-self.tail_len:]

    def valid_prompt(self) -> list[int] | None:
        """The prompt IDs when they are a list of nonnegative integers (the engine's, not
        checked by T03), else None."""
        p = self.prompt_ids
        if p is None or not p or any(type(x) is not int or x < 0 for x in p):
            return None
        return p


def stop_tail(body: dict[str, Any]) -> int:
    """How much of the content's tail G09 needs: the longest stop string, less one."""
    return max((len(s) - 1 for s in _stops(body)), default=0)


@dataclass(frozen=True, slots=True)
class Progress:
    """What the relay knows of a request when its decode leg breaks."""

    output_ids: tuple[int, ...]  # validated and relayed to the client, in order
    text: str  # the content text relayed so far (for `stop_straddles`)
    plain: bool  # only plain content deltas so far (no reasoning, tool calls, refusal)
    attempts: int  # continuations already made for this request
    deadline_left_ms: float | None  # None: no deadline
    max_tokens: int | None = None  # the request's (None: no limit)


def _stops(body: dict[str, Any]) -> list[str]:
    s = body.get("stop")
    if isinstance(s, str):
        return [s] if s else []
    if isinstance(s, list):
        return [x for x in s if isinstance(x, str) and x]
    return []


def straddles(text: str, stops: Iterable[str]) -> bool:
    """Does `text` end with a non-empty proper prefix of one of `stops`?"""
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:k]):
                return True
    return False


class _Break:
    """One broken stream's facts, one method per reason: True (holds), False, or None
    (not known yet: it needs the continuation's placement)."""

    __slots__ = ("route", "body", "p", "max_attempts", "token_ids", "projected_ttft_ms", "ok")

    def __init__(self, route: str, body: dict[str, Any], p: Progress, max_attempts: int, token_ids: bool,
                 projected_ttft_ms: float, ok: bool | None) -> None:
        self.route, self.body, self.p = route, body, p
        self.max_attempts, self.token_ids, self.projected_ttft_ms, self.ok = max_attempts, token_ids, projected_ttft_ms, ok

    def not_enabled(self) -> bool:
        return self.max_attempts <= 0

    def no_token_ids(self) -> bool:
        return not self.token_ids

    def nothing_left(self) -> bool:
        return self.p.max_tokens is not None and len(self.p.output_ids) >= self.p.max_tokens

    def attempts_spent(self) -> bool:
        return self.p.attempts >= self.max_attempts

    def deadline(self) -> bool:
        return self.p.deadline_left_ms is not None and self.p.deadline_left_ms <= self.projected_ttft_ms

    def echo(self) -> bool:
        return self.route == "completion" and (self.body.get("echo") is True or self.body.get("suffix") is not None)

    def logprobs(self) -> bool:
        lp = self.body.get("logprobs")
        return (lp is not None and lp is not False) or self.body.get("top_logprobs") is not None

    def structured(self) -> bool:
        return any(self.body.get(f) is not None for f in STRUCTURED_FIELDS)

    def not_plain(self) -> bool:
        return not self.p.plain

    def stop_straddles(self) -> bool:
        return straddles(self.p.text, _stops(self.body))

    def several_prompts(self) -> bool:
        p = self.body.get("prompt")
        return self.route == "completion" and isinstance(p, list) and len(p) > 1 and not isinstance(p[0], int)

    def placement_refused(self) -> bool | None:
        return None if self.ok is None else not self.ok

    def carry_on(self) -> bool | None:
        return self.ok


def _walk(b: _Break, rows: Sequence[G.MigrationRow]) -> G.MigrationRow | None:
    for row in rows:
        v = getattr(b, row.reason)()
        if v is None:
            return None
        if v:
            return row
    raise AssertionError("no migration row holds: the last row is carry_on")  # pragma: no cover - the table's check


def obstacle(route: str, body: dict[str, Any], p: Progress, *, max_attempts: int, token_ids: bool,
             projected_ttft_ms: float, rows: Sequence[G.MigrationRow] = G.ROWS) -> G.MigrationRow | None:
    """The first row (in the table's order) whose reason holds before the continuation
    is placed: this break is not carried on (its outcome); None: place the continuation,
    then `placed`."""
    return _walk(_Break(route, body, p, max_attempts, token_ids, projected_ttft_ms, None), rows)


def placed(route: str, body: dict[str, Any], p: Progress, *, ok: bool, max_attempts: int, token_ids: bool,
           projected_ttft_ms: float, rows: Sequence[G.MigrationRow] = G.ROWS) -> G.MigrationRow:
    """The walk once admission answered (`ok`: placed, and the engine can take it): the
    first row that holds, in the table's order (G10 placement_refused or G11 carry_on
    as generated)."""
    row = _walk(_Break(route, body, p, max_attempts, token_ids, projected_ttft_ms, ok), rows)
    assert row is not None
    return row


MIGRATE = "migrate"  # the outcome of a row that carries the stream on (spec/tables/migration.yaml)
FINISH = "finish"  # the outcome of a row that ends the stream as a complete answer


def continuation(body: dict[str, Any], *, max_tokens: int | None, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> dict[str, Any]:
    """The body of the continuation: a streaming completions request whose prompt is the
    token IDs the engine saw followed by those it generated, asking for what is left.
    `max_tokens` is the client's (max_completion_tokens or max_tokens; None: the engine's
    default, which then counts from the longer prompt)."""
    k = len(output_ids)
    if max_tokens is not None and k >= max_tokens:
        raise ValueError("nothing left to generate: the answer ends with finish_reason length, no continuation")
    out = {f: v for f, v in body.items() if f not in DROPPED_FIELDS}
    out["prompt"] = [*prompt_ids, *output_ids]
    if max_tokens is not None:
        out["max_tokens"] = max_tokens - k
    mt = body.get("min_tokens")
    if type(mt) is int and mt - k > 0:
        out["min_tokens"] = mt - k
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    out["return_token_ids"] = True
    return out


class Rejoin:
    """The continuation's stream (a completions stream on a token-ID prompt) in the shape
    of the client's original stream, as SSE bytes the request's own StreamRelay reads on
    (so every check of rows T01-T12, the bounds and the assembly go on as before).

    Per event: `id`, `created` and `model` are the original stream's (one `id` for the
    whole answer); a chat client gets `chat.completion.chunk` objects whose choice holds
    `delta.content` (the text) and never a role again; the continuation's
    `prompt_token_ids` are dropped (its prompt is not the client's); usage counts the
    whole answer once: prompt_tokens the original prompt's, completion_tokens those
    generated before the cut plus the continuation's, and prompt_tokens_details.cached_tokens
    the first leg's (None: left out) — what the continuation's engine had cached of the
    longer prompt is the router's business, not the client's. Error events, `[DONE]` and
    events that are not JSON objects pass through unchanged for the relay to judge.
    Bounded like the relay: an event past max_event_bytes stops the parser (`too_large`)."""

    __slots__ = ("_parser", "route", "id", "created", "model", "prompt_tokens", "before", "cached", "too_large")

    def __init__(self, *, route: str, id: str, created: int, model: str, prompt_tokens: int, before: int,
                 cached_tokens: int | None = None, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._parser = SSEParser(max_event_bytes)
        self.route, self.id, self.created, self.model = route, id, created, model
        self.prompt_tokens, self.before, self.cached = prompt_tokens, before, cached_tokens
        self.too_large = False

    def feed(self, raw: bytes) -> bytes:
        out: list[bytes] = []
        for payload in self._parser.feed(raw):
            if payload == DONE:
                out.append(b"data: [DONE]\n\n")
                continue
            try:
                obj = orjson.loads(payload)
            except orjson.JSONDecodeError:
                obj = None
            if type(obj) is not dict or obj.get("error") is not None:
                out.append(b"data: " + payload + b"\n\n")
                continue
            out.append(b"data: " + orjson.dumps(self.event(obj)) + b"\n\n")
        self.too_large = self._parser.too_large
        return b"".join(out)

    def event(self, obj: dict[str, Any]) -> dict[str, Any]:
        """One continuation event in the client's shape."""
        ev: dict[str, Any] = {"id": self.id, "object": "chat.completion.chunk" if self.route == "chat" else "text_completion",
                              "created": self.created, "model": self.model}
        choices = obj.get("choices")
        if type(choices) is list:
            ev["choices"] = [self._choice(c) if type(c) is dict else c for c in choices]
        else:
            ev["choices"] = choices
        usage = obj.get("usage")
        if type(usage) is dict:
            ev["usage"] = self._usage(usage)
        elif "usage" in obj:
            ev["usage"] = usage
        return ev

    def _choice(self, c: dict[str, Any]) -> dict[str, Any]:
        if self.route != "chat":
            out = {k: v for k, v in c.items() if k != "prompt_token_ids"}
            return out
        text = c.get("text")
        delta: dict[str, Any] = {"content": text} if type(text) is str and text else {}
        out = {"index": c.get("index", 0), "delta": delta, "logprobs": None, "finish_reason": c.get("finish_reason")}
        if "stop_reason" in c:
            out["stop_reason"] = c["stop_reason"]
        if "token_ids" in c:
            out["token_ids"] = c["token_ids"]
        return out

    def _usage(self, u: dict[str, Any]) -> dict[str, Any]:
        ct = u.get("completion_tokens")
        total = self.before + ct if type(ct) is int else None
        out: dict[str, Any] = {"prompt_tokens": self.prompt_tokens, "completion_tokens": total,
                               "total_tokens": None if total is None else self.prompt_tokens + total}
        if self.cached is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached}
        return out
