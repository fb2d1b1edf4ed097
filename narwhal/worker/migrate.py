"""Stream migration in the data plane (issue 24; spec/tables/migration.yaml G01-G13).

The decision and the continuation are sans-IO (narwhal/core/migration.py); this module
gathers what they need from a request's run and talks to the engines for it:

  * `progress`: what the relay recorded (core/migration.Recorder) as a `Progress`;
  * `prompt_ids`: the prompt's token IDs as the failed engine saw them — the IDs the
    engine returned on its stream (vLLM: `prompt_token_ids` on the first event), else the
    request's own token-ID prompt, else the new engine's `/tokenize` with the same chat
    template (bounded by upstream.migration.tokenize_timeout_ms); None: G10;
  * `prepare`: the continuation's engine body and its `Rejoin`, once admission placed it.

Invariants
  * Nothing here runs unless upstream.migration.max_attempts > 0: with the default every
    existing row is unchanged (G01), and the relay keeps no recorder.
  * The continuation is a streaming completions request whatever the client's route; the
    client sees its own route's shape through `Rejoin` (one id, usage counted once).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from ..core.dialects import DIALECTS, decode_body
from ..core.migration import Progress, Recorder, Rejoin, continuation
from ..core.requests import ParsedRequest
from ..upstream.client import EngineClient, UpstreamError
from ..upstream.engines import EngineSpec

__all__ = ["Cont", "progress", "prompt_ids", "prepare", "finish", "MIGRATIONS_COMMENT"]

log = logging.getLogger("narwhal")

# the SSE comment a migrated stream carries before `data: [DONE]` (clients ignore comments)
MIGRATIONS_COMMENT = b": x-narwhal-migrations %d\n\n"


@dataclass(frozen=True, slots=True)
class Cont:
    """A continuation ready to send: the engine body and the stream's translation."""

    body: dict[str, Any]
    rejoin: Rejoin


def progress(rec: Recorder | None, *, attempts: int, deadline_left_ms: float | None, max_tokens: int | None = None) -> Progress:
    if rec is None:
        return Progress(output_ids=(), text="", plain=True, attempts=attempts, deadline_left_ms=deadline_left_ms, max_tokens=max_tokens)
    return Progress(output_ids=tuple(rec.output_ids), text=rec.tail, plain=rec.plain, attempts=attempts, deadline_left_ms=deadline_left_ms,
                    max_tokens=max_tokens)


def finish(req: ParsedRequest, rec: Recorder, model: str, *, prompt_tokens: int, finish_sent: bool) -> bytes:
    """The end of a stream whose output already holds max_tokens tokens (G13): the last
    event with finish_reason length (unless the engine's own was relayed), the usage
    chunk when the client asked for it, and `data: [DONE]`, in the client's stream's
    shape (through a Rejoin, as a continuation's events would be)."""
    out = len(rec.output_ids)
    j = Rejoin(route=req.route, id=rec.id or "", created=rec.created or 0, model=rec.model or model, prompt_tokens=prompt_tokens, before=out)
    events = [] if finish_sent else [j.event({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})]
    if req.client_usage:
        events.append(j.event({"choices": [], "usage": {"completion_tokens": 0}}))
    return b"".join(b"data: " + orjson.dumps(ev) + b"\n\n" for ev in events) + b"data: [DONE]\n\n"


def _own_prompt(req: ParsedRequest) -> list[int] | None:
    """A completions request's token-ID prompt (one list of ints)."""
    if req.route != "completion":
        return None
    p = req.body.get("prompt")
    if isinstance(p, list) and p and all(type(x) is int and x >= 0 for x in p):
        return list(p)
    return None


async def _tokenize(client: EngineClient, e: EngineSpec, req: ParsedRequest, model: str, timeout_s: float) -> list[int] | None:
    """The new engine's `/tokenize` (vLLM, SGLang): the prompt with its chat template."""
    if req.route == "chat":
        body: dict[str, Any] = {"model": model, "messages": req.body.get("messages"), "add_generation_prompt": True}
        for k in ("chat_template", "chat_template_kwargs"):
            if k in req.body:
                body[k] = req.body[k]
    else:
        body = {"model": model, "prompt": req.body.get("prompt")}
    try:
        async with asyncio.timeout(timeout_s):
            status, raw = await client.post_json(e.url + "/tokenize", body, headers={"x-narwhal-profiling": "1"})
    except (TimeoutError, UpstreamError) as x:
        log.info("migration: /tokenize on %s: %s", e.name, x)
        return None
    if status != 200:
        return None
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    toks = obj.get("tokens") if isinstance(obj, dict) else None
    if isinstance(toks, list) and toks and all(type(x) is int and x >= 0 for x in toks):
        return toks
    return None


async def prompt_ids(client: EngineClient, e: EngineSpec, req: ParsedRequest, rec: Recorder, model: str, timeout_s: float) -> list[int] | None:
    """The prompt's token IDs (module rules), or None."""
    got = rec.valid_prompt()
    if got is not None:
        return got
    own = _own_prompt(req)
    if own is not None:
        return own
    return await _tokenize(client, e, req, model, timeout_s)


def prepare(req: ParsedRequest, body: dict[str, Any], e: EngineSpec, model: str, rec: Recorder, prompt: list[int], *,
            prompt_tokens: int, cached_tokens: int | None, max_event_bytes: int) -> Cont | None:
    """The continuation for engine `e`; None when nothing is left to generate."""
    out = rec.output_ids
    if req.max_tokens is not None and len(out) >= req.max_tokens:
        return None
    cbody = continuation(body, max_tokens=req.max_tokens, prompt_ids=prompt, output_ids=out.tolist())
    cbody = decode_body(cbody, dialect=e.dialect, model=model)
    assert DIALECTS[e.dialect].token_accounting == "token_ids"
    rejoin = Rejoin(route=req.route, id=rec.id or "", created=rec.created or 0, model=rec.model or model,
                    prompt_tokens=prompt_tokens, before=len(out), cached_tokens=cached_tokens, max_event_bytes=max_event_bytes)
    return Cont(cbody, rejoin)
