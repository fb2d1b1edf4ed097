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
