"""Prefix-cache awareness through the router (issue 15): a conversation's second turn is
projected with its cached history, placed where that history lives, and the router's
expectation (x-narwhal-expected-cached-tokens) matches what the engine reports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import RunningRouter, running_router, wait_until

MODEL = "narwhal-demo"
SYSTEM = "You are a helpful narwhal who answers questions about the Arctic ocean in some detail. " * 12


def turn1() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How long is a narwhal's tusk?"}]


def turn2(answer: str) -> list[dict[str, Any]]:
    return [*turn1(), {"role": "assistant", "content": answer}, {"role": "user", "content": "And how heavy is it?"}]


def cfg(mode: str) -> dict[str, Any]:
    return {"serving": {"model": MODEL}, "admission": {"mode": "predictive", "ttft_budget_ms": 60000, "prediction": {"profile_on_start": False, "prefix_cache": mode}}}


def ask(rr: RunningRouter, msgs: list[dict[str, Any]]) -> tuple[httpx.Response, dict[str, Any]]:
    r = rr.post("/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 8})
    assert r.status_code == 200, r.text
    return r, r.json()


def cached(usage: dict[str, Any]) -> int:
    d = usage.get("prompt_tokens_details")
    return d["cached_tokens"] if isinstance(d, dict) else 0  # vLLM leaves a zero out


def served_by(mocks: list[RunningMock]) -> list[int]:
    return [len(m.requests()) for m in mocks]


@pytest.fixture
def fleet() -> Iterator[list[RunningMock]]:
    t = Timing(time_scale=0.01)
    cfgs = [MockConfig(dialect="vllm", role="unified", model=MODEL, name=f"u{i}", timing=t, prefix_cache_tokens=1 << 16,
                       kv_events="tcp://127.0.0.1:*") for i in range(2)]
    with running_fleet(cfgs) as mocks:
        yield mocks


def test_approximate_the_second_turn_goes_where_its_history_is(fleet: list[RunningMock]) -> None:
    specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None) for m in fleet]
    with running_router(cfg("approximate"), specs) as rr:
        r1, a1 = ask(rr, turn1())
        first = served_by(fleet)
        assert int(r1.headers["x-narwhal-expected-cached-tokens"]) == 0
        r2, a2 = ask(rr, turn2(a1["choices"][0]["message"]["content"]))
        second = served_by(fleet)
        went = [b - a for a, b in zip(first, second, strict=True)]
        assert went == [1 if f else 0 for f in first]  # the engine that served turn 1
        expected, reported = int(r2.headers["x-narwhal-expected-cached-tokens"]), cached(a2["usage"])
        assert reported > 0 and expected > 0
        # the approximate index counts ~64-token blocks of the rendered prompt: within two of them
        assert abs(expected - reported) <= 128, (expected, reported)
        eng = rr.get("/v1/engines").json()["data"]
        assert sum(e["prefix_cache"]["blocks"] for e in eng) > 0 and all(e["prefix_cache"]["kind"] == "approximate" for e in eng)
        assert "narwhal_prefix_index_blocks" in rr.get("/metrics").text
        rr.balanced()


def test_events_the_expectation_is_the_engines_own_count(fleet: list[RunningMock]) -> None:
    specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None, kv_events=m.stats()["prefix_cache"]["kv_events"]) for m in fleet]
    with running_router(cfg("auto"), specs) as rr:
        wait_until(lambda: all(e["prefix_cache"]["kind"] == "events" for e in rr.get("/v1/engines").json()["data"]), timeout=5, what="events indexes")
        r1, a1 = ask(rr, turn1())
        # the engine's BlockStored reaches the router's index
        wait_until(lambda: sum(e["prefix_cache"]["blocks"] for e in rr.get("/v1/engines").json()["data"]) > 0, timeout=5, what="KV events")
        r2, a2 = ask(rr, turn2(a1["choices"][0]["message"]["content"]))
        expected, reported = int(r2.headers["x-narwhal-expected-cached-tokens"]), cached(a2["usage"])
        assert reported > 0 and expected == reported
        eng = rr.get("/v1/engines").json()["data"]
        assert all(e["prefix_cache"]["events"]["malformed"] == 0 for e in eng)
        rr.balanced()


def test_off_projects_every_prompt_at_full_length(fleet: list[RunningMock]) -> None:
    specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None) for m in fleet]
    with running_router(cfg("off"), specs) as rr:
        _, a1 = ask(rr, turn1())
        r2, _ = ask(rr, turn2(a1["choices"][0]["message"]["content"]))
        assert int(r2.headers["x-narwhal-expected-cached-tokens"]) == 0
        assert all(e["prefix_cache"] is None for e in rr.get("/v1/engines").json()["data"])
