"""Usage exact from the first answer (issue 40 item 7): an engine configured at start
begins active while its first profile runs; a non-streaming answer it gives meanwhile,
from a stream that carried no usage, reported the router's estimate although the engine
can count (behind llama.cpp: 6-10 where the engine counted 34-38). Now the answer is
counted by the engine itself (x-narwhal-usage-source: tokenize), profile or not."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router

MSGS = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name the three largest moons of Jupiter, please."}]


@pytest.mark.parametrize("mode", ["predictive", "open"])
def test_answers_while_the_first_profile_runs_report_the_engines_count(mode: str) -> None:
    # a slow engine (its profile, predictive, takes seconds: the answers below come first)
    # whose tokenizer is not the router's estimate (1.5 bytes a token)
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", model="narwhal-demo", timing=Timing(time_scale=1.0), bytes_per_token=1.5)]) as (m,):
        exact = httpx.post(m.url + "/tokenize", json={"model": "narwhal-demo", "messages": MSGS}, timeout=10).json()["count"]
        cfg: dict[str, Any] = {"admission": {"mode": mode, "prediction": {"profile_on_start": True}}, "monitoring": {"poll_interval_ms": 200}}
        with running_router(cfg, [EngineSpec("u0", m.url, "unified", "vllm", None, None)]) as rr:
            got = []
            for _ in range(4):
                r = httpx.post(rr.url + "/v1/chat/completions", timeout=30,
                               json={"model": "narwhal-demo", "messages": MSGS, "mock": {"usage": False, "tokens": 4}})
                assert r.status_code == 200, r.text
                got.append((r.headers.get("x-narwhal-usage-source"), r.json()["usage"]["prompt_tokens"]))
            profiled = [e["profile"]["status"] for e in rr.get("/v1/engines").json()["data"]]
    assert got == [("tokenize", exact)] * 4, (got, exact, profiled)


@pytest.mark.parametrize("mode", ["predictive", "open"])
def test_an_engine_without_a_tokenizer_counts_by_its_own_non_streaming_usage(mode: str) -> None:
    # llama-cpp-python as the issue met it: its streams carry no usage and it has no
    # /tokenize nor /apply-template (the openai dialect's mock has neither), so neither
    # the provisional counter nor the profile's detection can count; its non-streaming
    # answer does count, and is asked (x-narwhal-usage-source: engine-count), before the
    # profile and after it
    with running_fleet([MockConfig(dialect="openai", role="unified", name="u0", model="narwhal-demo", timing=Timing(time_scale=1.0), bytes_per_token=1.5)]) as (m,):
        direct = httpx.post(m.url + "/v1/chat/completions", timeout=10, json={"model": "narwhal-demo", "messages": MSGS, "max_tokens": 1})
        exact = direct.json()["usage"]["prompt_tokens"]
        cfg: dict[str, Any] = {"admission": {"mode": mode, "prediction": {"profile_on_start": True}}, "monitoring": {"poll_interval_ms": 200}}
        with running_router(cfg, [EngineSpec("u0", m.url, "unified", "openai", None, None)], wait_profiled=False) as rr:
            got, statuses = [], []
            for i in range(5):
                if i == 4:
                    rr.call(rr.router.wait_profiled)
                statuses.append(rr.get("/v1/engines").json()["data"][0]["profile"]["status"])
                r = httpx.post(rr.url + "/v1/chat/completions", timeout=30,
                               json={"model": "narwhal-demo", "messages": MSGS, "mock": {"usage": False, "tokens": 4}})
                assert r.status_code == 200, r.text
                got.append((r.headers.get("x-narwhal-usage-source"), r.json()["usage"]["prompt_tokens"]))
            rr.balanced()
    assert got == [("engine-count", exact)] * 5, (got, exact, statuses)
    if mode == "predictive":
        assert statuses[0] == "running" and statuses[4] == "ok", statuses


class _Answers:
    """An engine client answering every POST with one fixed (status, body)."""

    def __init__(self, status: int, body: bytes) -> None:
        self.status, self.body, self.calls = status, body, 0

    async def post_json(self, url: str, body: Any, headers: Any = None) -> tuple[int, bytes]:
        self.calls += 1
        assert body["stream"] is False and body["max_tokens"] == 1 and "stream_options" not in body and body["model"] == "m"
        return self.status, self.body


@pytest.mark.parametrize(("status", "body", "want", "asked_again"), [
    (200, b'{"usage": {"prompt_tokens": 34, "completion_tokens": 1}}', 34, True),
    (200, b'{"choices": []}', None, False),  # no usage: never asked again
    (200, b'{"usage": {"prompt_tokens": "34"}}', None, False),
    (400, b'{"error": {}}', None, False),
    (200, b"not json", None, False),
])
def test_engine_count_asks_until_the_engine_cannot(status: int, body: bytes, want: int | None, asked_again: bool) -> None:
    import asyncio

    from narwhal.upstream.usage import CountTarget, EngineCount

    client = _Answers(status, body)
    ec = EngineCount(CountTarget(client, "http://e", "e", "m"))  # type: ignore[arg-type]
    req = {"model": "x", "messages": MSGS, "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 50, "n": 2}
    assert asyncio.run(ec.count("chat", req)) == want
    assert asyncio.run(ec.count("chat", req)) == want
    assert client.calls == (2 if asked_again else 1)
