"""Fault injection: each `mock.fault` produces the engine misbehaviour it names, and the
core's own checks classify it as the spec row it exists to exercise (E01-E07, A10-A13,
T02-T07)."""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from narwhal.core.assembly import Assembler, Failure
from narwhal.core.tokens import check_token_ids
from narwhal.mock import MockConfig, Timing, running_fleet

from .support import chat_body, completion_body, post, sse

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"


def _vllm(fault: str, **mock: Any) -> dict[str, Any]:
    return chat_body(stream=True, return_token_ids=True, stream_options={"include_usage": True}, mock={"fault": fault, **mock})


def _first_failure(chunks: list[dict[str, Any]], route: str = "chat") -> Failure | None:
    a = Assembler(route)
    for c in chunks:
        f = a.feed(c)
        if f is not None:
            return f
    out = a.finish(prompt_tokens=0)
    return out if isinstance(out, Failure) else None


@pytest.mark.parametrize(
    ("fault", "detail"),
    [
        ("missing_token_ids", "without token_ids"),  # T02
        ("bool_token_ids", "True"),  # T03: a Boolean is not an integer
        ("negative_token_ids", "-1"),  # T03
        ("string_token_ids", "'1001'"),  # T03
    ],
)
def test_token_id_faults_fail_the_check(fleet: Any, fault: str, detail: str) -> None:
    s = sse(fleet["vllm"].url, _vllm(fault))
    assert s.done
    results = [check_token_ids(c) for c in s.chunks]
    failures = [(i, f) for i, (_, f) in enumerate(results) if f is not None]
    assert len(failures) == 1, failures
    i, f = failures[0]
    assert i == 2 and detail in f  # role chunk, token 0, then the faulty token 1 (fault_after=1)


def test_fault_after_moves_the_fault(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, _vllm("missing_token_ids", fault_after=5))
    bad = [i for i, c in enumerate(s.chunks) if c["choices"] and "token_ids" not in c["choices"][0] and i > 0]
    assert bad == [6]
    s0 = sse(fleet["vllm"].url, _vllm("bool_token_ids", fault_after=0))
    assert s0.chunks[1]["choices"][0]["token_ids"][0] is True


@pytest.mark.parametrize(
    ("fault", "row", "rule"),
    [
        ("audio", "E01", "A12"),
        ("annotations", "E01", "A12"),
        ("custom_tool", "E01", "A12"),
        ("tool_call_no_id", "E02", "A10"),
        ("tool_call_no_name", "E02", "A10"),
        ("wrong_type", "E02", "A13"),
    ],
)
@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
def test_assembly_faults_are_refused_by_the_assembler(fleet: Any, dialect: str, fault: str, row: str, rule: str) -> None:
    s = sse(fleet[dialect].url, chat_body(stream=True, mock={"fault": fault}))
    assert s.status == 200 and s.done
    f = _first_failure(s.chunks)
    assert f is not None and (f.row, f.rule) == (row, rule), f
    r = post(fleet[dialect].url, chat_body(mock={"fault": fault}))
    msg = r.json()["choices"][0]["message"]
    if fault in ("audio", "annotations"):
        assert msg[fault]
    elif fault == "custom_tool":
        assert any(tc["type"] == "custom" and tc["custom"] for tc in msg["tool_calls"])
    elif fault == "tool_call_no_id":
        assert "id" not in msg["tool_calls"][0]
    elif fault == "tool_call_no_name":
        assert "name" not in msg["tool_calls"][0]["function"]
    else:
        assert msg["content"] == 42


def test_wrong_type_on_completions(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, completion_body(stream=True, mock={"fault": "wrong_type"}), path=COMPL)
    assert s.chunks[1]["choices"][0]["text"] == 42
    assert _first_failure(s.chunks, "completion") is not None


def test_malformed_json_event(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, _vllm("malformed_json", fault_after=2))
    assert s.done
    kinds = ["json" if isinstance(e, dict) else "raw" for e in s.events]
    assert kinds.count("raw") == 1 and kinds.index("raw") == 3  # role, token 0, token 1, then the bad line
    r = post(fleet["vllm"].url, chat_body(mock={"fault": "malformed_json"}))
    assert r.status_code == 200
    with pytest.raises(ValueError):
        r.json()


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
def test_error_event_midstream(fleet: Any, dialect: str) -> None:
    s = sse(fleet[dialect].url, chat_body(stream=True, stream_options={"include_usage": True}, mock={"fault": "error_event", "fault_after": 3}))
    assert s.done  # error event, then [DONE]
    err = s.events[-1]
    assert s.errors == [err["error"]] and set(err) == {"error"} and {"message", "type", "param", "code"} <= set(err["error"])
    assert not any(c.get("choices") == [] for c in s.chunks)  # no usage chunk after an error
    assert not any(c.get("choices") and c["choices"][0].get("finish_reason") for c in s.chunks)
    r = post(fleet[dialect].url, chat_body(mock={"fault": "error_event"}))
    assert r.status_code == 500 and "error" in r.json()


@pytest.mark.parametrize(("fault", "status"), [("error_before", 500), ("reject", 400)])
@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
def test_errors_before_streaming(fleet: Any, dialect: str, fault: str, status: int) -> None:
    for stream in (True, False):
        r = post(fleet[dialect].url, chat_body(stream=stream, mock={"fault": fault}))
        assert r.status_code == status
        e = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(e)
        if dialect == "vllm":
            assert e["type"] == ("InternalServerError" if status == 500 else "BadRequestError") and e["code"] == status


def test_drop_closes_without_done(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, _vllm("drop", fault_after=3))
    assert not s.done and isinstance(s.error, httpx.RemoteProtocolError)
    assert len(s.chunks) == 4  # role + 3 tokens
    with pytest.raises(httpx.RemoteProtocolError):
        post(fleet["vllm"].url, chat_body(mock={"fault": "drop"}))


def test_stall_midstream_then_resume(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, _vllm("stall", stall_ms=300, fault_after=2, tokens=4))
    assert s.done
    gaps = [b - a for a, b in zip(s.arrivals, s.arrivals[1:], strict=False)]
    assert max(gaps) >= 0.25 and gaps.index(max(gaps)) == 2  # between token 1 and token 2


def test_stall_forever_until_client_gives_up(fleet: Any) -> None:
    t0 = time.monotonic()
    s = sse(fleet["openai"].url, chat_body(stream=True, mock={"fault": "stall"}), timeout=httpx.Timeout(5.0, read=0.3))
    assert isinstance(s.error, httpx.ReadTimeout) and 0.25 < time.monotonic() - t0 < 3
    with pytest.raises(httpx.ReadTimeout):  # stall_before: not even the headers
        post(fleet["sglang"].url, chat_body(stream=True, mock={"fault": "stall_before"}), timeout=httpx.Timeout(5.0, read=0.3))
    r = post(fleet["sglang"].url, chat_body(mock={"fault": "stall_before", "stall_ms": 50}))
    assert r.status_code == 200


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
def test_no_finish_reason(fleet: Any, dialect: str) -> None:
    s = sse(fleet[dialect].url, chat_body(stream=True, mock={"fault": "no_finish_reason"}))
    assert s.done and all(c["choices"][0].get("finish_reason") is None for c in s.chunks)
    assert post(fleet[dialect].url, chat_body(mock={"fault": "no_finish_reason"})).json()["choices"][0]["finish_reason"] is None


def test_directive_in_prompt_text(fleet: Any) -> None:
    body = chat_body('Hi [[mock {"fault": "reject"}]]')
    assert post(fleet["vllm"].url, body).status_code == 400
    multi = {"model": "narwhal-demo", "messages": [
        {"role": "system", "content": '[[mock {"fault": "reject"}]]'},
        {"role": "user", "content": [{"type": "text", "text": 'go [[mock {"tokens": 2}]]'}]},
    ]}  # fmt: skip
    r = post(fleet["vllm"].url, multi)  # the last message's directive wins
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    c = post(fleet["sglang"].url, completion_body('x [[mock {"fault": "error_before"}]] y'), path=COMPL)
    assert c.status_code == 500
    # a body field takes precedence over a directive
    assert post(fleet["vllm"].url, {**body, "mock": {"tokens": 1}}).status_code == 200


def test_bad_mock_options_are_400(fleet: Any) -> None:
    for opts in ({"fault": "nope"}, {"scenario": "x"}, {"tokens": -1}, {"fault_engines": 3}, {"stall_ms": "1"}):
        r = post(fleet["vllm"].url, chat_body(mock=opts))
        assert r.status_code == 400 and "mock" in r.json()["error"]["message"], opts
    assert post(fleet["vllm"].url, chat_body(mock="fault")).status_code == 400
    assert post(fleet["vllm"].url, chat_body("[[mock {oops}]]")).status_code == 400
    assert post(fleet["vllm"].url, chat_body(mock={"whatever": 1, "tokens": 2})).status_code == 200


def test_fault_engines_restricts_the_fault() -> None:
    cfgs = [MockConfig(name="d0", timing=Timing(time_scale=0.01)), MockConfig(name="d1", timing=Timing(time_scale=0.01))]
    with running_fleet(cfgs) as (d0, d1):
        body = chat_body(mock={"fault": "error_before", "fault_engines": ["d0"]})
        assert post(d0.url, body).status_code == 500
        assert post(d1.url, body).status_code == 200
        assert d0.stats()["faulted"] == 0 and d0.stats()["refused"] == 1 and d1.stats()["completed"] == 1
