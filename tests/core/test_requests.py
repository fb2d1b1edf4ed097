"""Rows R04-R07 on request bodies and headers: one mutation of a valid base per case."""

from __future__ import annotations

import copy
from typing import Any

import orjson
import pytest

from narwhal.core.requests import ParsedRequest, Rejection, parse_headers, parse_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMP = {"model": "m", "prompt": "hi"}


def run(route: str, body: Any) -> ParsedRequest | Rejection:
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    return parse_request(route, raw, model="m")


def mutate(base: dict[str, Any], **kv: Any) -> dict[str, Any]:
    b = copy.deepcopy(base)
    for k, v in kv.items():
        if v is ...:
            b.pop(k, None)
        else:
            b[k] = v
    return b


R04_CASES = [
    ("chat", b"{", None),
    ("chat", b"", None),
    ("chat", b"[1]", None),
    ("chat", b'"text"', None),
    ("chat", mutate(CHAT, model=...), "model"),
    ("chat", mutate(CHAT, model=7), "model"),
    ("chat", mutate(CHAT, messages=...), "messages"),
    ("chat", mutate(CHAT, messages="hi"), "messages"),
    ("chat", mutate(CHAT, messages=[]), "messages"),
    ("chat", mutate(CHAT, messages=[{"content": "x"}]), "messages[0].role"),
    ("chat", mutate(CHAT, messages=[{"role": "user", "content": 5}]), "messages[0].content"),
    ("chat", mutate(CHAT, messages=[{"role": "user", "content": [{"type": "text", "text": 3}]}]), "messages[0].content[0].text"),
    ("chat", mutate(CHAT, messages=[{"role": "user", "content": [{"text": "a"}]}]), "messages[0].content[0].type"),
    ("chat", mutate(CHAT, stream="true"), "stream"),
    ("chat", mutate(CHAT, stream=1), "stream"),
    ("chat", mutate(CHAT, n="2"), "n"),
    ("chat", mutate(CHAT, n=1.0), "n"),
    ("chat", mutate(CHAT, best_of=True), "best_of"),
    ("chat", mutate(CHAT, max_tokens="10"), "max_tokens"),
    ("chat", mutate(CHAT, max_tokens=-1), "max_tokens"),
    ("chat", mutate(CHAT, modalities="text"), "modalities"),
    ("chat", mutate(CHAT, modalities=[1]), "modalities[0]"),
    ("chat", mutate(CHAT, audio="alloy"), "audio"),
    ("chat", mutate(CHAT, tools={"type": "function"}), "tools"),
    ("chat", mutate(CHAT, tools=[{"function": {"name": "f"}}]), "tools[0].type"),
    ("chat", mutate(CHAT, tools=[{"type": "function", "function": {"name": 3}}]), "tools[0].function.name"),
    ("chat", mutate(CHAT, return_token_ids="yes"), "return_token_ids"),
    ("chat", mutate(CHAT, stream_options=[]), "stream_options"),
    ("chat", mutate(CHAT, stream_options={"include_usage": "true"}), "stream_options.include_usage"),
    ("completion", mutate(COMP, prompt=...), "prompt"),
    ("completion", mutate(COMP, prompt=5), "prompt"),
    ("completion", mutate(COMP, prompt=[]), "prompt"),
    ("completion", mutate(COMP, prompt=[-1]), "prompt"),
    ("completion", mutate(COMP, prompt=[True]), "prompt"),
    ("completion", mutate(COMP, max_tokens=2.5), "max_tokens"),
]


@pytest.mark.parametrize(("route", "body", "param"), R04_CASES)
def test_R04_invalid_body_names_the_field(route: str, body: Any, param: str | None) -> None:
    r = run(route, body)
    assert isinstance(r, Rejection) and r.row.id == "R04", r
    if param is None:
        assert r.param is None
    else:
        assert r.param is not None and r.param.startswith(param)


@pytest.mark.parametrize(("ttft", "deadline", "param"), [("abc", None, "x-narwhal-ttft-target-ms"), ("-5", None, "x-narwhal-ttft-target-ms"), (None, "1.5", "x-narwhal-deadline-ms"), (None, "", "x-narwhal-deadline-ms"), ("١٢", None, "x-narwhal-ttft-target-ms")])
def test_R04_router_read_headers(ttft: str | None, deadline: str | None, param: str) -> None:
    r = parse_headers(ttft, deadline, budget_ms=2000, max_target_ms=30000)
    assert isinstance(r, Rejection) and r.row.id == "R04" and r.param == param


def test_ttft_target_is_clamped_to_the_maximum() -> None:
    r = parse_headers("99999", "500", budget_ms=2000, max_target_ms=30000)
    assert not isinstance(r, Rejection)
    assert (r.ttft_target_ms, r.deadline_ms) == (30000, 500)


def test_R05_other_model() -> None:
    r = run("chat", mutate(CHAT, model="gpt-4"))
    assert isinstance(r, Rejection) and (r.row.id, r.param) == ("R05", "model")


def test_R04_precedes_R05() -> None:
    r = run("chat", mutate(CHAT, model="other", stream="no"))
    assert isinstance(r, Rejection) and r.row.id == "R04"


@pytest.mark.parametrize(("route", "kv", "param"), [("chat", {"n": 2}, "n"), ("chat", {"best_of": 3}, "best_of"), ("completion", {"n": 4}, "n"), ("completion", {"best_of": 2}, "best_of"), ("chat", {"n": 2, "best_of": 2}, "n")])
def test_R06_sampling_width(route: str, kv: dict[str, Any], param: str) -> None:
    r = run(route, mutate(CHAT if route == "chat" else COMP, **kv))
    assert isinstance(r, Rejection) and (r.row.id, r.param, r.row.message) == ("R06", param, "Invalid sampling width")


def test_R06_width_one_passes() -> None:
    assert isinstance(run("chat", mutate(CHAT, n=1, best_of=1)), ParsedRequest)


@pytest.mark.parametrize(
    ("kv", "param"),
    [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "custom", "custom": {"name": "c"}}]}, "tools[1].type"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ],
)
def test_R07_unsupported_non_streaming_options(kv: dict[str, Any], param: str) -> None:
    r = run("chat", mutate(CHAT, **kv))
    assert isinstance(r, Rejection) and (r.row.id, r.param) == ("R07", param)
    # streaming requests pass the same options through to the engine
    assert isinstance(run("chat", mutate(CHAT, stream=True, **kv)), ParsedRequest)


def test_R06_precedes_R07() -> None:
    r = run("chat", mutate(CHAT, n=2, audio={"voice": "x"}))
    assert isinstance(r, Rejection) and r.row.id == "R06"


def test_unknown_fields_pass_through_untouched() -> None:
    body = mutate(CHAT, temperature=0.2, top_k=5, vendor_x={"a": [1]}, messages=[{"role": "user", "content": "hi", "name": "bob"}])
    r = run("chat", body)
    assert isinstance(r, ParsedRequest) and r.body == body


def test_sizing_inputs() -> None:
    r = run("completion", mutate(COMP, prompt=[1, 2, 3]))
    assert isinstance(r, ParsedRequest) and r.prompt_token_count == 3
    r = run("completion", mutate(COMP, prompt=[[1, 2], [3]]))
    assert isinstance(r, ParsedRequest) and r.prompt_token_count == 3
    r = run("chat", mutate(CHAT, stream=True, stream_options={"include_usage": True}, max_completion_tokens=9))
    assert isinstance(r, ParsedRequest) and r.client_usage and r.max_tokens == 9 and r.stream
