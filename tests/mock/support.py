"""Test equipment for the mock-engine tests: an SSE client with bounded waits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import httpx
import orjson

from tests.helpers import wait_until

__all__ = ["Streamed", "sse", "post", "get", "chat_body", "completion_body", "wait_until", "classify", "request", "MODEL"]

MODEL = "narwhal-demo"
TIMEOUT = httpx.Timeout(5.0)
# One pooled client for the whole run: creating an httpx.Client costs ~30 ms (SSL context).
_CLIENT = httpx.Client(timeout=TIMEOUT, limits=httpx.Limits(max_connections=64))


@dataclass
class Streamed:
    status: int
    headers: dict[str, str]
    events: list[Any] = field(default_factory=list)  # parsed JSON, or the raw str when not JSON
    done: bool = False  # saw data: [DONE]
    error: Exception | None = None  # transport error while reading the body
    arrivals: list[float] = field(default_factory=list)  # seconds since the request, per event
    body: bytes = b""

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [e for e in self.events if isinstance(e, dict)]


def sse(url: str, body: dict[str, Any], *, path: str = "/v1/chat/completions", headers: dict[str, str] | None = None, timeout: Any = TIMEOUT, client: httpx.Client | None = None) -> Streamed:
    """POST and read an SSE answer to the end (or to a transport error)."""
    t0 = time.monotonic()
    c = client or _CLIENT
    with c.stream("POST", url + path, json=body, headers=headers, timeout=timeout) as r:
        out = Streamed(r.status_code, dict(r.headers))
        if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
            out.body = r.read()
            return out
        try:
            for line in r.iter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                data = line[6:]
                out.arrivals.append(time.monotonic() - t0)
                if data == "[DONE]":
                    out.done = True
                    continue
                try:
                    out.events.append(orjson.loads(data))
                except orjson.JSONDecodeError:
                    out.events.append(data)
        except httpx.HTTPError as e:
            out.error = e
        return out


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
