"""What a mock engine puts on the wire, per dialect (docs/engines.md sections 3-12).

Rules
  * vllm: chunks look dumped with exclude_unset (fields the server set appear, others are
    absent); the role chunk has no token_ids but carries top-level prompt_token_ids when
    the request asked for IDs; every other chat chunk carries choices[0].token_ids when
    IDs are on (held-back parser tokens as `delta: {}` + IDs); the finish reason and
    `stop_reason` ride on the last token's chunk; completions put prompt_token_ids inside
    the choice (first chunk) and set every choice field (nulls present).
  * sglang: bare hex id; `created` is taken per chunk and increments once mid-stream;
    `reasoning_content` is always serialised; `matched_stop` on every chat choice; the
    finish reason comes in its own last chunk; tool-call chunks are dumped without
    exclusions (role/content/reasoning_content null, chunk-level "usage": null).
  * openai: id, object, created, model, service_tier, system_fingerprint, choices, then
    `usage: null` on every chunk when usage was asked for and an `obfuscation` string;
    never token IDs.
  * No output token (a `Piece`) is invented here, and a vLLM stream shows every ID the
    script holds exactly once (completion_tokens == sum of len(token_ids)). Groups
    handed to `group()` hold pieces of one kind and one tool index.
  * The streaming renderers are stream.py's (`renderer`); this module holds the reply, its
    IDs, usage and faults, the non-streaming response and the error envelopes.
  * WARNING: the framing (`data: ` + JSON + blank line) of an answer's events lives only
    in stream.py's `_event` (an error event's, in `error_event` here).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import orjson

from .scenarios import (
    CONTENT,
    FN_ARGS,
    FN_OPEN,
    HIDDEN,
    REASONING,
    REFUSAL,
    THINK_CLOSE_ID,
    THINK_OPEN_ID,
    TOOL_ARGS,
    TOOL_OPEN,
    Piece,
    Script,
)

__all__ = [
    "Reply",
    "response",
    "usage_object",
    "error_body",
    "error_event",
    "DONE",
    "new_id",
    "ERROR_TYPES",
]

DONE = b"data: [DONE]\n\n"
_dumps = orjson.dumps
FINGERPRINT = "fp_6e0a2d1c4b"
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
obfuscation = itertools.cycle(["Yt3", "q9", "Zk", "r", "mW2p", "x7"])


def _hex(n: int) -> str:
    return os.urandom((n + 1) // 2).hex()[:n]


def _alnum(n: int) -> str:
    return "".join(_ALNUM[b % 62] for b in os.urandom(n))


def new_id(dialect: str, route: str, request_id: str | None) -> str:
    """The response id: vLLM builds it from X-Request-Id, SGLang uses bare hex."""
    if dialect == "sglang":
        return _hex(32)
    prefix = "chatcmpl-" if route == "chat" else "cmpl-"
    if dialect == "vllm":
        return prefix + (request_id or _hex(16))
    return prefix + _alnum(29)


def tool_id(dialect: str, quirks: frozenset[str]) -> str:
    if dialect == "vllm":
        return "chatcmpl-tool-" + _hex(32)
    if dialect == "openai" and "tgi_repeat_ids" in quirks:
        return "0"
    return "call_" + (_hex(24) if dialect == "sglang" else _alnum(24))


@dataclass(frozen=True, slots=True)
class Reply:
    """Everything the renderers need to know about one answer."""

    dialect: str
    route: str  # chat | completions
    scenario: str
    id: str
    created: int
    model: str
    prompt_tokens: int
    prompt_ids: list[int]
    script: Script
    ids: bool  # emit token IDs (vLLM return_token_ids; SGLang completions / non-streaming chat)
    logprobs: int | None = None  # None: off; k >= 1: top_logprobs entries per token
    usage: bool = False  # final usage chunk
    continuous_usage: bool = False  # running usage on every chunk
    usage_null: bool = False  # "usage": null on every chunk (openai)
    obfuscation: bool = True
    quirks: frozenset[str] = field(default_factory=frozenset)
    piece_fault: str | None = None  # see scenarios.PIECE_FAULTS
    tool_fault: tuple[str, int] | None = None  # (fault, tool-call index)
    no_finish_reason: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    cached_tokens: int | None = None  # prefix-cache hit; None: the engine has no prefix cache


# --- shared pieces ----------------------------------------------------------------------


def _logprob(token_id: int) -> float:
    return -round(((token_id * 37) % 1000) / 1000 + 0.01, 4)


def chat_logprobs(pieces: list[Piece], k: int) -> dict[str, Any]:
    out = []
    for p in pieces:
        lp = _logprob(p.token_id)
        tops = [{"token": p.text, "logprob": lp, "bytes": list(p.text.encode())}]
        tops += [{"token": f"alt{j}", "logprob": round(lp - 0.5 * j, 4), "bytes": list(f"alt{j}".encode())} for j in range(1, k)]
        out.append({"token": p.text, "logprob": lp, "bytes": list(p.text.encode()), "top_logprobs": tops})
    return {"content": out}


def completion_logprobs(pieces: list[Piece], k: int, offset: int) -> dict[str, Any]:
    tokens, lps, offs, tops = [], [], [], []
    for p in pieces:
        lp = _logprob(p.token_id)
        tokens.append(p.text)
        lps.append(lp)
        offs.append(offset)
        offset += len(p.text)
        top = {p.text: lp}
        top.update({f"alt{j}": round(lp - 0.5 * j, 4) for j in range(1, k)})
        tops.append(top)
    return {"text_offset": offs, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops}


def reasoning_tokens(script: Script) -> int:
    return sum(1 for p in script.pieces if p.kind == REASONING or p.token_id in (THINK_OPEN_ID, THINK_CLOSE_ID))


def usage_object(dialect: str, prompt: int, completion: int, *, reasoning: int = 0, final: bool = True, streaming: bool = True, cached: int | None = None) -> dict[str, Any]:
    """The usage object; vLLM drops null detail keys in streams, keeps them in responses.

    `cached` (an engine with a prefix cache; final usage only): vLLM reports
    prompt_tokens_details.cached_tokens only when it is > 0 (--enable-prompt-tokens-details
    skips a zero), SGLang always (--enable-cache-report), openai always."""
    total = prompt + completion
    if dialect == "openai":
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": total,
            "prompt_tokens_details": {"cached_tokens": cached or 0, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": reasoning, "audio_tokens": 0, "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0},
        }
    u: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": total, "completion_tokens": completion}
    if dialect == "sglang" and final:
        u["prompt_tokens_details"] = None if cached is None else {"cached_tokens": cached}
        u["reasoning_tokens"] = reasoning
    elif dialect == "vllm" and final and cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    elif dialect == "vllm" and not streaming:
        u["prompt_tokens_details"] = None
    return u


# --- piece faults (rows A10-A13, T02-T03) -----------------------------------------------

_AUDIO = {"id": "audio_mock0001", "data": "UklGRiQAAABXQVZF", "transcript": "Hi", "expires_at": 1999999999}
_ANNOTATIONS = [{"type": "url_citation", "url_citation": {"start_index": 0, "end_index": 4, "title": "Narwhal", "url": "https://example.com/narwhal"}}]
_CUSTOM_TOOL = {"index": 9, "id": "call_custom0001", "type": "custom", "custom": {"name": "run_shell", "input": "ls -l"}}


def fault_choice(choice: dict[str, Any], fault: str, chat: bool) -> bool:
    """Apply a piece fault to an outgoing choice; False when this choice cannot carry it."""
    ids = choice.get("token_ids")
    if fault in ("missing_token_ids", "bool_token_ids", "negative_token_ids", "string_token_ids"):
        if not isinstance(ids, list) or not ids:
            return False  # token-ID faults act only where token IDs are sent
        if fault == "missing_token_ids":
            del choice["token_ids"]
        elif fault == "bool_token_ids":
            choice["token_ids"] = [True] + ids[1:]
        elif fault == "negative_token_ids":
            choice["token_ids"] = [-1] + ids[1:]
        else:
            choice["token_ids"] = [str(x) for x in ids]
        return True
    target = choice.setdefault("delta", {}) if chat else choice
    if fault == "audio":
        target["audio"] = dict(_AUDIO)
    elif fault == "annotations":
        target["annotations"] = list(_ANNOTATIONS)
    elif fault == "custom_tool":
        if not chat:
            return False
        target["tool_calls"] = [*(target.get("tool_calls") or ()), dict(_CUSTOM_TOOL)]
    elif fault == "wrong_type":
        target["content" if chat else "text"] = 42
    return True


# --- non-streaming responses ------------------------------------------------------------


def _collect(script: Script) -> dict[str, Any]:
    content, reasoning, refusal = [], [], []
    tools: dict[int, list[str]] = {}
    names: dict[int, str] = {}
    fn: list[str] | None = None
    fn_name = ""
    for p in script.pieces:
        if p.kind == CONTENT:
            content.append(p.text)
        elif p.kind == REASONING:
            reasoning.append(p.text)
        elif p.kind == REFUSAL:
            refusal.append(p.text)
        elif p.kind == TOOL_OPEN:
            names[p.index] = p.text
            tools.setdefault(p.index, [])
        elif p.kind == TOOL_ARGS:
            tools.setdefault(p.index, []).append(p.text)
        elif p.kind == FN_OPEN:
            fn, fn_name = [], p.text
        elif p.kind == FN_ARGS and fn is not None:
            fn.append(p.text)
    return {
        "content": "".join(content),
        "reasoning": "".join(reasoning),
        "refusal": "".join(refusal),
        "tools": [(i, names.get(i), "".join(a)) for i, a in sorted(tools.items())],
        "function_call": None if fn is None else {"name": fn_name, "arguments": "".join(fn)},
    }


def _message(r: Reply, c: dict[str, Any], tool_ids: list[str]) -> dict[str, Any]:
    tcs = []
    for i, name, args in c["tools"]:
        tc: dict[str, Any] = {"id": tool_ids[i], "type": "function", "function": {"name": name, "arguments": args}}
        if r.dialect == "sglang":
            tc = {"id": tool_ids[i], "index": i, "type": "function", "function": {"name": name, "arguments": args}}
        if r.tool_fault is not None and r.tool_fault[1] == i:
            if r.tool_fault[0] == "tool_call_no_id":
                del tc["id"]
            else:
                del tc["function"]["name"]
        tcs.append(tc)
    structured = bool(tcs or c["function_call"] or c["refusal"])
    content = c["content"] if (c["content"] or not structured) else None
    if r.dialect == "vllm":
        m: dict[str, Any] = {"role": "assistant", "content": content, "refusal": c["refusal"] or None, "annotations": None, "audio": None, "function_call": c["function_call"]}
        if tcs:
            m["tool_calls"] = tcs
        m["reasoning"] = c["reasoning"] or None
        return m
    if r.dialect == "sglang":
        m = {"role": "assistant", "content": c["content"], "reasoning_content": c["reasoning"] or None, "tool_calls": tcs or None}
        if c["refusal"]:
            m["refusal"] = c["refusal"]
        if c["function_call"]:
            m["function_call"] = c["function_call"]
        return m
    m = {"role": "assistant", "content": content, "refusal": c["refusal"] or None, "annotations": []}
    if c["reasoning"]:
        m["reasoning_content"] = c["reasoning"]
    if tcs:
        m["tool_calls"] = tcs
    if c["function_call"]:
        m["function_call"] = c["function_call"]
    return m


def response(r: Reply) -> dict[str, Any]:
    """The engine's own non-streaming answer (docs/engines.md section 12; fixtures' expected files)."""
    s = r.script
    pieces = list(s.pieces)
    ids = [p.token_id for p in pieces]
    k = r.logprobs
    # logprobs cover the tokens the dialect's stream shows (vLLM and SGLang completions:
    # all; otherwise EOS and held-back parser tokens send no chunk)
    if r.dialect == "vllm" or (r.dialect == "sglang" and r.route == "completions"):
        lp_pieces = pieces
    else:
        lp_pieces = [p for p in pieces if p.text and p.kind != HIDDEN]
    finish = None if r.no_finish_reason else s.finish_reason
    usage = usage_object(r.dialect, r.prompt_tokens, len(pieces), reasoning=reasoning_tokens(s), streaming=False, cached=r.cached_tokens)
    obj = "chat.completion" if r.route == "chat" else "text_completion"
    out: dict[str, Any] = {"id": r.id, "object": obj, "created": r.created, "model": r.model}
    matched = s.matched_stop if s.finish_reason == "stop" else None
    if r.route == "chat":
        tool_ids = [tool_id(r.dialect, r.quirks) for _ in range(4)]
        c = _collect(s)
        choice: dict[str, Any] = {"index": 0, "message": _message(r, c, tool_ids), "logprobs": chat_logprobs(lp_pieces, k) if k else None, "finish_reason": finish}
        if r.dialect == "vllm":
            choice["stop_reason"] = None
            choice["token_ids"] = ids if r.ids else None
            choice["routed_experts"] = None
        elif r.dialect == "sglang":
            choice["matched_stop"] = matched
            if r.ids:
                choice["token_ids"] = ids
    else:
        text = "".join(p.text for p in pieces)
        lp = completion_logprobs(lp_pieces, k, 0) if k else None
        if r.dialect == "openai":
            choice = {"text": text, "index": 0, "logprobs": lp, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        if r.dialect == "vllm":
            choice.update(stop_reason=None, token_ids=ids if r.ids else None, prompt_logprobs=None, prompt_token_ids=r.prompt_ids if r.ids else None)
        elif r.dialect == "sglang":
            choice["matched_stop"] = matched
            if r.ids:
                choice["token_ids"] = ids
                choice["prompt_token_ids"] = r.prompt_ids
    if r.piece_fault is not None:
        _fault_response(choice, r.piece_fault, r.route == "chat")
    out["choices"] = [choice]
    if r.dialect == "vllm":
        out.update(service_tier=None, system_fingerprint=None, usage=usage)
        if r.route == "chat":
            out.update(prompt_logprobs=None, prompt_token_ids=r.prompt_ids if r.ids else None, prompt_text=None)
        out["kv_transfer_params"] = r.kv_transfer_params
        if r.route == "chat":
            out.update(ec_transfer_params=None, metrics=None)
    elif r.dialect == "sglang":
        out["usage"] = usage
        out["metadata"] = {"weight_version": "default"}
    else:
        out["usage"] = usage
        out["service_tier"] = "default"
        out["system_fingerprint"] = FINGERPRINT
    if r.kv_transfer_params is not None:
        out["kv_transfer_params"] = r.kv_transfer_params
    return out


def _fault_response(choice: dict[str, Any], fault: str, chat: bool) -> None:
    ids = choice.get("token_ids")
    if fault.endswith("_token_ids"):
        if isinstance(ids, list) and ids:
            fault_choice(choice, fault, chat)
        return
    target = choice["message"] if chat else choice
    if fault == "audio":
        target["audio"] = dict(_AUDIO)
    elif fault == "annotations":
        target["annotations"] = list(_ANNOTATIONS)
    elif fault == "custom_tool" and chat:
        ct = {k: v for k, v in _CUSTOM_TOOL.items() if k != "index"}
        target["tool_calls"] = [*(target.get("tool_calls") or ()), ct]
    elif fault == "wrong_type":
        target["content" if chat else "text"] = 42


# --- errors (docs/engines.md section 10) ------------------------------------------------

ERROR_TYPES: dict[tuple[str, int], str] = {
    ("vllm", 400): "BadRequestError",
    ("vllm", 404): "NotFoundError",
    ("vllm", 500): "InternalServerError",
    ("sglang", 400): "BadRequestError",
    ("sglang", 404): "NotFoundError",
    ("sglang", 500): "InternalServerError",
    ("openai", 400): "invalid_request_error",
    ("openai", 404): "invalid_request_error",
    ("openai", 500): "server_error",
}


def _error(dialect: str, status: int, message: str, param: str | None, code: str | None) -> dict[str, Any]:
    t = ERROR_TYPES.get((dialect, status), "InternalServerError" if dialect != "openai" else "server_error")
    if dialect == "openai":
        return {"error": {"message": message, "type": t, "param": param, "code": code}}
    if dialect == "sglang":
        return {"error": {"object": "error", "message": message, "type": t, "param": param, "code": status}}
    return {"error": {"message": message, "type": t, "param": param, "code": status}}


def error_body(dialect: str, status: int, message: str, *, param: str | None = None, code: str | None = None) -> bytes:
    """An HTTP error body in the dialect's envelope."""
    return _dumps(_error(dialect, status, message, param, code))


def error_event(dialect: str, message: str) -> bytes:
    """A mid-stream error event (always followed by data: [DONE], never by usage)."""
    return b"data: " + _dumps(_error(dialect, 500, message, None, None)) + b"\n\n"
