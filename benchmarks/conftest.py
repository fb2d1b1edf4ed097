"""Microbenchmarks of the router's hot path (pytest-benchmark). Not part of the default
test run (pyproject testpaths = tests); run them with

    pytest benchmarks --benchmark-only            (or: tox -e bench)

Each benchmark records what one round is (events, requests, decisions) in extra_info,
so per-item rates can be read from the JSON (--benchmark-json FILE).
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest


def vllm_chunk(i: int, *, ids: bool = True, text: str = "tok ") -> dict[str, Any]:
    """One vLLM streaming chat chunk carrying one token (as a real engine sends it)."""
    ch: dict[str, Any] = {"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}
    if ids:
        ch["token_ids"] = [100 + i % 800]
    return {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1764633600, "model": "narwhal-demo", "choices": [ch]}


def sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


@pytest.fixture
def chunks() -> list[dict[str, Any]]:
    """A 1,000-token streamed answer: role chunk, 1,000 content chunks, finish, usage."""
    out = [{"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]}]
    out += [vllm_chunk(i) for i in range(1000)]
    last = vllm_chunk(1000)
    last["choices"][0]["finish_reason"] = "stop"
    out.append(last)
    out.append({"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo", "choices": [],
                "usage": {"prompt_tokens": 12, "completion_tokens": 1001, "total_tokens": 1013}})
    return out
