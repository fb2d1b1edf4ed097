"""Exact prompt token counts for engines whose streams carry no usage (issue 12).

Narwhal streams every engine request, so an engine that omits usage in streams
(llama-cpp-python ignores stream_options.include_usage) leaves the assembled answer's
prompt_tokens to the router (A18). An estimate from bytes leaves out the chat template
(6 where the engine counts 34), so where the engine can count, the router asks it:

  * `tokenize` — the engine's own tokenizer with its chat template applied:
      vLLM and SGLang `POST /tokenize {"model", "messages" | "prompt"}` -> {"count"};
      llama.cpp's server `POST /apply-template {"messages"}` -> {"prompt"}, then
      `POST /tokenize {"content", "add_special": true}` -> {"tokens"}.
  * `tokenize+template` — llama-cpp-python: `POST /extras/tokenize/count {"input"}`
    counts text only; the template's tokens are calibrated at profile time from the
    engine's own non-streaming usage on four message shapes (a base per conversation,
    with and without a leading system message, and a cost per user and assistant
    message), and used only when a fifth shape, held out, comes out exact. Messages the
    calibration does not cover (tools, names, non-text content, a system message not
    first) are not counted this way.
  * `engine-count` — where neither can count this prompt (no tokenizer endpoint, the
    profile not run yet, a shape the calibration does not cover): the engine's own
    non-streaming usage of the same request cut to one output token (`EngineCount`),
    asked while the answer still holds its slot. One more prefill per such answer, cheap
    where the engine caches the prompt it just computed (llama.cpp does); an engine whose
    non-streaming answer carries no usage is not asked again.
  * otherwise the estimate, and the answer says so.

The source of an assembled answer's usage is the response header
`x-narwhal-usage-source`: engine | prefill | tokenize | tokenize+template | estimate.
Every call is bounded (COUNT_TIMEOUT_S, MAX_MESSAGES); a failure falls back to the
estimate, labelled as one.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

import orjson

from .client import EngineClient

__all__ = ["PromptCounter", "CountTarget", "EngineCount", "Provisional", "detect", "COUNT_TIMEOUT_S", "USAGE_SOURCE_HEADER"]

log = logging.getLogger("narwhal")

COUNT_TIMEOUT_S = 2.0  # a count the answer waits for at most this long (then: estimate)
MAX_MESSAGES = 64  # longer conversations are estimated, not counted call by call
USAGE_SOURCE_HEADER = b"x-narwhal-usage-source"

# calibration shapes: (role, content); the last is held out to verify the others
_A = [("user", "What is the capital of France?")]
_D = [("user", "What is the capital of France?"), ("user", "And of Italy?")]
_C = [("user", "What is the capital of France?"), ("assistant", "Paris is the capital of France."), ("user", "And of Italy?")]
_B = [("system", "You answer in one short sentence."), ("user", "What is the capital of France?")]
_V = [("system", "You answer in one short sentence."), ("user", "Name a river."), ("assistant", "The Nile."), ("user", "And a mountain in Japan?")]


@dataclass(frozen=True, slots=True)
class _Template:
    base: int  # a conversation without a system message
    sbase: int  # a conversation opening with a system message (its own tokens included)
    user: int
    assistant: int
    completion: int | None  # /v1/completions: tokens added to the prompt's own


_PROFILING = {"x-narwhal-profiling": "1"}


@dataclass(frozen=True, slots=True)
class CountTarget:
    """The engine a counter talks to: its client, URL, name and served model."""

    client: EngineClient
    url: str
    name: str
    model: str


async def _post(e: CountTarget, path: str, body: dict[str, Any]) -> Any:
    """One router-owned JSON request to the engine; the parsed answer, or ValueError."""
    status, raw = await e.client.post_json(e.url + path, body, headers=_PROFILING)
    if status != 200:
        raise ValueError(f"{path} answered HTTP {status}")
    return orjson.loads(raw)


class PromptCounter:
    """How one engine's prompts are counted: `kind` is "tokenize" or "tokenize+template".
    `facts()` is what another process needs to count the same way (`from_facts`)."""

    def __init__(self, e: CountTarget, kind: str, path: str, template: _Template | None = None) -> None:
        self.e = e
        self.kind = kind
        self.path = path
        self.template = template

    def facts(self) -> list[Any]:
        t = self.template
        return [self.kind, self.path, None if t is None else [t.base, t.sbase, t.user, t.assistant, t.completion]]

    @classmethod
    def from_facts(cls, e: CountTarget, facts: list[Any]) -> PromptCounter:
        kind, path, t = facts
        return cls(e, kind, path, None if t is None else _Template(*t))

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        return await _post(self.e, path, body)

    async def _text(self, text: str) -> int:
        obj = await self._post("/extras/tokenize/count", {"input": text})
        n = obj.get("count") if isinstance(obj, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError("no count")
        return n

    async def _count(self, route: str, body: dict[str, Any]) -> int | None:
        model = self.e.model
        if self.kind == "tokenize":
            if self.path == "/tokenize":
                req = {"model": model, "messages": body["messages"]} if route == "chat" else {"model": model, "prompt": body.get("prompt")}
                obj = await self._post("/tokenize", req)
                n = obj.get("count") if isinstance(obj, dict) else None
                if n is None and isinstance(obj, dict) and isinstance(obj.get("tokens"), list):
                    n = len(obj["tokens"])
                return n if isinstance(n, int) and not isinstance(n, bool) else None
            # llama.cpp's server: the template, then the tokenizer
            if route == "chat":
                obj = await self._post("/apply-template", {"messages": body["messages"]})
                text = obj.get("prompt") if isinstance(obj, dict) else None
            else:
                text = body.get("prompt")
            if not isinstance(text, str):
                return None
            obj = await self._post("/tokenize", {"content": text, "add_special": True})
            toks = obj.get("tokens") if isinstance(obj, dict) else None
            return len(toks) if isinstance(toks, list) else None
        t = self.template
        assert t is not None
        if route != "chat":
            p = body.get("prompt")
            return (await self._text(p)) + t.completion if isinstance(p, str) and t.completion is not None else None
        msgs = body.get("messages")
        if not isinstance(msgs, list) or not msgs or len(msgs) > MAX_MESSAGES:
            return None
        total = 0
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
                return None
            role = m["role"]
            if role == "system" and i == 0:
                continue
            if role not in ("user", "assistant"):
                return None
            total += t.user if role == "user" else t.assistant
        counts = await asyncio.gather(*(self._text(m["content"]) for m in msgs))
        first_system = msgs[0]["role"] == "system"
        return total + sum(counts) + (t.sbase if first_system else t.base)

    async def count(self, route: str, body: dict[str, Any]) -> int | None:
        """The exact prompt tokens of `body`, or None (then the answer's usage is the
        estimate, labelled so)."""
        try:
            async with asyncio.timeout(COUNT_TIMEOUT_S):
                return await self._count(route, body)
        except (TimeoutError, ValueError, KeyError, orjson.JSONDecodeError, OSError) as x:
            log.info("engine %s: prompt count failed (%s); the usage is an estimate", self.e.name, x)
            return None
        except Exception as x:  # noqa: BLE001 - the engine client's errors: an estimate, never a failed request
            log.info("engine %s: prompt count failed (%s: %s); the usage is an estimate", self.e.name, type(x).__name__, x)
            return None


class Provisional:
    """An engine's count before its profile has said how it counts, or where no profile
    runs (issue 40 item 7: engines configured at start begin active, and answers given
    while the first profile ran reported the estimate, 6-10 where the engine counts
    34-38). Tries what `detect` tries first, on the answer's own prompt: the engine's
    /tokenize, then llama.cpp's /apply-template and /tokenize; the first that counts is
    kept, one that answers otherwise is not tried again (so an engine that cannot count
    costs at most two refused calls, once). The template calibration (llama-cpp-python)
    needs the profile. `kind`: the way that counted, for x-narwhal-usage-source."""

    def __init__(self, e: CountTarget) -> None:
        self.e = e
        self.kind = "tokenize"
        self.found: PromptCounter | None = None
        self.refused: set[str] = set()

    async def count(self, route: str, body: dict[str, Any]) -> int | None:
        if self.found is not None:
            return await self.found.count(route, body)
        for path in ("/tokenize", "/apply-template"):
            if path in self.refused:
                continue
            pc = PromptCounter(self.e, "tokenize", path)
            try:
                async with asyncio.timeout(COUNT_TIMEOUT_S):
                    n = await pc._count(route, body)
            except TimeoutError:
                return None  # slow, not unable: tried again next time
            except Exception as x:  # noqa: BLE001 - no such endpoint, or not this shape
                log.debug("engine %s: %s does not count (%s)", self.e.name, path, x)
                n = None
            if n is not None:
                self.found = pc
                return n
            self.refused.add(path)
        return None


class EngineCount:
    """The last way to count a prompt exactly (module docstring, `engine-count`): the
    same request, non-streaming, one output token, its `usage.prompt_tokens`. Invariant:
    once the engine answered without a usable count (no usage, an error status, not
    JSON) it is never asked again (`unable`); a timeout is slowness, tried next time."""

    kind = "engine-count"

    def __init__(self, e: CountTarget) -> None:
        self.e = e
        self.unable = False

    async def count(self, route: str, body: dict[str, Any]) -> int | None:
        if self.unable:
            return None
        req = {k: v for k, v in body.items() if k not in _NOT_FOR_A_COUNT}
        req.update(model=self.e.model, stream=False, max_tokens=1, n=1)
        if "max_completion_tokens" in body:
            req["max_completion_tokens"] = 1
        path = "/v1/chat/completions" if route == "chat" else "/v1/completions"
        try:
            async with asyncio.timeout(COUNT_TIMEOUT_S):
                obj = await _post(self.e, path, req)
        except TimeoutError:
            return None
        except Exception as x:  # noqa: BLE001 - an error status or not JSON: not this way
            log.info("engine %s: its non-streaming answer does not count the prompt (%s); the usage is an estimate", self.e.name, x)
            self.unable = True
            return None
        n = ((obj if isinstance(obj, dict) else {}).get("usage") or {}).get("prompt_tokens")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            self.unable = True
            return None
        return n


# the request's keys a one-token count does without: streaming, sampling of many, logprobs
_NOT_FOR_A_COUNT = frozenset({"stream", "stream_options", "n", "best_of", "logprobs", "top_logprobs", "echo", "max_tokens", "max_completion_tokens"})


async def _usage_of(e: CountTarget, shape: list[tuple[str, str]]) -> int:
    body = {"model": e.model, "messages": [{"role": r, "content": c} for r, c in shape], "max_tokens": 1, "temperature": 0, "stream": False}
    pt = ((await _post(e, "/v1/chat/completions", body) or {}).get("usage") or {}).get("prompt_tokens")
    if not isinstance(pt, int) or isinstance(pt, bool):
        raise ValueError("the engine's non-streaming answer has no usage.prompt_tokens")
    return pt


async def _calibrate(e: CountTarget) -> _Template | None:
    probe = PromptCounter(e, "tokenize+template", "/extras/tokenize/count")
    try:
        await probe._text("hello")
    except Exception:  # noqa: BLE001 - no such endpoint
        return None

    async def m(shape: list[tuple[str, str]]) -> int:
        used = await _usage_of(e, shape)
        return used - sum([await probe._text(c) for _, c in shape])

    ma, md, mc, mb, mv = [await m(s) for s in (_A, _D, _C, _B, _V)]
    user = md - ma
    base = ma - user
    assistant = mc - base - 2 * user
    sbase = mb - user
    if mv != sbase + 2 * user + assistant or min(user, assistant, base, sbase) < 0:
        log.info("engine %s: the chat template's tokens do not add up (held-out shape %d, predicted %d); prompt usage stays an estimate", e.name, mv, sbase + 2 * user + assistant)
        return None
    completion = None
    try:
        body = {"model": e.model, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "stream": False}
        pt = ((await _post(e, "/v1/completions", body) or {}).get("usage") or {}).get("prompt_tokens")
        if isinstance(pt, int):
            completion = pt - await probe._text("The capital of France is")
    except Exception:  # noqa: BLE001 - completions unsupported: chat only
        completion = None
    return _Template(base, sbase, user, assistant, completion)


async def detect(e: CountTarget) -> PromptCounter | None:
    """Which way, if any, this engine can count prompts exactly (run at profile time, for
    an engine whose streams carried no usage)."""
    model = e.model
    msgs = [{"role": r, "content": c} for r, c in _A]
    # (path, body, the answer's field that shows the endpoint works, and its type)
    for path, body, key, kind in (("/tokenize", {"model": model, "messages": msgs}, "count", int), ("/apply-template", {"messages": msgs}, "prompt", str)):
        try:
            obj = await _post(e, path, body)
        except Exception as x:  # noqa: BLE001 - an engine without this endpoint
            log.debug("engine %s: no %s endpoint (%s)", e.name, path, x)
            continue
        if isinstance(obj, dict) and isinstance(obj.get(key), kind):
            return PromptCounter(e, "tokenize", path)
    try:
        t = await _calibrate(e)
    except Exception as x:  # noqa: BLE001
        log.info("engine %s: template calibration failed (%s); prompt usage stays an estimate", e.name, x)
        return None
    return PromptCounter(e, "tokenize+template", "/extras/tokenize/count", t) if t is not None else None
