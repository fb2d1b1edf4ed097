"""Prefill/decode roles: the vLLM two-phase protocol (docs/engines.md section 11)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from narwhal.core.dialects import decode_body, prefill_body
from narwhal.mock import MockConfig, RunningMock, Timing, running_fleet

from .support import chat_body, completion_body, post, sse

SLOW_PREFILL = Timing(prefill_base_ms=300, prefill_per_token_ms=0, prefill_quadratic_ms=0, tpot_base_ms=1, tpot_per_seq_ms=0)


@pytest.fixture(scope="module")
def pd() -> Iterator[tuple[RunningMock, RunningMock]]:
    cfgs = [MockConfig(role="prefill", name="p0", timing=Timing(time_scale=0.01)), MockConfig(role="decode", name="d0", timing=SLOW_PREFILL)]
    with running_fleet(cfgs) as (p, d):
        yield p, d


def test_decode_refuses_without_kv_transfer_params(pd: Any) -> None:
    _, d = pd
    for body in (chat_body(stream=True), chat_body(kv_transfer_params={"do_remote_decode": True}), chat_body(kv_transfer_params="x")):
        r = post(d.url, body)
        assert r.status_code == 400
        e = r.json()["error"]
        assert "kv_transfer_params" in e["message"] and "prefill" in e["message"] and e["type"] == "BadRequestError"
    assert post(d.url, completion_body(), path="/v1/completions").status_code == 400


def test_prefill_returns_kv_transfer_params(pd: Any) -> None:
    p, _ = pd
    body = prefill_body(chat_body("x" * 200), route="chat")  # the router's own prefill leg
    r = post(p.url, body, headers={"x-request-id": "rid-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "rid-1"
    out = r.json()
    kv = out["kv_transfer_params"]
    assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
    assert kv["remote_engine_id"] == "p0" and kv["remote_request_id"] == "rid-1"
    assert kv["remote_host"] == "127.0.0.1" and kv["remote_port"] == p.port and kv["tp_size"] == 1
    assert kv["remote_block_ids"] and all(type(b) is int for b in kv["remote_block_ids"])
    assert out["usage"]["completion_tokens"] == 1 and out["choices"][0]["finish_reason"] == "length"
    assert out["id"] == "chatcmpl-rid-1"
    # without do_remote_decode a prefill engine answers like any engine
    assert post(p.url, chat_body()).json()["kv_transfer_params"] is None


def test_two_phases_decode_skips_prefill(pd: Any) -> None:
    p, d = pd
    client = chat_body("y" * 400, max_tokens=5)
    kv = post(p.url, prefill_body(client, route="chat"), headers={"x-request-id": "rid-2"}).json()["kv_transfer_params"]
    s = sse(d.url, decode_body(client, dialect="vllm", kv_transfer_params=kv, disaggregated=True), headers={"x-request-id": "rid-2"})
    assert s.status == 200 and s.done
    assert s.arrivals[0] < 0.25  # the decode engine's 300 ms prefill did not run
    ids = [x for c in s.chunks if c["choices"] for x in c["choices"][0].get("token_ids", ())]
    assert len(ids) == 5 and s.chunks[-1]["usage"]["completion_tokens"] == 5
    assert all("kv_transfer_params" not in c for c in s.chunks)
    rec = d.requests()[-1]
    assert rec["x_request_id"] == "rid-2" and rec["body"]["kv_transfer_params"] == kv


def test_unified_engine_runs_its_prefill() -> None:
    with running_fleet([MockConfig(timing=SLOW_PREFILL)]) as (u,):
        s = sse(u.url, chat_body(stream=True, mock={"tokens": 2}))
        assert s.arrivals[0] >= 0.25
