"""Client request checks, rows R04-R07 in precedence order, and what admission needs to know.

Rules
  * R04: the body must be JSON, an object, and every router-interpreted field must have
    its type (generated/models/*_request.py, strict: no coercion of "1" to 1 or "true"
    to true). The router-read headers are router-interpreted fields too.
  * R05: `model` equals serving.model.  R06: n <= 1 and best_of <= 1.
  * R07 (non-streaming chat only): modalities only "text", no audio, only function tools.
  * Every other field passes through to the engine untouched: the body forwarded is the
    client's parsed object, never a model dump.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from narwhal_generated import errors as E
from narwhal_generated.models.chat_request import ChatCompletionRequest
from narwhal_generated.models.completion_request import CompletionRequest

__all__ = ["ParsedRequest", "Rejection", "parse_request", "parse_headers", "HeaderValues"]

_MODELS: dict[str, type[BaseModel]] = {"chat": ChatCompletionRequest, "completion": CompletionRequest}
_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = frozenset(("str", "int", "bool", "float", "list", "dict", "none", "json-or-python", "function-after", "function-before", "nullable"))
_MAX_HEADER_MS = 10**9


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refusal decided by these checks: the row and what fills its envelope."""

    row: E.ErrorRow
    param: str | None = None
    fields: dict[str, object] = field(default_factory=dict)  # fill the row's message


@dataclass(frozen=True, slots=True)
class HeaderValues:
    ttft_target_ms: int | None
    deadline_ms: int | None


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    route: str  # "chat" | "completion"
    body: dict[str, Any]
    stream: bool
    client_usage: bool  # the client asked for a usage chunk (stream_options.include_usage)
    return_token_ids: bool  # T09
    max_tokens: int | None
    prompt_bytes: int  # UTF-8 bytes of the prompt text, for sizing
    prompt_token_count: int | None  # exact, when the prompt is token IDs
    prompt_text: str | None  # the prompt text, for an exact tokenizer when configured


def _param(loc: tuple[int | str, ...]) -> str | None:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or not _IDENT.match(part):
            continue  # a union member's tag, not a field
        else:
            out += ("." if out else "") + part
    return out or None


def parse_headers(ttft: str | None, deadline: str | None, *, budget_ms: int, max_target_ms: int) -> HeaderValues | Rejection:
    """R04 for the headers Narwhal reads; the TTFT target is clamped to max_ttft_target_ms."""
    vals: list[int | None] = []
    for name, raw in (("x-narwhal-ttft-target-ms", ttft), ("x-narwhal-deadline-ms", deadline)):
        if raw is None:
            vals.append(None)
            continue
        s = raw.strip()
        if not s.isdigit() or not s.isascii() or int(s) > _MAX_HEADER_MS:
            return Rejection(E.R04, name, {"detail": f"{name} must be a nonnegative integer of milliseconds, got {raw!r}"})
        vals.append(int(s))
    target = vals[0]
    if target is not None:
        target = min(target, max_target_ms)
    return HeaderValues(ttft_target_ms=target, deadline_ms=vals[1])


def _prompt_size(route: str, body: dict[str, Any]) -> tuple[int, int | None, str | None]:
    if route == "chat":
        parts: list[str] = []
        for m in body["messages"]:
            c = m.get("content")
            if isinstance(c, str):
                parts.append(c)
            elif isinstance(c, list):
                parts.extend(p["text"] for p in c if isinstance(p.get("text"), str))
        text = "\n".join(parts)
        # a few bytes of chat-template overhead per message
        return len(text.encode()) + 12 * len(body["messages"]), None, text
    prompt = body["prompt"]
    if isinstance(prompt, str):
        return len(prompt.encode()), None, prompt
    if prompt and isinstance(prompt[0], str):
        text = "\n".join(prompt)
        return len(text.encode()), None, text
    if prompt and isinstance(prompt[0], int):
        return 0, len(prompt), None
    return 0, sum(len(p) for p in prompt), None


def parse_request(route: str, raw: bytes, *, model: str) -> ParsedRequest | Rejection:
    """Rows R04-R07 over one request body, in precedence order."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return Rejection(E.R04, None, {"detail": f"the body is not valid JSON ({e.msg})"})
    if type(body) is not dict:
        return Rejection(E.R04, None, {"detail": "the body must be a JSON object"})
    try:
        _MODELS[route].model_validate(body)
    except ValidationError as e:
        # the most specific error: the one whose field path is longest
        errs = [(_param(tuple(x["loc"])), x) for x in e.errors(include_url=False)]
        p, err = max(errs, key=lambda pe: len(pe[0] or ""))
        return Rejection(E.R04, p, {"detail": f"{p or 'body'}: {err['msg']}"})
    # R05
    if body["model"] != model:
        return Rejection(E.R05, "model", {"model": body["model"], "configured": model})
    # R06
    n, best_of = body.get("n"), body.get("best_of")
    if n is not None and n > 1:
        return Rejection(E.R06, "n")
    if best_of is not None and best_of > 1:
        return Rejection(E.R06, "best_of")
    stream = bool(body.get("stream"))
    # R07
    if not stream and route == "chat":
        mods = body.get("modalities")
        if mods and any(m != "text" for m in mods):
            return Rejection(E.R07, "modalities", {"detail": "output modalities other than text"})
        if body.get("audio") is not None:
            return Rejection(E.R07, "audio", {"detail": "audio output"})
        for i, t in enumerate(body.get("tools") or ()):
            if t.get("type") != "function":
                return Rejection(E.R07, f"tools[{i}].type", {"detail": f"tools of type {t.get('type')!r}"})
    so = body.get("stream_options")
    client_usage = bool(stream and isinstance(so, dict) and so.get("include_usage"))
    mt = body.get("max_completion_tokens") if route == "chat" else None
    if mt is None:
        mt = body.get("max_tokens")
    pbytes, ptokens, ptext = _prompt_size(route, body)
    return ParsedRequest(
        route=route,
        body=body,
        stream=stream,
        client_usage=client_usage,
        return_token_ids=bool(body.get("return_token_ids")),
        max_tokens=mt,
        prompt_bytes=pbytes,
        prompt_token_count=ptokens,
        prompt_text=ptext,
    )
