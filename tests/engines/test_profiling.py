"""Profiling that works on real models (issue 12): an EOS-first answer is still a TTFT
sample, a failing profile backs off and says so once (WARNING per status change, /metrics,
/ready, /v1/engines), engines[].max_concurrency holds for client and profiling traffic
alike, and the prompts are words, distinct per measurement."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import orjson
import pytest

from narwhal.authority.profiler import _prompt
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.abuse.rawengine import SSE_HEAD, Request, chunk, raw_engine
from tests.helpers import running_router, wait_until

PROFILE = {"profile_on_start": True, "profile_prompt_tokens": [16, 32, 64], "profile_repeats": 1, "profile_output_tokens": 4}


def cfg(**prediction: Any) -> dict[str, Any]:
    return {
        "admission": {"mode": "predictive", "prediction": {**PROFILE, **prediction}},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
    }


def _ev(delta: dict[str, Any], finish: str | None = None) -> bytes:
    ev = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo",
          "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
    return b"data: " + orjson.dumps(ev) + b"\n\n"


async def _eos_first(req: Request, w: asyncio.StreamWriter) -> None:
    """llama-cpp-python when a small instruct model ends at once: a role chunk, then the
    finish with no content, no usage in the stream."""
    events = [_ev({"role": "assistant", "content": ""}), _ev({}, "stop"), b"data: [DONE]\n\n"]
    w.write(SSE_HEAD + b"".join(chunk(e) for e in events) + b"0\r\n\r\n")


async def _always_500(req: Request, w: asyncio.StreamWriter) -> None:
    body = b'{"error":{"message":"boom"}}'
    w.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


@pytest.fixture
def narwhal_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.INFO, logger="narwhal")
    yield caplog


def test_an_eos_first_answer_is_a_ttft_sample() -> None:
    with raw_engine(_eos_first) as eng, running_router(cfg(), [EngineSpec("u0", eng.url, "unified", "openai", None, None)]) as rr:
        (view,) = rr.get("/v1/engines").json()["data"]
    assert view["profile"]["status"] == "ok", view["profile"]
    samples = view["profile"]["measurements"]["prefill_ms_by_prompt_tokens"]
    assert [n for n, _ in samples] == [16, 32, 64] and all(ms > 0 for _, ms in samples)
    assert view["profile"]["measurements"]["tpot_ms_by_batch"] == []  # no token: no TPOT


def test_a_failing_profile_backs_off_and_warns_once_per_status_change(narwhal_log: pytest.LogCaptureFixture) -> None:
    with raw_engine(_always_500) as eng, running_router(cfg(), [EngineSpec("u0", eng.url, "unified", "openai", None, None)]) as rr:
        router = rr.router
        e = router.engines["u0"]
        assert e.profile_status == "failed" and e.profile_failures == 1
        waits = [router.profile_retry_s(e)]
        for _ in range(2):  # two more failures, run at once rather than waiting the back-off
            rr.call(lambda: _profile(router, e))
            waits.append(router.profile_retry_s(e))
        assert waits == [30.0, 60.0, 120.0]
        e.profile_failures = 20
        assert router.profile_retry_s(e) == 600.0  # capped
        e.profile_failures = 3
        (view,) = rr.get("/v1/engines").json()["data"]
        assert view["profile"]["status"] == "failed" and view["profile"]["consecutive_failures"] == 3
        assert 0 < view["profile"]["next_retry_s"] <= 120.0
        assert rr.get("/ready").json()["unprofiled_engines"] == ["u0"]
        metrics = rr.get("/metrics").text
        assert 'narwhal_engine_profile_status{engine="u0",status="failed"} 1.0' in metrics
        assert 'narwhal_engine_profile_status{engine="u0",status="ok"} 0.0' in metrics
        # the engine recovers: one WARNING for that change too
        eng.answer = _eos_first
        rr.call(lambda: _profile(router, e))
        assert e.profile_status == "ok" and e.profile_failures == 0
        assert "unprofiled_engines" not in rr.get("/ready").json()
    warnings = [r.getMessage() for r in narwhal_log.records if r.levelno >= logging.WARNING and "profil" in r.getMessage()]
    assert len(warnings) == 2, warnings  # failed (once, not per retry), then recovered
    assert "default models" in warnings[0] and "again" in warnings[1]


async def _profile(router: Any, e: Any) -> None:
    from narwhal.authority.profiler import profile_engine

    await profile_engine(router, e)


def test_max_concurrency_one_never_overlaps_clients_and_profiling() -> None:
    # an engine that cuts a running generation when another arrives (llama-cpp-python by
    # default) must never see two requests at once: clients queue at the router, and the
    # profile's measurements wait for the slot like them (Scheduler.reserve)
    mc = MockConfig(dialect="openai", role="unified", name="u0", timing=Timing(time_scale=0.2))
    with running_fleet([mc]) as (mock,):
        spec = EngineSpec("u0", mock.url, "unified", "openai", None, None, max_concurrency=1)
        c = cfg(profile_repeats=2)
        c["admission"]["mode"] = "open"
        with running_router(c, [spec], wait_profiled=False) as rr:
            results: list[int] = []

            def client() -> None:
                with httpx.Client(timeout=30) as h:
                    r = h.post(rr.url + "/v1/chat/completions", json={"model": "narwhal-demo", "max_tokens": 8,
                                                                     "messages": [{"role": "user", "content": "hello"}]})
                    results.append(r.status_code)

            threads = [threading.Thread(target=client) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
            wait_until(lambda: rr.router.engines["u0"].profile_status in ("ok", "failed"), timeout=30)
            view = rr.get("/v1/engines").json()["data"][0]
            rr.balanced()
        assert results == [200] * 6
        assert view["profile"]["status"] == "ok" and view["max_concurrency"] == 1
        assert view["profile"]["measurements"]["tpot_ms_by_batch"] and all(b == 1.0 for b, _ in view["profile"]["measurements"]["tpot_ms_by_batch"])
        assert mock.app.peak_in_flight == 1


def test_profile_prompts_are_words_distinct_per_measurement_and_sized() -> None:
    a, b = _prompt(500, 4.0, "u0-1"), _prompt(500, 4.0, "u0-2")
    assert a != b and a[:8] != b[:8]  # distinct from the first characters: no shared prefix
    assert "narwhal narwhal" not in a and "Continue this story" in a
    assert 0.8 * 2000 <= len(a) <= 2000
    assert len(_prompt(16, 4.0, "x")) < 120
