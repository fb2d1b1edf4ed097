"""Test equipment for the mock-engine tests: an SSE client with bounded waits."""

from __future__ import annotations

from typing import Any

import httpx

from tests.helpers import Streamed, wait_until
from tests.helpers import sse as _sse

__all__ = ["Streamed", "sse", "post", "get", "chat_body", "completion_body", "wait_until", "classify", "request", "MODEL"]

MODEL = "narwhal-demo"
TIMEOUT = httpx.Timeout(5.0)
# One pooled client for the whole run: creating an httpx.Client costs ~30 ms (SSL context).
_CLIENT = httpx.Client(timeout=TIMEOUT, limits=httpx.Limits(max_connections=64))


def sse(url: str, body: dict[str, Any], *, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None, timeout: Any = TIMEOUT, client: httpx.Client | None = None) -> Streamed:
    """tests.helpers.sse on the run's pooled client. `Streamed.events` holds every event,
    the engine's error events included; `chunks` leaves those out."""
    return _sse(url, body, path=path, headers=headers, timeout=timeout, client=client or _CLIENT)


def post(url: str, body: Any, *, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None, timeout: Any = TIMEOUT) -> httpx.Response:
    return _CLIENT.post(url + path, json=body, headers=headers, timeout=timeout)


def get(url: str, **kw: Any) -> httpx.Response:
    return _CLIENT.get(url, **kw)


def request(method: str, url: str, **kw: Any) -> httpx.Response:
    return _CLIENT.request(method, url, **kw)


def chat_body(text: str = "Hello there", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], **kw}


def completion_body(prompt: Any = "Once upon a time", **kw: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, **kw}


def classify(chunk: dict[str, Any]) -> str:
    """A chunk's kind, for comparing key sets with the fixtures."""
    choices = chunk.get("choices")
    if choices == []:
        return "usage"
    c = choices[0]
    if c.get("finish_reason") is not None:
        return "finish"
    if "text" in c:  # completions
        return "first" if c.get("prompt_token_ids") is not None else "text"
    d = c.get("delta", {})
    if "role" in d and d.get("role") is not None:
        return "role"
    if d.get("tool_calls"):
        return "tool_open" if any(tc.get("function", {}).get("name") for tc in d["tool_calls"]) else "tool_args"
    if d.get("reasoning") or d.get("reasoning_content"):
        return "reasoning"
    if d.get("refusal"):
        return "refusal"
    if d.get("content"):
        return "content"
    return "empty"
