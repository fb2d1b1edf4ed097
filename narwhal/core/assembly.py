"""Non-streaming assembly (spec/tables/assembly.yaml): engine stream -> one final response.

Rules
  * Each concat/extend row names the fields it joins; this module reads those lists
    from generated/assembly.py and never restates them.
  * The assembler follows the table literally. Engine quirks are normalised before it
    (narwhal/core/dialects.py, rows D..).
  * A row that refuses (A10, A12, A13) makes `feed` or `finish` return a `Failure`
    naming the failure row (E01 or E02); nothing is raised. Its `detail` is words a
    client may read: it names fields of the assembly table, never a name or value the
    engine supplied (an unknown field's name goes to `log_detail`, for the log).
Theory of operation: `feed(chunk)` per parsed engine event, in stream order; then
`finish(...)` builds the response. Per-choice state is kept by stream index; choices are
returned in index order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal_generated import assembly as T
from narwhal_generated import errors as E

__all__ = ["Assembler", "Failure"]

# A01-A04: chat delta string fields that concatenate under the same name.
_CHAT_CONCAT: tuple[str, ...] = T.A01.fields + T.A02.fields + T.A03.fields + T.A04.fields
_FUNCTION_CALL_PARTS: tuple[str, ...] = T.A06.fields  # A06
_CHAT_LOGPROB_ARRAYS: tuple[str, ...] = T.A07.fields  # A07
_COMPLETION_LOGPROB_ARRAYS: tuple[str, ...] = T.A08.fields  # A08
_COMPLETION_CONCAT: tuple[str, ...] = T.A09.fields  # A09
_UNSUPPORTED: tuple[str, ...] = T.A12.fields  # A12
_METADATA: tuple[str, ...] = T.A14.fields  # A14
_STOP_FIELDS: tuple[str, ...] = T.A17.fields  # A17
_ID_FIELDS: tuple[str, ...] = T.A22.fields  # A22

# Fields of a streamed choice and of a chat delta the assembler represents. Any other
# field that carries a value is unsupported (A12 -> E01).
_CHAT_DELTA_KEYS = frozenset(("role", "tool_calls", "function_call", *_CHAT_CONCAT))
_CHOICE_KEYS = frozenset(
    ("index", "delta", "logprobs", "finish_reason", *_STOP_FIELDS, *_ID_FIELDS, *_COMPLETION_CONCAT)
)


@dataclass(frozen=True, slots=True)
class Failure:
    """An assembly refusal: `row` is the failure row (E01/E02), `rule` the assembly row."""

    row: str
    rule: str
    detail: str
    log_detail: str = ""  # engine-supplied names for the log (shortened), when any


def _unsupported(where: str, k: Any) -> Failure:
    """A12: a field that carries a value the assembler cannot represent. A field the
    table names (audio, annotations, ...) is named; any other name is the engine's own
    and goes to the log only."""
    if k in _UNSUPPORTED:
        return Failure(E.E01.id, T.A12.id, f"{where} field {k!r}")
    return Failure(E.E01.id, T.A12.id, f"a {where} field the assembly table does not name", f"{where} field {str(k)[:80]!r}")


def _has_value(v: Any) -> bool:
    # A12 note: null, absent, an empty list and an empty object carry no value.
    return v is not None and v != [] and v != {} and v != ""


class _Choice:
    __slots__ = (
        "index", "role", "parts", "seen", "tool_calls", "function_call", "logprobs",
        "finish_reason", "stops", "token_ids", "prompt_token_ids",
    )

    def __init__(self, index: int) -> None:
        self.index = index
        self.role: str | None = None
        self.parts: dict[str, list[str]] = {}
        self.seen: set[str] = set()  # concat fields that appeared at all (even empty)
        self.tool_calls: dict[int, dict[str, Any]] = {}
        self.function_call: dict[str, list[str]] | None = None
        self.logprobs: dict[str, list[Any]] | None = None
        self.finish_reason: str | None = None
        self.stops: dict[str, Any] = {}
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] | None = None


class Assembler:
    """Builds one chat.completion or text_completion from a stream of parsed chunks."""

    __slots__ = ("route", "content_null_when_empty", "include_token_ids", "_meta", "_choices",
                 "_usage", "_prompt_ids", "_events_with_output")

    def __init__(self, route: str, *, content_null_when_empty: bool = True, include_token_ids: bool = False) -> None:
        if route not in ("chat", "completion"):
            raise ValueError(route)
        self.route = route
        self.content_null_when_empty = content_null_when_empty
        self.include_token_ids = include_token_ids
        self._meta: dict[str, Any] = {}
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._prompt_ids: list[int] | None = None
        self._events_with_output = 0

    # -- feeding ---------------------------------------------------------------------

    def feed(self, chunk: Any) -> Failure | None:
        if type(chunk) is not dict:
            return Failure(E.E02.id, T.A13.id, "an engine event is not a JSON object")
        for k in _METADATA:  # A14: first non-null wins
            if k not in self._meta:
                v = chunk.get(k)
                if v is not None:
                    self._meta[k] = v
        usage = chunk.get("usage")
        if usage is not None:  # A15, D03: null and absent alike; last non-null wins
            if type(usage) is not dict:
                return Failure(E.E02.id, T.A13.id, "usage is not an object")
            self._usage = usage
        pids = chunk.get("prompt_token_ids")
        if pids is not None and self._prompt_ids is None:
            if type(pids) is not list:
                return Failure(E.E02.id, T.A13.id, "prompt_token_ids is not a list")
            self._prompt_ids = pids
        choices = chunk.get("choices")
        if choices is None:
            return None
        if type(choices) is not list:
            return Failure(E.E02.id, T.A13.id, "choices is not a list")
        for c in choices:  # A19: a usage-only frame (choices: []) touches no choice
            f = self._feed_choice(c)
            if f is not None:
                return f
        return None

    def _choice(self, c: dict[str, Any]) -> _Choice | Failure:
        idx = c.get("index", 0)
        if type(idx) is not int:
            return Failure(E.E02.id, T.A13.id, "choice index is not an integer")
        ch = self._choices.get(idx)
        if ch is None:
            ch = self._choices[idx] = _Choice(idx)
        return ch

    def _feed_choice(self, c: Any) -> Failure | None:
        if type(c) is not dict:
            return Failure(E.E02.id, T.A13.id, "a choice is not an object")
        ch = self._choice(c)
        if isinstance(ch, Failure):
            return ch
        for k, v in c.items():
            if k not in _CHOICE_KEYS and _has_value(v):
                return _unsupported("choice", k)
        for k in _UNSUPPORTED:  # A12: audio/annotations on the choice itself
            if _has_value(c.get(k)):
                return _unsupported("choice", k)
        output = False
        if self.route == "chat":
            delta = c.get("delta")
            if delta is not None:
                if type(delta) is not dict:
                    return Failure(E.E02.id, T.A13.id, "delta is not an object")
                f = self._feed_delta(ch, delta)
                if isinstance(f, Failure):
                    return f
                output = f
        else:
            for k in _COMPLETION_CONCAT:  # A09
                v = c.get(k)
                if v is None:
                    continue
                if type(v) is not str:
                    return Failure(E.E02.id, T.A13.id, f"choice {k} is not a string")
                ch.seen.add(k)
                if v:
                    ch.parts.setdefault(k, []).append(v)
                    output = True
        if output:
            self._events_with_output += 1
        lp = c.get("logprobs")
        if lp is not None:
            f2 = self._feed_logprobs(ch, lp)
            if f2 is not None:
                return f2
        fr = c.get("finish_reason")
        if fr is not None:  # A16: last non-null wins
            if type(fr) is not str:
                return Failure(E.E02.id, T.A13.id, "finish_reason is not a string")
            ch.finish_reason = fr
        for k in _STOP_FIELDS:  # A17: kept when present; last non-null wins
            if k in c:
                v = c[k]
                if v is not None or k not in ch.stops:
                    ch.stops[k] = v
        ids = c.get("token_ids")
        if ids is not None:  # A22 (validated by core.tokens on the relay path)
            if type(ids) is not list:
                return Failure(E.E02.id, T.A13.id, "token_ids is not a list")
            ch.token_ids.extend(ids)
        pids = c.get("prompt_token_ids")
        if pids is not None and ch.prompt_token_ids is None:
            if type(pids) is not list:
                return Failure(E.E02.id, T.A13.id, "prompt_token_ids is not a list")
            ch.prompt_token_ids = pids
        return None

    def _feed_delta(self, ch: _Choice, delta: dict[str, Any]) -> bool | Failure:
        output = False
        for k, v in delta.items():
            if k not in _CHAT_DELTA_KEYS and _has_value(v):
                return _unsupported("delta", k)
        role = delta.get("role")
        if role is not None and ch.role is None:  # A23
            if type(role) is not str:
                return Failure(E.E02.id, T.A13.id, "delta role is not a string")
            ch.role = role
        for k in _CHAT_CONCAT:  # A01-A04, D02: each under its own name, never joined
            v = delta.get(k)
            if v is None:
                continue
            if type(v) is not str:
                return Failure(E.E02.id, T.A13.id, f"delta {k} is not a string")
            ch.seen.add(k)
            if v:
                ch.parts.setdefault(k, []).append(v)
                output = True
        tcs = delta.get("tool_calls")
        if tcs is not None:
            if type(tcs) is not list:
                return Failure(E.E02.id, T.A13.id, "delta tool_calls is not a list")
            for tc in tcs:
                f = self._feed_tool_call(ch, tc)
                if f is not None:
                    return f
            output = output or bool(tcs)
        fc = delta.get("function_call")
        if fc is not None:  # A06
            if type(fc) is not dict:
                return Failure(E.E02.id, T.A13.id, "delta function_call is not an object")
            acc = ch.function_call
            if acc is None:
                acc = ch.function_call = {k: [] for k in _FUNCTION_CALL_PARTS}
            for k in _FUNCTION_CALL_PARTS:
                v = fc.get(k)
                if v is None:
                    continue
                if type(v) is not str:
                    return Failure(E.E02.id, T.A13.id, f"function_call {k} is not a string")
                acc[k].append(v)
            output = True
        return output

    def _feed_tool_call(self, ch: _Choice, tc: Any) -> Failure | None:
        # A05: grouped by stream index; id, function name and arguments concatenate
        # independently; entries with one index merge, also within one chunk.
        if type(tc) is not dict:
            return Failure(E.E02.id, T.A13.id, "a tool call delta is not an object")
        if tc.get("type") == "custom" or _has_value(tc.get("custom")):
            return Failure(E.E01.id, T.A12.id, "custom tool output")
        idx = tc.get("index", 0)
        if type(idx) is not int:
            return Failure(E.E02.id, T.A13.id, "tool call index is not an integer")
        acc = ch.tool_calls.get(idx)
        if acc is None:
            acc = ch.tool_calls[idx] = {"id": [], "type": None, "name": [], "arguments": []}
        tid = tc.get("id")
        if tid is not None:
            if type(tid) is not str:
                return Failure(E.E02.id, T.A13.id, "tool call id is not a string")
            acc["id"].append(tid)
        ttype = tc.get("type")
        if ttype is not None:
            if type(ttype) is not str:
                return Failure(E.E02.id, T.A13.id, "tool call type is not a string")
            if acc["type"] is None:
                acc["type"] = ttype
        fn = tc.get("function")
        if fn is not None:
            if type(fn) is not dict:
                return Failure(E.E02.id, T.A13.id, "tool call function is not an object")
            for k in ("name", "arguments"):
                v = fn.get(k)
                if v is None:
                    continue
                if type(v) is not str:  # A11: arguments stay engine-generated strings
                    return Failure(E.E02.id, T.A13.id, f"tool call function.{k} is not a string")
                acc[k].append(v)
        return None

    def _feed_logprobs(self, ch: _Choice, lp: Any) -> Failure | None:
        if type(lp) is not dict:
            return Failure(E.E02.id, T.A13.id, "logprobs is not an object")
        arrays = _CHAT_LOGPROB_ARRAYS if self.route == "chat" else _COMPLETION_LOGPROB_ARRAYS
        acc = ch.logprobs
        if acc is None:
            acc = ch.logprobs = {}
        for k in arrays:  # A07 / A08: arrays join in stream order
            v = lp.get(k)
            if v is None:
                continue
            if type(v) is not list:
                return Failure(E.E02.id, T.A13.id, f"logprobs {k} is not a list")
            acc.setdefault(k, []).extend(v)
        return None

    # -- result ----------------------------------------------------------------------

    @property
    def engine_usage(self) -> bool:
        """The engine sent usage (A15): the assembled usage is the engine's own."""
        return self._usage is not None

    @property
    def output_events(self) -> int:
        """Events that carried output (the output measure when no token IDs exist)."""
        return self._events_with_output

    def finish(self, *, prompt_tokens: int, completion_tokens: int | None = None) -> dict[str, Any] | Failure:
        """The assembled response.

        prompt_tokens: the router's input length for A18 when the engine reported none.
        completion_tokens: measured output tokens (validated token IDs) for A18; None
        means "count output events".
        """
        choices = []
        for idx in sorted(self._choices):
            built = self._build_choice(self._choices[idx])
            if isinstance(built, Failure):
                return built
            choices.append(built)
        m = self._meta
        resp: dict[str, Any] = {
            "id": m.get("id", ""),
            "object": "chat.completion" if self.route == "chat" else "text_completion",
            "created": m.get("created", 0),
            "model": m.get("model", ""),
            "choices": choices,
        }
        for k in _METADATA:  # A14: the rest of the metadata as the engine sent it
            if k not in resp and k in m and k != "object":
                resp[k] = m[k]
        if self._usage is not None:  # A15
            resp["usage"] = self._usage
        else:  # A18
            if self._prompt_ids is not None:
                pt = len(self._prompt_ids)
            else:
                pt = next((len(c.prompt_token_ids) for c in self._choices.values() if c.prompt_token_ids), prompt_tokens)
            ct = completion_tokens if completion_tokens is not None else self._events_with_output
            resp["usage"] = {"prompt_tokens": pt, "completion_tokens": ct, "total_tokens": pt + ct}
        if self.include_token_ids and self.route == "chat" and self._prompt_ids is not None:  # A22
            resp["prompt_token_ids"] = self._prompt_ids
        return resp

    def _build_choice(self, ch: _Choice) -> dict[str, Any] | Failure:
        out: dict[str, Any] = {"index": ch.index}
        calls = []
        for tidx in sorted(ch.tool_calls):  # A05: index order
            acc = ch.tool_calls[tidx]
            tid, name = "".join(acc["id"]), "".join(acc["name"])
            if not tid or not name:  # A10
                missing = "an ID" if not tid else "a function name"
                return Failure(E.E02.id, T.A10.id, f"a tool call has no {missing}", f"tool call index {tidx}")
            calls.append({
                "id": tid,
                "type": acc["type"] or "function",
                "function": {"name": name, "arguments": "".join(acc["arguments"])},  # A11
            })
        if self.route == "chat":
            msg: dict[str, Any] = {"role": ch.role or "assistant"}
            content = "".join(ch.parts.get("content", ()))
            # A20: the engine's own non-streaming shape: content null when no content
            # arrived beside tool calls, a function call or a refusal; "" for an empty answer
            structured = bool(calls) or ch.function_call is not None or bool("".join(ch.parts.get("refusal", ())))
            if not content and structured and self.content_null_when_empty:
                msg["content"] = None
            else:
                msg["content"] = content
            for k in _CHAT_CONCAT:
                if k != "content" and k in ch.seen:
                    msg[k] = "".join(ch.parts.get(k, ()))
            if calls:
                msg["tool_calls"] = calls
            if ch.function_call is not None:  # A06
                msg["function_call"] = {k: "".join(v) for k, v in ch.function_call.items()}
            out["message"] = msg
        else:
            out["text"] = "".join(ch.parts.get("text", ()))
        out["logprobs"] = ch.logprobs  # A07/A08; null when no chunk carried logprobs
        fr = ch.finish_reason
        if fr is None:  # A21
            fr = "tool_calls" if calls else "stop"
        out["finish_reason"] = fr  # A16, A19
        for k, v in ch.stops.items():  # A17
            out[k] = v
        if self.include_token_ids:  # A22
            out["token_ids"] = ch.token_ids
            if self.route == "completion" and ch.prompt_token_ids is not None:
                out["prompt_token_ids"] = ch.prompt_token_ids
        return out
