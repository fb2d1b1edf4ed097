"""Client request checks, rows R04-R07 in precedence order, and what admission needs to know.

Rules
  * R04: the body must be JSON, an object, and every router-interpreted field must have
    its type (generated/models/*_request.py, strict: no coercion of "1" to 1 or "true"
    to true). The router-read headers are router-interpreted fields too.
  * R05: `model` equals serving.model.  R06: n <= 1 and best_of <= 1.
  * R07 (non-streaming chat only): modalities only "text", no audio, only function tools.
  * R04, nesting: a body nested deeper than MAX_DEPTH levels (the body object is level 1)
    is refused, with param naming the field that holds the nesting. orjson reads 1,024
    levels but writes only 254, and the router writes every body again for its engines;
    MAX_DEPTH keeps one level of that for the router.
  * Pass-through policy (docs/passthrough.md): every other field passes through to the
    engine untouched (the body forwarded is the client's parsed object, never a model
    dump), except
      - ROUTER_ONLY fields, removed here from every client body: only the router sets
        them (kv_transfer_params on the P/D legs);
      - the operator's upstream.deny_fields, removed by `without_fields` before each
        engine request.
    Both are removed silently, as an OpenAI-style API ignores fields it does not use.
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

from . import refusals as answers
from .tickets import Refuse

__all__ = ["ParsedRequest", "Rejection", "parse_request", "check_request", "body_facts", "parse_headers", "HeaderValues", "without_fields", "ROUTER_ONLY", "MAX_DEPTH"]

_MODELS: dict[str, type[BaseModel]] = {"chat": ChatCompletionRequest, "completion": CompletionRequest}
_IDENT = re.compile(r"^[a-z_][a-z0-9_]*$")
_TYPE_TAGS = frozenset(("str", "int", "bool", "float", "list", "dict", "none", "json-or-python", "function-after", "function-before", "nullable"))
_MAX_HEADER_MS = 10**9

# Fields a client never sets: KV-transfer steering (remote host, port, block IDs) of
# vLLM's two-phase protocol, which the router sets itself on P/D legs, and SGLang's
# disaggregation bootstrap (Narwhal runs no SGLang P/D, so nobody sets those).
ROUTER_ONLY: tuple[str, ...] = ("kv_transfer_params", "bootstrap_host", "bootstrap_port", "bootstrap_room")

MAX_DEPTH = 253  # levels of JSON nesting, the body object included (orjson writes 254)
_PARAM_STEPS = 6  # a deep field is named by at most this many steps of its path


@dataclass(frozen=True, slots=True)
class Rejection:
    """A refusal decided by these checks: the row and what fills its envelope."""

    row: E.ErrorRow
    param: str | None = None
    fields: dict[str, object] = field(default_factory=dict)  # fill the row's message

    def refusal(self) -> Refuse:
        return Refuse(self.row, fields=self.fields, param=self.param)


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


def _too_deep(body: dict[str, Any]) -> str | None:
    """The path of the field under which `body` nests deeper than MAX_DEPTH, else None.
    The path follows object keys, and array elements that are objects, for at most
    _PARAM_STEPS steps; below that (or below an array of arrays) the nesting is the
    named field's."""
    stack: list[tuple[Any, int, tuple[str | int, ...], bool]] = [(body, 1, (), True)]
    while stack:
        node, depth, path, named = stack.pop()
        is_dict = type(node) is dict
        for k, v in node.items() if is_dict else enumerate(node):
            tv = type(v)
            if tv is dict or tv is list:
                if depth + 1 > MAX_DEPTH:
                    return _path(path)
                if named and len(path) < _PARAM_STEPS and (is_dict or tv is dict):
                    stack.append((v, depth + 1, (*path, k), True))
                else:
                    stack.append((v, depth + 1, path, False))
    return None


def _path(path: tuple[str | int, ...]) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if type(p) is int else ("." if out else "") + str(p)[:64]
    return out or "body"


def without_fields(body: dict[str, Any], names: frozenset[str]) -> dict[str, Any]:
    """`body` without the top-level fields in `names` (a copy only when one is present)."""
    if not names or names.isdisjoint(body):
        return body
    return {k: v for k, v in body.items() if k not in names}


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
    """The body's first holding row in the refusal table's order, else the request."""
    got = check_request(route, raw, model=model)
    if isinstance(got, ParsedRequest):
        return got
    order = answers.TABLE.rows
    return min(got, key=lambda r: order.index(r.row))


def body_facts(route: str, raw: bytes, ttft: str | None, deadline: str | None, *, too_large: int | None, model: str,
               budget_ms: int, max_target_ms: int) -> tuple[tuple[Refuse, ...], ParsedRequest | None, HeaderValues | None]:
    """The body stage's facts (refusals.yaml, stage body): every body row that holds (R03:
    the body was over serving.max_request_bytes, `too_large` that limit, and was not
    read; R04 on the router-read headers or the body; R05-R07), with the parsed request
    (None when the body could not be parsed) and the header values (None when invalid).
    The refusal table's walk (core/refusals.py) decides which row answers."""
    hv = parse_headers(ttft, deadline, budget_ms=budget_ms, max_target_ms=max_target_ms)
    held: list[Refuse] = []
    if isinstance(hv, Rejection):
        held.append(hv.refusal())
    if too_large is not None:  # R03: nothing past the limit was read, nothing parsed
        held.append(Refuse(E.R03, fields={"limit": too_large}))
        return tuple(held), None, None
    parsed, rows = _checked(route, raw, model)
    held.extend(x.refusal() for x in rows)
    return tuple(held), parsed, None if isinstance(hv, Rejection) else hv


def check_request(route: str, raw: bytes, *, model: str) -> ParsedRequest | tuple[Rejection, ...]:
    """The body-stage facts R04-R07 over one request body: every row that holds (the
    refusal table's walk decides among them, core/refusals.py), else the request."""
    parsed, held = _checked(route, raw, model)
    return held if held or parsed is None else parsed


def _checked(route: str, raw: bytes, model: str) -> tuple[ParsedRequest | None, tuple[Rejection, ...]]:
    """(the request, when the body reads as one; the rows R04-R07 that hold). A body that
    cannot be read as a request (R04) has no other fact; one that can is sized even when
    R05-R07 hold (a row above them may need its size: R19)."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        return None, (Rejection(E.R04, None, {"detail": f"the body is not valid JSON ({e.msg})"}),)
    if type(body) is not dict:
        return None, (Rejection(E.R04, None, {"detail": "the body must be a JSON object"}),)
    invalid = _invalid(route, raw, body)
    if invalid is not None:
        return None, (invalid,)
    held: list[Rejection] = []
    if body["model"] != model:  # R05
        held.append(Rejection(E.R05, "model", {"model": body["model"], "configured": model}))
    else:
        body["model"] = model  # the same name: the router's one string, not one per open stream
    n, best_of = body.get("n"), body.get("best_of")
    if n is not None and n > 1:  # R06
        held.append(Rejection(E.R06, "n"))
    elif best_of is not None and best_of > 1:
        held.append(Rejection(E.R06, "best_of"))
    stream = bool(body.get("stream"))
    if not stream and route == "chat":  # R07
        r07 = _non_streaming_option(body)
        if r07 is not None:
            held.append(r07)
    return _parsed(route, body, stream), tuple(held)


def _invalid(route: str, raw: bytes, body: dict[str, Any]) -> Rejection | None:
    """R04 over a JSON object: nesting, then the route's request model."""
    # nesting: can the body be written again, one level down? (orjson, C speed:
    # ~0.35 ms per MiB; the walk that names the field runs only when it cannot)
    if len(raw) > 2 * MAX_DEPTH:
        try:
            orjson.dumps([body])
        except orjson.JSONEncodeError as e:
            deep = _too_deep(body)
            if deep is None:  # pragma: no cover - orjson writes back whatever it read, but for depth
                return Rejection(E.R04, None, {"detail": f"the body cannot be forwarded as JSON ({e})"})
            return Rejection(E.R04, deep, {"detail": f"{deep}: JSON nested deeper than {MAX_DEPTH} levels"})
    for k in ROUTER_ONLY:  # the pass-through policy: only the router sets these
        body.pop(k, None)
    try:
        _MODELS[route].model_validate(body)
    except ValidationError as e:
        # the most specific error: the one whose field path is longest
        errs = [(_param(tuple(x["loc"])), x) for x in e.errors(include_url=False)]
        p, err = max(errs, key=lambda pe: len(pe[0] or ""))
        return Rejection(E.R04, p, {"detail": f"{p or 'body'}: {err['msg']}"})
    return None


def _non_streaming_option(body: dict[str, Any]) -> Rejection | None:
    """R07: what a non-streaming chat request cannot have."""
    mods = body.get("modalities")
    if mods and any(m != "text" for m in mods):
        return Rejection(E.R07, "modalities", {"detail": "output modalities other than text"})
    if body.get("audio") is not None:
        return Rejection(E.R07, "audio", {"detail": "audio output"})
    for i, t in enumerate(body.get("tools") or ()):
        if t.get("type") != "function":
            return Rejection(E.R07, f"tools[{i}].type", {"detail": f"tools of type {t.get('type')!r}"})
    return None


def _parsed(route: str, body: dict[str, Any], stream: bool) -> ParsedRequest:
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
