"""The router's threat model, usage counted by the engine (issue 40 item 7): a client must
not be able to have its prompt reported under what the engine counted (usage is what an
operator bills and limits by) by timing its requests into an engine's first profile.

As found: behind an engine configured at start (active at once, its first profile still
running) non-streaming answers from streams without usage reported the router's estimate
(6-10 prompt tokens where llama.cpp counted 34-38). The attack here: a dense prompt
(digits and CJK; an engine whose tokens are shorter than the router's starting estimate
of 4 bytes) sent on both completion routes as soon as the router is up, on a slow engine
whose profile takes seconds, each answer's stream without usage. Every answer reports
the engine's own count and says so (x-narwhal-usage-source: tokenize); before, each said
`estimate` (the mock's numbers happen to agree with the router's sizing; llama.cpp's did
not)."""

from __future__ import annotations

from typing import Any

import httpx

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import running_router

DENSE = "0123456789 " * 12 + "東京都の人口は約千四百万人です。" * 4
ROUTES = [  # (path, the request's prompt, the same prompt as the engine's /tokenize takes it)
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": DENSE}]}, {"messages": [{"role": "user", "content": DENSE}]}),
    ("/v1/completions", {"prompt": DENSE}, {"prompt": DENSE}),
]


def test_answers_timed_into_the_first_profile_report_the_engines_count_not_an_estimate() -> None:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", model="narwhal-demo", timing=Timing(time_scale=1.0), bytes_per_token=1.5)]) as (m,):
        exact = [httpx.post(m.url + "/tokenize", json={"model": "narwhal-demo", **tok}, timeout=10).json()["count"] for _, _, tok in ROUTES]
        cfg: dict[str, Any] = {"admission": {"mode": "open", "prediction": {"profile_on_start": True}}, "monitoring": {"poll_interval_ms": 200}}
        with running_router(cfg, [EngineSpec("u0", m.url, "unified", "vllm", None, None)], wait_profiled=False) as rr:
            got = []
            for path, prompt, _ in ROUTES * 2:
                r = httpx.post(rr.url + path, timeout=30, json={"model": "narwhal-demo", **prompt, "max_tokens": 4, "mock": {"usage": False, "tokens": 4}})
                assert r.status_code == 200, r.text
                got.append((r.headers.get("x-narwhal-usage-source"), r.json()["usage"]["prompt_tokens"]))
            status = [e["profile"]["status"] for e in rr.get("/v1/engines").json()["data"]]
    assert got == [("tokenize", exact[0]), ("tokenize", exact[1])] * 2, (got, exact, status)
    assert status != ["ok"], status  # the answers came while the first profile still ran
