"""Admission over HTTP against mock engines with set timing: the vLLM two-phase protocol,
rows R08-R13, and the learned prefill model."""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E
from tests.helpers import RunningRouter, running_router, sse, wait_until

MODEL = "narwhal-demo"


def chat(content: str = "hello", mock: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": content}], **kw}
    if mock is not None:
        b["mock"] = mock
    return b


def words(tokens: int) -> str:
    """A prompt of about `tokens` tokens for the mock (4 bytes a token)."""
    return "abc " * tokens


def cfg(mode: str = "predictive", *, profile: bool = True, **admission: Any) -> dict[str, Any]:
    return {
        "admission": {"mode": mode, "prediction": {"profile_on_start": profile, "profile_prompt_tokens": [16, 256, 1024, 1536], "profile_repeats": 3, "adaptive_margin": False}, **admission},
        "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000},
        "admin": {"token_env": "NARWHAL_TEST_ADMISSION_TOKEN"},
    }


def error_of(r: httpx.Response, row: E.ErrorRow) -> dict[str, Any]:
    assert r.status_code == row.status, r.text
    err = r.json()["error"]
    assert err["code"] == row.code
    return err


# -- the vLLM two-phase protocol ---------------------------------------------------------


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[RunningRouter, list[Any]]]:
    t = Timing(prefill_base_ms=20.0, prefill_per_token_ms=0.1, prefill_quadratic_ms=0.0, tpot_base_ms=5.0)
    cfgs = [MockConfig(dialect="vllm", role="prefill", name="p0", timing=t), MockConfig(dialect="vllm", role="decode", name="d0", timing=t), MockConfig(dialect="vllm", role="decode", name="d1", timing=t)]
    with running_fleet(cfgs) as mocks:
        specs = [EngineSpec(m.name, m.url, m.config.role, "vllm", None, None) for m in mocks]
        os.environ["NARWHAL_TEST_ADMISSION_TOKEN"] = "tok"
        with running_router(cfg(), specs) as rr:
            yield rr, mocks


def test_pd_calls_both_engines_with_the_right_parameters(pd: tuple[RunningRouter, list[Any]]) -> None:
    rr, mocks = pd
    for m in mocks:
        m.clear_requests()
    r = rr.post("/v1/chat/completions", json=chat("what is a narwhal", max_tokens=4), headers={"x-request-id": "pd-1"})
    assert r.status_code == 200, r.text
    pre = [x for x in mocks[0].requests() if x["x_request_id"] == "pd-1"]
    dec = [x for m in mocks[1:] for x in m.requests() if x["x_request_id"] == "pd-1"]
    assert len(pre) == 1 and len(dec) == 1
    p, d = pre[0]["body"], dec[0]["body"]
    assert (p["stream"], p["max_tokens"], p["kv_transfer_params"]["do_remote_decode"]) == (False, 1, True)
    assert "stream_options" not in p and "return_token_ids" not in p
    kv = d["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["remote_engine_id"] == "p0" and kv["remote_request_id"] == "pd-1"
    assert (d["stream"], d["return_token_ids"], d["stream_interval"], d["max_tokens"]) == (True, True, 1, 4)
    # P/D usage: input counts from prefill, output from decode
    u = r.json()["usage"]
    assert u["completion_tokens"] == 4 and u["total_tokens"] == u["prompt_tokens"] + 4


def test_pd_streaming_usage_takes_prefill_input(pd: tuple[RunningRouter, list[Any]]) -> None:
    rr, _ = pd
    s = sse(rr.url, chat("hello", max_tokens=3, stream=True, stream_options={"include_usage": True}))
    assert s.done and s.chunks[-1]["choices"] == [] and s.chunks[-1]["usage"]["completion_tokens"] == 3


def test_pd_decode_retry_on_the_other_decode_engine(pd: tuple[RunningRouter, list[Any]]) -> None:
    rr, mocks = pd
    for _ in range(4):
        r = rr.post("/v1/chat/completions", json=chat(mock={"fault": "missing_token_ids", "fault_after": 0, "fault_engines": ["d0"]}, max_tokens=3))
        assert r.status_code == 200, r.text


def test_learned_prefill_model_recovers_the_mock_timing(pd: tuple[RunningRouter, list[Any]]) -> None:
    rr, mocks = pd
    p0 = next(e for e in rr.get("/v1/engines").json()["data"] if e["name"] == "p0")
    assert p0["profile"]["status"] == "ok", p0["profile"]
    pf = p0["profile"]["prefill"]
    t = mocks[0].config.timing
    for n in (256, 768, 1024, 1536):
        want = t.prefill_ms(n)
        got = pf["b0_ms"] + pf["b1_ms_per_token"] * n + pf["b2_ms_per_token2"] * n * n
        assert abs(got - want) / want < 0.10, (n, got, want)
    d0 = next(e for e in rr.get("/v1/engines").json()["data"] if e["name"] == "d0")
    assert d0["profile"]["status"] == "ok"
    assert abs(d0["profile"]["decode"]["tpot_ms_at_batch_1"] - mocks[1].config.timing.tpot_ms(1)) / mocks[1].config.timing.tpot_ms(1) < 0.15


def test_R09_every_decode_engine_drained(pd: tuple[RunningRouter, list[Any]]) -> None:
    rr, _ = pd
    auth = {"authorization": "Bearer tok"}
    for d in ("d0", "d1"):
        assert rr.post(f"/admin/engines/{d}/drain", json={"drain": True}, headers=auth).status_code == 200
    try:
        r = rr.post("/v1/chat/completions", json=chat())
        error_of(r, E.R09)
        assert r.headers["retry-after"] == "1"
    finally:
        for d in ("d0", "d1"):
            rr.post(f"/admin/engines/{d}/drain", json={"drain": False}, headers=auth)
    assert rr.post("/v1/chat/completions", json=chat(max_tokens=2)).status_code == 200


# -- rows R08, R10 (predictive) ----------------------------------------------------------

SLOW = Timing(prefill_base_ms=10.0, prefill_per_token_ms=0.5, prefill_quadratic_ms=0.0, tpot_base_ms=5.0)


@pytest.fixture(scope="module")
def slow() -> Iterator[RunningRouter]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=SLOW)]) as mocks:
        specs = [EngineSpec("u0", mocks[0].url, "unified", "vllm", None, None)]
        with running_router(cfg(ttft_budget_ms=1500, phase_concurrency={"prefill": 8, "decode": 64}), specs) as rr:
            yield rr


def test_R08_prompt_alone_exceeds_the_budget(slow: RunningRouter) -> None:
    # ~4000 tokens at 0.5 ms/token: about 2 s alone, over 1.5 s
    r = slow.post("/v1/chat/completions", json=chat(words(4000), max_tokens=2))
    err = error_of(r, E.R08)
    assert "retry-after" not in r.headers
    assert "shorten the prompt or raise the target" in err["message"]
    # raising the target admits it
    ok = slow.post("/v1/chat/completions", json=chat(words(4000), max_tokens=2), headers={"x-narwhal-ttft-target-ms": "5000"})
    assert ok.status_code == 200, ok.text


def test_R10_projected_ttft_over_budget_with_the_rounded_overrun(slow: RunningRouter) -> None:
    # four 2000-token requests (about 1 s of prefill each) build about 4 s of work ahead
    body = chat(words(2000), max_tokens=1)
    with cf.ThreadPoolExecutor(4) as pool:
        futs = [pool.submit(slow.post, "/v1/chat/completions", body, headers={"x-narwhal-ttft-target-ms": "30000"}) for _ in range(4)]
        wait_until(lambda: slow.call(lambda: slow.router.engines["u0"].prefill_in_use) >= 4, timeout=10, what="4 prefills in flight")
        r = slow.post("/v1/chat/completions", json=chat("short", max_tokens=1))
        err = error_of(r, E.R10)
        projected = int(err["message"].split("first token ")[1].split(" ms")[0])
        overrun_s = (projected - 1500) / 1000.0
        assert int(r.headers["retry-after"]) == max(1, int(overrun_s + 0.5))
        assert int(r.headers["retry-after"]) >= 2
        for f in futs:
            assert f.result().status_code == 200
    slow.balanced()
    b = slow.books()
    assert b["terminal"]["refused"] >= 2


# -- rows R11, R12, R13 (timing from the mock) ---------------------------------------


@pytest.fixture(scope="module")
def one_slot() -> Iterator[RunningRouter]:
    t = Timing(prefill_base_ms=2.0, prefill_per_token_ms=0.0, tpot_base_ms=5.0)
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=t)]) as mocks:
        specs = [EngineSpec("u0", mocks[0].url, "unified", "vllm", None, None)]
        c = cfg("open", profile=False, queue_limit=1, max_wait_ms=400, phase_concurrency={"prefill": 1, "decode": 1})
        with running_router(c, specs) as rr:
            yield rr


def _hold(rr: RunningRouter, ms: int) -> threading.Thread:
    """A request that holds the only slot for `ms` (the mock's prefill time override)."""
    th = threading.Thread(target=rr.post, args=("/v1/chat/completions", chat(mock={"prefill_ms": ms}, max_tokens=1)), kwargs={"headers": {"x-narwhal-deadline-ms": "60000"}})
    th.start()
    wait_until(lambda: rr.call(lambda: rr.router.engines["u0"].prefill_in_use) == 1, timeout=10, what="the slot to be taken")
    return th


def test_R11_admission_queue_full(one_slot: RunningRouter) -> None:
    rr = one_slot
    holder = _hold(rr, 1500)
    waiter = threading.Thread(target=rr.post, args=("/v1/chat/completions", chat(max_tokens=1)), kwargs={"headers": {}})
    # a waiter with a long admission wait fills the queue of 1
    waiter = cf.ThreadPoolExecutor(1).submit(httpx.post, rr.url + "/v1/chat/completions", json=chat(max_tokens=1), timeout=30)
    wait_until(lambda: rr.call(lambda: rr.router.scheduler.queued) == 1, timeout=10, what="one waiter")
    r = rr.post("/v1/chat/completions", json=chat(max_tokens=1))
    error_of(r, E.R11)
    assert r.headers["retry-after"] == "1"
    holder.join(10)
    waiter.result(10)
    rr.balanced()


def test_R12_admission_wait_expires(one_slot: RunningRouter) -> None:
    rr = one_slot
    holder = _hold(rr, 1500)
    t0 = time.monotonic()
    r = rr.post("/v1/chat/completions", json=chat(max_tokens=1))
    waited = time.monotonic() - t0
    err = error_of(r, E.R12)
    assert "400" in err["message"] and waited >= 0.35
    holder.join(10)
    b = rr.balanced()
    assert b["terminal"]["expired"] >= 1


def test_R13_deadline_expires_while_queued(one_slot: RunningRouter) -> None:
    rr = one_slot
    holder = _hold(rr, 1000)
    r = rr.post("/v1/chat/completions", json=chat(max_tokens=1), headers={"x-narwhal-deadline-ms": "150"})
    error_of(r, E.R13)
    holder.join(10)


def test_R13_deadline_expires_in_flight_before_headers(one_slot: RunningRouter) -> None:
    rr = one_slot
    r = rr.post("/v1/chat/completions", json=chat(mock={"prefill_ms": 800}, max_tokens=1, stream=True), headers={"x-narwhal-deadline-ms": "200"})
    error_of(r, E.R13)


def test_R13_deadline_after_headers_ends_the_stream_with_an_error_event(one_slot: RunningRouter) -> None:
    rr = one_slot
    s = sse(rr.url, chat(mock={"tpot_ms": 100, "tokens": 50}, max_tokens=50, stream=True), headers={"x-narwhal-deadline-ms": "400"})
    assert s.status == 200 and s.done and s.errors and s.errors[-1]["code"] == "deadline_expired"
    assert 0 < len(s.chunks) < 50
    b = rr.balanced()
    assert b["terminal"]["expired"] >= 1
    assert rr.call(lambda: (rr.router.engines["u0"].prefill_in_use, rr.router.engines["u0"].decode_in_use)) == (0, 0)
