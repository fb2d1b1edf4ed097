"""A completion request as a mock engine reads it: the checks it refuses on (`Refusal`,
in the engine's order: request shape, then dialect rules; app.py runs them after JSON,
model and the `mock` options), and what it asks of its answer's shape (`reply_for`).
"""

from __future__ import annotations

import time
from typing import Any

from . import wire
from .config import MockConfig
from .scenarios import PIECE_FAULTS, TOOL_FAULTS, TOOL_OPEN, Behaviour, Script

__all__ = ["Refusal", "max_tokens_of", "validate", "reply_for"]

_SGLANG_STREAM_IDS = "return_token_ids is not supported with streaming on /v1/chat/completions. Please set stream=false when using return_token_ids=true."


class Refusal(Exception):
    """A completion request the engine refuses: its status, message, param and code, in
    the dialect's error envelope (wire.error_body)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def max_tokens_of(route: str, body: dict[str, Any]) -> int | None:
    """The request's output limit (chat: max_completion_tokens before max_tokens), at
    least 1, or None when it sets none."""
    keys = ("max_completion_tokens", "max_tokens") if route == "chat" else ("max_tokens",)
    for k in keys:
        v = body.get(k)
        if v is None:
            continue
        if type(v) is not int or v < 1:
            raise Refusal(400, f"{k} must be at least 1, got {v!r}.", k)
        return v
    return None


def validate(cfg: MockConfig, route: str, body: dict[str, Any]) -> None:
    """The request's shape (messages or prompt, stream, stream_options), then the
    dialect's own rules (vLLM: stream_options only with stream; SGLang: no token IDs on a
    streamed chat)."""
    if route == "chat":
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise Refusal(400, "messages must be a non-empty list of message objects", "messages")
    elif not isinstance(body.get("prompt"), (str, list)):
        raise Refusal(400, "prompt must be a string, a list of strings or a list of token IDs", "prompt")
    if "stream" in body and type(body["stream"]) is not bool:
        raise Refusal(400, "stream must be a boolean", "stream")
    stream = body.get("stream") is True
    so = body.get("stream_options")
    if so is not None and not isinstance(so, dict):
        raise Refusal(400, "stream_options must be an object", "stream_options")
    if cfg.dialect == "vllm" and so is not None and not stream:
        raise Refusal(400, "Stream options can only be defined when `stream=True`.", "stream_options")
    if cfg.dialect == "sglang" and route == "chat" and stream and body.get("return_token_ids") is True:
        raise Refusal(400, _SGLANG_STREAM_IDS, "return_token_ids")  # docs/engines.md pitfall 5


def reply_for(cfg: MockConfig, route: str, body: dict[str, Any], beh: Behaviour, fault: str | None, xrid: str | None, script: Script, n_prompt: int, prompt_ids: list[int] | None, stream: bool, kv_out: dict[str, Any] | None) -> wire.Reply:
    """The answer's shape as the request asks it of this dialect: token IDs, logprobs,
    usage (stream_options; a mock option may force it), obfuscation, quirks and faults."""
    d = cfg.dialect
    so = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else None
    want_ids = body.get("return_token_ids") is True
    hide = d == "vllm" and route == "chat" and body.get("include_reasoning") is False
    if d == "vllm":
        # docs/engines.md pitfall 4: include_reasoning false hides IDs and logprobs as well
        ids = want_ids and not hide
    elif d == "sglang":
        ids = want_ids and (route == "completions" or not stream)
    else:
        ids = False
    if route == "chat":
        k = body.get("top_logprobs")
        on = (body.get("logprobs") is True or beh.logprobs) and not hide
        logprobs = max(1, k if type(k) is int else 0) if on else None
    else:
        lp = body.get("logprobs")
        if type(lp) is int or lp is True or beh.logprobs:
            logprobs = max(1, lp if type(lp) is int else 1)
        else:
            logprobs = None
    usage = continuous = False
    if so is not None:
        if d == "vllm":
            usage = so.get("include_usage", True) is not False  # default true once sent
            continuous = usage and so.get("continuous_usage_stats") is True
        else:
            usage = so.get("include_usage") is True
            continuous = d == "sglang" and so.get("continuous_usage_stats") is True
    if beh.usage is not None:
        usage = beh.usage
    tool_fault = None
    if fault in TOOL_FAULTS:
        opens = [p for i, p in enumerate(script.pieces) if p.kind == TOOL_OPEN and i >= beh.fault_after]
        opens = opens or [p for p in script.pieces if p.kind == TOOL_OPEN]
        tool_fault = (fault, opens[0].index) if opens else None
    return wire.Reply(
        dialect=d,
        route=route,
        scenario=beh.scenario,
        id=wire.new_id(d, route, xrid),
        created=int(time.time()),
        model=cfg.model,
        prompt_tokens=n_prompt,
        prompt_ids=prompt_ids if prompt_ids is not None else [],
        script=script,
        ids=ids,
        logprobs=logprobs,
        usage=usage,
        continuous_usage=continuous,
        usage_null=d == "openai" and usage,
        obfuscation=not (so is not None and so.get("include_obfuscation") is False),
        quirks=cfg.quirks | beh.quirks,
        piece_fault=fault if (fault in PIECE_FAULTS and not stream) else None,
        tool_fault=tool_fault,
        no_finish_reason=fault == "no_finish_reason",
        kv_transfer_params=kv_out,
    )
