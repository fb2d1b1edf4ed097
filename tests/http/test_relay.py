"""Streaming relay and non-streaming assembly over real HTTP, against mock engines of each
dialect: the engine's shape when streaming, one assembled answer otherwise, token
identity (T01-T12), and the engine-failure rows E01-E07; each on every serving.relay_path
(tests/conftest.py `relay_path`), and the direct path both with the compiled step
(serving.relay_native, core/fastevent.py) and without it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, Timing, expected_content, expected_token_ids, running_fleet
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E
from tests.conftest import RELAY_PATHS
from tests.helpers import RunningRouter, accumulate, relay_serving, running_router, sse

MODEL = "narwhal-demo"
FAST = Timing(time_scale=0.25)


@pytest.fixture(scope="module", params=(*RELAY_PATHS, "direct-python"))
def relay_path(request: pytest.FixtureRequest) -> Iterator[str]:
    yield request.param


def base_config(relay_path: str = "direct") -> dict[str, Any]:
    return {
        "serving": relay_serving(relay_path),
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000, "breaker_failures": 1000},
        "upstream": {"idle_timeout_ms": 1500},
    }


class Fleet:
    def __init__(self, rr: RunningRouter, mocks: list[Any]) -> None:
        self.rr, self.mocks, self.url = rr, mocks, rr.url

    def mock(self, name: str) -> Any:
        return next(m for m in self.mocks if m.name == name)

    def clear(self) -> None:
        for m in self.mocks:
            m.clear_requests()


def _fleet(dialect: str, names: tuple[str, ...] = ("u0",), relay_path: str = "direct") -> Iterator[Fleet]:
    cfgs = [MockConfig(dialect=dialect, role="unified", name=n, timing=FAST) for n in names]
    with running_fleet(cfgs) as mocks:
        specs = [EngineSpec(m.name, m.url, "unified", dialect, None, None) for m in mocks]
        with running_router(base_config(relay_path), specs) as rr:
            yield Fleet(rr, mocks)


@pytest.fixture(scope="module")
def vllm(relay_path: str) -> Iterator[Fleet]:
    yield from _fleet("vllm", ("u0", "u1"), relay_path)


@pytest.fixture(scope="module")
def sglang(relay_path: str) -> Iterator[Fleet]:
    yield from _fleet("sglang", relay_path=relay_path)


@pytest.fixture(scope="module")
def openai_fleet(relay_path: str) -> Iterator[Fleet]:
    yield from _fleet("openai", relay_path=relay_path)


@pytest.fixture(scope="module")
def fleets(vllm: Fleet, sglang: Fleet, openai_fleet: Fleet) -> dict[str, Fleet]:
    return {"vllm": vllm, "sglang": sglang, "openai": openai_fleet}


def chat(mock: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], **kw}
    if mock is not None:
        b["mock"] = mock
    return b


def comp(mock: dict[str, Any] | None = None, **kw: Any) -> dict[str, Any]:
    b: dict[str, Any] = {"model": MODEL, "prompt": "hello there", **kw}
    if mock is not None:
        b["mock"] = mock
    return b


def post(f: Fleet, body: dict[str, Any], path: str = "/v1/chat/completions", **kw: Any) -> httpx.Response:
    return httpx.post(f.url + path, json=body, timeout=30, **kw)


def error_of(resp: httpx.Response, row: E.ErrorRow) -> dict[str, Any]:
    assert resp.status_code == row.status, resp.text
    err = resp.json()["error"]
    assert (err["type"], err["code"]) == (row.type, row.code)
    return err


# -- assembled equals accumulated, per dialect and scenario ------------------------------

SCENARIOS = ["content", "reasoning", "tool_calls", "function_call", "refusal", "empty"]


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_assembled_equals_accumulated_stream(fleets: dict[str, Fleet], dialect: str, scenario: str) -> None:
    f = fleets[dialect]
    m = {"scenario": scenario, "tokens": 8}
    streamed = sse(f.url, chat(m, stream=True))
    assert streamed.status == 200 and streamed.done and not streamed.errors
    acc = accumulate(streamed.chunks)
    r = post(f, chat(m))
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]
    msg = got["message"]
    for k in ("content", "reasoning", "reasoning_content", "refusal"):
        want = acc.get(k)
        if k == "content" and not want:
            assert msg.get("content") in (None, "")  # A20: null (or "" for sglang)
        else:
            assert msg.get(k) == want, k
    if "tool_calls" in acc:
        # tool-call IDs are fresh per request; names and arguments are deterministic
        assert [(t["function"]["name"], t["function"]["arguments"]) for t in msg["tool_calls"]] == [(t["name"], t["arguments"]) for t in acc["tool_calls"]]
        assert all(t["id"] for t in msg["tool_calls"]) and all(t["id"] for t in acc["tool_calls"])
    assert got["finish_reason"] == acc["finish_reason"]
    assert r.json()["usage"]["completion_tokens"] >= 0


def test_completions_stream_and_assembly(vllm: Fleet) -> None:
    s = sse(vllm.url, comp(max_tokens=5, stream=True), path="/v1/completions")
    text = "".join(c["choices"][0]["text"] for c in s.chunks if c.get("choices"))
    r = post(vllm, comp(max_tokens=5), "/v1/completions").json()
    assert r["object"] == "text_completion" and r["choices"][0]["text"] == text == expected_content(6)[: len(text)]
    assert r["choices"][0]["finish_reason"] == "length"


def test_completion_logprobs_join(vllm: Fleet) -> None:
    r = post(vllm, comp({"logprobs": True, "tokens": 4}, logprobs=1), "/v1/completions").json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == 4  # A08


def test_chat_logprobs_join(vllm: Fleet) -> None:
    r = post(vllm, chat({"logprobs": True, "tokens": 4}, logprobs=True)).json()
    assert len(r["choices"][0]["logprobs"]["content"]) == 4  # A07


# -- token identity ------------------------------------------------------------------


def test_T01_V01_vllm_decode_is_asked_for_token_ids(vllm: Fleet) -> None:
    vllm.clear()
    post(vllm, chat())
    body = next(m for m in vllm.mocks if m.requests()).requests()[-1]["body"]
    assert (body["return_token_ids"], body["stream_interval"], body["stream"]) == (True, 1, True)
    assert body["stream_options"]["include_usage"] is True


@pytest.mark.parametrize("dialect", ["sglang", "openai"])
def test_T08_V02_V03_other_dialects_are_never_sent_those_fields(fleets: dict[str, Fleet], dialect: str) -> None:
    f = fleets[dialect]
    f.clear()
    r = post(f, chat(return_token_ids=True, stream_interval=4))
    assert r.status_code == 200
    body = f.mocks[0].requests()[-1]["body"]
    assert "return_token_ids" not in body and "stream_interval" not in body
    e = f.rr.get("/v1/engines").json()["data"][0]
    assert e["token_accounting"] == "unavailable"  # T12


def test_T09_client_that_asked_gets_the_ids(vllm: Fleet) -> None:
    s = sse(vllm.url, chat({"tokens": 5}, stream=True, return_token_ids=True))
    ids = [i for c in s.chunks for ch in c.get("choices") or () for i in ch.get("token_ids") or ()]
    assert ids == expected_token_ids(5)
    assert any("prompt_token_ids" in c for c in s.chunks)
    r = post(vllm, chat({"tokens": 5}, return_token_ids=True)).json()
    assert r["choices"][0]["token_ids"] == expected_token_ids(5) and r["prompt_token_ids"]


def test_T10_client_that_did_not_ask_never_sees_ids(vllm: Fleet) -> None:
    s = sse(vllm.url, chat({"tokens": 5}, stream=True, stream_options={"include_usage": True}))
    assert s.done and s.chunks
    for c in s.chunks:
        assert "prompt_token_ids" not in c
        for ch in c.get("choices") or ():
            assert "token_ids" not in ch and "prompt_token_ids" not in ch
    assert s.chunks[-1]["choices"] == [] and s.chunks[-1]["usage"]["completion_tokens"] == 5
    r = post(vllm, chat({"tokens": 5})).json()
    assert "token_ids" not in r["choices"][0] and "prompt_token_ids" not in r


def test_usage_chunk_only_when_the_client_asked(vllm: Fleet) -> None:
    s = sse(vllm.url, chat({"tokens": 3}, stream=True))
    assert all(c.get("choices") for c in s.chunks)  # no usage-only chunk
    r = post(vllm, chat({"tokens": 3})).json()
    assert r["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("fault", ["missing_token_ids", "bool_token_ids", "negative_token_ids", "string_token_ids"])
def test_T03_bad_ids_before_headers_fail_the_attempt_E03(vllm: Fleet, fault: str) -> None:
    # both engines send bad IDs on the first token: the retry fails too -> 502
    r = post(vllm, chat({"fault": fault, "fault_after": 0}))
    error_of(r, E.E03)
    s = sse(vllm.url, chat({"fault": fault, "fault_after": 0}, stream=True))
    assert s.status == 502 and s.json()["error"]["code"] == "invalid_token_ids"


def test_T05_retry_on_another_engine_before_headers(vllm: Fleet) -> None:
    vllm.clear()
    bad = vllm.mocks[0].name
    for stream in (False, True):
        # whichever engine takes it first: the fault is only on `bad`
        body = chat({"fault": "bool_token_ids", "fault_after": 0, "fault_engines": [bad], "tokens": 4}, stream=stream)
        for _ in range(4):
            if stream:
                s = sse(vllm.url, body)
                assert s.status == 200 and s.done and not s.errors
            else:
                r = post(vllm, body)
                assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]
    assert vllm.mock(bad).requests(), "the faulty engine was tried"


def test_T06_bad_ids_after_headers_end_the_stream_with_an_error_event(vllm: Fleet) -> None:
    s = sse(vllm.url, chat({"fault": "bool_token_ids", "fault_after": 2}, stream=True))
    assert s.status == 200 and s.done
    assert s.errors and s.errors[-1]["code"] == "invalid_token_ids"
    assert len([c for c in s.chunks if c.get("choices") and c["choices"][0].get("delta", {}).get("content")]) == 2


def test_T04_ids_on_textless_events_count(vllm: Fleet) -> None:
    r = post(vllm, chat({"scenario": "tool_calls"}, return_token_ids=True)).json()
    s = sse(vllm.url, chat({"scenario": "tool_calls"}, stream=True, return_token_ids=True))
    ids = [i for c in s.chunks for ch in c.get("choices") or () for i in ch.get("token_ids") or ()]
    assert r["choices"][0]["token_ids"] == ids and r["usage"]["completion_tokens"] == len(ids)


# -- engine failures -----------------------------------------------------------------


@pytest.mark.parametrize("fault", ["audio", "annotations", "custom_tool"])
def test_E01_unsupported_field_non_streaming_502_streaming_relayed(vllm: Fleet, fault: str) -> None:
    err = error_of(post(vllm, chat({"fault": fault})), E.E01)
    assert "A12" in err["message"]
    s = sse(vllm.url, chat({"fault": fault}, stream=True))
    assert s.status == 200 and s.done and not s.errors


@pytest.mark.parametrize(("fault", "rule"), [("tool_call_no_id", "A10"), ("tool_call_no_name", "A10"), ("wrong_type", "A13"), ("malformed_json", "")])
def test_E02_malformed_engine_output(vllm: Fleet, fault: str, rule: str) -> None:
    err = error_of(post(vllm, chat({"fault": fault, "fault_after": 0})), E.E02)
    assert rule in err["message"]


def test_E02_malformed_json_after_headers_is_an_error_event(vllm: Fleet) -> None:
    s = sse(vllm.url, chat({"fault": "malformed_json", "fault_after": 2}, stream=True))
    assert s.status == 200 and s.done and s.errors[-1]["code"] == "malformed_engine_output"


def test_E04_engine_error_event(vllm: Fleet) -> None:
    error_of(post(vllm, chat({"fault": "error_event", "fault_after": 2})), E.E04)
    # streaming: the engine's own error event reaches the client in its shape
    s = sse(vllm.url, chat({"fault": "error_event", "fault_after": 2}, stream=True))
    assert s.status == 200 and s.done and s.errors and s.errors[-1]["code"] != "engine_error"


def test_E04_engine_http_500_before_streaming(vllm: Fleet) -> None:
    error_of(post(vllm, chat({"fault": "error_before"})), E.E04)


def test_E05_engine_rejects_the_request(vllm: Fleet) -> None:
    err = error_of(post(vllm, chat({"fault": "reject"})), E.E05)
    assert "engine rejected" in err["message"].lower() or err["message"]


def test_E06_connection_drop(vllm: Fleet) -> None:
    error_of(post(vllm, chat({"fault": "drop", "fault_after": 2})), E.E06)
    s = sse(vllm.url, chat({"fault": "drop", "fault_after": 2}, stream=True))
    assert s.status == 200 and s.done and s.errors[-1]["code"] == "engine_unreachable"


def test_E07_engine_stall(vllm: Fleet) -> None:
    s = sse(vllm.url, chat({"fault": "stall", "fault_after": 2}, stream=True))
    assert s.status == 200 and s.done and s.errors[-1]["code"] == "engine_timeout"
    error_of(post(vllm, chat({"fault": "stall_before"})), E.E07)


def test_books_balance_after_all_of_it(fleets: dict[str, Fleet]) -> None:
    for f in fleets.values():
        b = f.rr.balanced()
        assert b["terminal"]["completed"] > 0
