"""A mock engine's streamed answer, per dialect: the SSE events of one choice, rendered
from groups of the script's pieces (the rules of wire.py, whose reply, IDs, usage and
faults they use). `renderer(reply)` picks the dialect's and route's renderer.
"""

from __future__ import annotations

from typing import Any

import orjson

from .scenarios import CONTENT, FN_ARGS, FN_OPEN, REASONING, REFUSAL, TOOL_ARGS, TOOL_OPEN, Piece
from .wire import (
    FINGERPRINT,
    Reply,
    chat_logprobs,
    completion_logprobs,
    fault_choice,
    obfuscation,
    reasoning_tokens,
    tool_id,
    usage_object,
)

__all__ = ["renderer"]

_dumps = orjson.dumps


def _event(prefix: bytes, choice: dict[str, Any] | None, tail: bytes = b"") -> bytes:
    body = _dumps(choice) if choice is not None else b""
    return b"".join((prefix, body, b"]", tail, b"}\n\n"))


class _Renderer:
    """Turns groups of pieces into SSE events for one streamed answer (one choice)."""

    chat = True

    def __init__(self, r: Reply) -> None:
        self.r = r
        self.done = 0  # pieces rendered so far
        self.offset = 0  # text offset for completion logprobs
        self.pending: str | None = None  # a piece fault waiting for a choice that can carry it
        self.first = True  # no token chunk sent yet (completions: prompt_token_ids go on it)
        self.tool_ids = [tool_id(r.dialect, r.quirks) for _ in range(4)]
        self.prefix = self._prefix(r.created)

    # dialect hooks
    def _prefix(self, created: int) -> bytes:
        r = self.r
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        head = _dumps({"id": r.id, "object": obj, "created": created, "model": r.model})
        return b"data: " + head[:-1] + b',"choices":['

    def head(self) -> list[bytes]:
        return []

    def group(self, pieces: list[Piece], final: bool) -> list[bytes]:
        raise NotImplementedError

    def _tail(self) -> bytes:
        r = self.r
        if r.continuous_usage:
            u = usage_object(r.dialect, r.prompt_tokens, self.done, final=False)
            return b',"usage":' + _dumps(u)
        return b',"usage":null' if r.usage_null else b""

    def usage_chunk(self) -> bytes:
        r = self.r
        u = usage_object(r.dialect, r.prompt_tokens, len(r.script.pieces), reasoning=reasoning_tokens(r.script), cached=r.cached_tokens)
        return self.prefix + b'],"usage":' + _dumps(u) + self._extra_tail() + b"}\n\n"

    def _extra_tail(self) -> bytes:
        return b""

    # helpers
    def _finish(self) -> str | None:
        return None if self.r.no_finish_reason else self.r.script.finish_reason

    def _apply_pending(self, choice: dict[str, Any]) -> None:
        if self.pending is not None and fault_choice(choice, self.pending, self.chat):
            self.pending = None

    def _lp(self, pieces: list[Piece]) -> dict[str, Any] | None:
        k = self.r.logprobs
        if k is None or not pieces:
            return None
        if self.chat:
            return chat_logprobs(pieces, k)
        lp = completion_logprobs(pieces, k, self.offset)
        return lp

    def _delta(self, pieces: list[Piece]) -> dict[str, Any] | None:
        """The chat delta for a group (None: this dialect sends no chunk for it)."""
        if not pieces:
            return None
        p = pieces[0]
        text = "".join(x.text for x in pieces)
        kind = p.kind
        if kind == CONTENT:
            return {"content": text} if text else None
        if kind == REASONING:
            return {"reasoning_content": text}
        if kind == REFUSAL:
            return {"refusal": text}
        if kind == TOOL_OPEN:
            entry: dict[str, Any] = {"index": p.index, "id": self.tool_ids[p.index], "type": "function", "function": {"name": text, "arguments": ""}}
            return {"tool_calls": [self._tool_fault(entry, p.index)]}
        if kind == TOOL_ARGS:
            entry = {"index": p.index, "function": {"arguments": text}}
            if "tgi_repeat_ids" in self.r.quirks:  # TGI: id, type and name on every chunk
                entry = {"index": p.index, "id": self.tool_ids[p.index], "type": "function", "function": {"name": "get_weather", "arguments": text}}
            return {"tool_calls": [self._tool_fault(entry, p.index)]}
        if kind == FN_OPEN:
            return {"function_call": {"name": text, "arguments": ""}}
        if kind == FN_ARGS:
            return {"function_call": {"arguments": text}}
        return None  # HIDDEN

    def _tool_fault(self, entry: dict[str, Any], index: int) -> dict[str, Any]:
        tf = self.r.tool_fault
        if tf is None or tf[1] != index:
            return entry
        if tf[0] == "tool_call_no_id":
            if "id" in entry:
                if self.r.dialect == "sglang":
                    entry["id"] = None
                else:
                    del entry["id"]
        elif "name" in entry["function"]:
            if self.r.dialect == "sglang":
                entry["function"]["name"] = None
            else:
                del entry["function"]["name"]
        return entry

    def _advance(self, pieces: list[Piece]) -> None:
        self.done += len(pieces)
        if not self.chat:
            self.offset += sum(len(p.text) for p in pieces)


class _VllmChat(_Renderer):
    def head(self) -> list[bytes]:
        r = self.r
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        tail = self._tail()
        if r.ids:
            tail += b',"prompt_token_ids":' + _dumps(r.prompt_ids)
        return [_event(self.prefix, choice, tail)]

    def _delta(self, pieces: list[Piece]) -> dict[str, Any] | None:
        if not pieces:
            return {"content": ""}  # an empty answer still ends on a finish chunk
        p = pieces[0]
        if p.kind == CONTENT:
            return {"content": "".join(x.text for x in pieces)}  # "" kept: the EOS chunk
        if p.kind == REASONING:
            return {"reasoning": "".join(x.text for x in pieces)}
        if p.kind == TOOL_OPEN:
            entry = {"id": self.tool_ids[p.index], "type": "function", "index": p.index, "function": {"name": p.text, "arguments": ""}}
            return {"tool_calls": [self._tool_fault(entry, p.index)]}
        d = super()._delta(pieces)
        return {} if d is None else d

    def group(self, pieces: list[Piece], final: bool) -> list[bytes]:
        r = self.r
        lp = self._lp(pieces)
        delta = self._delta(pieces)
        assert delta is not None
        choice: dict[str, Any] = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}
        if final:
            choice["finish_reason"] = self._finish()
            choice["stop_reason"] = None
        if r.ids:
            choice["token_ids"] = [p.token_id for p in pieces]
        self._advance(pieces)
        if not delta and not r.ids and lp is None and not final:
            return []  # vLLM skips chunks with no text and no IDs
        self._apply_pending(choice)
        return [_event(self.prefix, choice, self._tail())]


class _SglangChat(_Renderer):
    def __init__(self, r: Reply) -> None:
        super().__init__(r)
        self.bumped = False
        self.bump_at = max(1, len(r.script.pieces) // 2)

    def _maybe_bump(self) -> None:
        # SGLang takes `created` per chunk: it changes once in the middle of the stream.
        if not self.bumped and self.done >= self.bump_at:
            self.bumped = True
            self.prefix = self._prefix(self.r.created + 1)

    def head(self) -> list[bytes]:
        choice = {"index": 0, "delta": {"reasoning_content": None, "role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None, "matched_stop": None}
        return [_event(self.prefix, choice, self._tail())]

    def group(self, pieces: list[Piece], final: bool) -> list[bytes]:
        out = []
        delta = self._delta(pieces)
        lp = self._lp(pieces)
        self._advance(pieces)
        self._maybe_bump()
        if delta is not None:
            tail = self._tail()
            if "tool_calls" in delta:  # the pydantic path: dumped without exclusions
                tcs = [
                    tc if tc.get("type") == "custom" else
                    {"id": tc.get("id"), "index": tc["index"], "type": "function",
                     "function": {"name": tc["function"].get("name"), "arguments": tc["function"].get("arguments", "")}}
                    for tc in delta["tool_calls"]
                ]  # fmt: skip
                delta = {"role": None, "content": None, "reasoning_content": None, "tool_calls": tcs}
                tail = tail or b',"usage":null'
            elif "reasoning_content" not in delta:
                delta = {"reasoning_content": None, **delta}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None, "matched_stop": None}
            self._apply_pending(choice)
            out.append(_event(self.prefix, choice, tail))
        if final:
            self.done = max(self.done, self.bump_at)
            self._maybe_bump()
            ms = self.r.script.matched_stop if self.r.script.finish_reason == "stop" else None
            choice = {"index": 0, "delta": {"reasoning_content": None}, "logprobs": None, "finish_reason": self._finish(), "matched_stop": ms}
            self._apply_pending(choice)
            out.append(_event(self.prefix, choice, self._tail()))
        return out


class _OpenAIChat(_Renderer):
    def _prefix(self, created: int) -> bytes:
        r = self.r
        head = _dumps({"id": r.id, "object": "chat.completion.chunk", "created": created, "model": r.model, "service_tier": "default", "system_fingerprint": FINGERPRINT})
        return b"data: " + head[:-1] + b',"choices":['

    def _extra_tail(self) -> bytes:
        if not self.r.obfuscation:
            return b""
        return b',"obfuscation":' + _dumps(next(obfuscation))

    def _tail(self) -> bytes:
        return super()._tail() + self._extra_tail()

    def head(self) -> list[bytes]:
        sc = self.r.scenario
        if sc == "refusal":
            delta: dict[str, Any] = {"role": "assistant", "content": None, "refusal": ""}
        elif sc in ("tool_calls", "function_call"):
            delta = {"role": "assistant", "content": None}
        else:
            delta = {"role": "assistant", "content": ""}
        return [_event(self.prefix, {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}, self._tail())]

    def group(self, pieces: list[Piece], final: bool) -> list[bytes]:
        out = []
        delta = self._delta(pieces)
        lp = self._lp(pieces)
        self._advance(pieces)
        if delta is not None:
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": None}
            self._apply_pending(choice)
            out.append(_event(self.prefix, choice, self._tail()))
        if final:
            choice = {"index": 0, "delta": {}, "logprobs": None, "finish_reason": self._finish()}
            self._apply_pending(choice)
            out.append(_event(self.prefix, choice, self._tail()))
        return out


class _VllmCompletion(_Renderer):
    chat = False

    def group(self, pieces: list[Piece], final: bool) -> list[bytes]:
        r = self.r
        choice: dict[str, Any] = {
            "index": 0,
            "text": "".join(p.text for p in pieces),
            "logprobs": self._lp(pieces),
            "finish_reason": self._finish() if final else None,
            "stop_reason": None,
            "prompt_token_ids": r.prompt_ids if r.ids and self.first else None,
            "token_ids": [p.token_id for p in pieces] if r.ids else None,
        }
        self.first = False
        self._advance(pieces)
        self._apply_pending(choice)
        return [_event(self.prefix, choice, self._tail())]


class _SglangCompletion(_Renderer):
    chat = False

    def group(self, pieces: list[Piece], final: bool) -> list[bytes]:
        r = self.r
        choice: dict[str, Any] = {"index": 0, "text": "".join(p.text for p in pieces), "logprobs": self._lp(pieces), "finish_reason": None}
        if final:
            choice["finish_reason"] = self._finish()
            choice["matched_stop"] = r.script.matched_stop if r.script.finish_reason == "stop" else None
        if r.ids:
            choice["token_ids"] = [p.token_id for p in pieces]
            if self.first:
                choice["prompt_token_ids"] = r.prompt_ids
        self.first = False
        self._advance(pieces)
        self._apply_pending(choice)
        return [_event(self.prefix, choice, self._tail() or b',"usage":null')]


class _OpenAICompletion(_Renderer):
    chat = False

    def _prefix(self, created: int) -> bytes:
        r = self.r
        head = _dumps({"id": r.id, "object": "text_completion", "created": created, "model": r.model, "system_fingerprint": FINGERPRINT})
        return b"data: " + head[:-1] + b',"choices":['

    def group(self, pieces: list[Piece], final: bool) -> list[bytes]:
        out = []
        text = "".join(p.text for p in pieces)
        lp = self._lp(pieces)
        self._advance(pieces)
        if text:
            choice = {"text": text, "index": 0, "logprobs": lp, "finish_reason": None}
            self._apply_pending(choice)
            out.append(_event(self.prefix, choice, self._tail()))
        if final:
            choice = {"text": "", "index": 0, "logprobs": None, "finish_reason": self._finish()}
            self._apply_pending(choice)
            out.append(_event(self.prefix, choice, self._tail()))
        return out


_RENDERERS: dict[tuple[str, str], type[_Renderer]] = {
    ("vllm", "chat"): _VllmChat,
    ("sglang", "chat"): _SglangChat,
    ("openai", "chat"): _OpenAIChat,
    ("vllm", "completions"): _VllmCompletion,
    ("sglang", "completions"): _SglangCompletion,
    ("openai", "completions"): _OpenAICompletion,
}


def renderer(r: Reply) -> _Renderer:
    """The streaming renderer for this dialect and route."""
    return _RENDERERS[(r.dialect, r.route)](r)
