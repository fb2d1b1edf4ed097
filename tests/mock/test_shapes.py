"""Fault-free mock output has the dialects' wire shapes (docs/engines.md sections 3-12).

Checked three ways: key sets against the engine fixtures, the token-ID and usage presence
rules per dialect, and the core assembler (narwhal/core/assembly.py) rebuilding each
stream into the mock's own non-streaming answer.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal.core.assembly import Assembler, Failure
from narwhal.core.dialects import ToolCallNormaliser
from narwhal.core.tokens import check_token_ids
from narwhal.mock import EOS_ID, expected_content, expected_token_ids
from tests.shared import FIXTURES  # noqa: E402

from .support import chat_body, classify, completion_body, get, post, sse

CHAT, COMPL = "/v1/chat/completions", "/v1/completions"
SCENARIOS = ["content", "reasoning", "tool_calls", "function_call", "refusal", "empty"]


def _sig(ch: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"top": set(ch)}
    if ch.get("choices"):
        c = ch["choices"][0]
        out["choice"] = set(c)
        if "delta" in c:
            out["delta"] = set(c["delta"])
            tcs = c["delta"].get("tool_calls")
            if tcs:
                out["tool_call"] = set(tcs[0])
    if ch.get("usage"):
        out["usage"] = set(ch["usage"])
    return out


# fixture -> (dialect, route, request, exact): exact compares key sets for equality,
# otherwise the fixture's keys must be a subset (real recordings from older servers).
FIXTURE_CASES = {
    "constructed_vllm_chat_content": ("vllm", CHAT, chat_body(stream=True, return_token_ids=True, stream_options={"include_usage": True, "continuous_usage_stats": True}), True),
    "constructed_vllm_chat_tool_calls": ("vllm", CHAT, chat_body(stream=True, return_token_ids=True, stream_options={"include_usage": True}, mock={"scenario": "tool_calls"}), True),
    "constructed_vllm_completion_logprobs": ("vllm", COMPL, completion_body(stream=True, return_token_ids=True, logprobs=1, stream_options={"include_usage": True}), True),
    "constructed_sglang_chat_reasoning": ("sglang", CHAT, chat_body(stream=True, stream_options={"include_usage": True}, mock={"scenario": "reasoning"}), True),
    "constructed_openai_chat_refusal": ("openai", CHAT, chat_body(stream=True, stream_options={"include_usage": True}, mock={"scenario": "refusal"}), True),
    "openai_chat_content_usage": ("openai", CHAT, chat_body(stream=True, stream_options={"include_usage": True}), False),
    "constructed_vllm_chat_error_midstream": ("vllm", CHAT, chat_body(stream=True, return_token_ids=True, mock={"fault": "error_event", "fault_after": 2}), True),
}


@pytest.mark.parametrize("name", sorted(FIXTURE_CASES))
def test_stream_key_sets_match_fixture(fleet: Any, name: str) -> None:
    dialect, path, body, exact = FIXTURE_CASES[name]
    fx = [json.loads(x) for x in (FIXTURES / f"{name}.jsonl").read_text().splitlines() if x.strip()]
    s = sse(fleet[dialect].url, body, path=path)
    assert s.status == 200 and s.done
    kind = lambda ch: "error" if "error" in ch else classify(ch)  # noqa: E731
    want: dict[str, Any] = {}
    got: dict[str, Any] = {}
    for ch in fx:
        want.setdefault(kind(ch), _sig(ch))
    for ch in s.events:
        got.setdefault(kind(ch), _sig(ch))
    assert set(want) <= set(got), f"chunk kinds missing: {set(want) - set(got)}"
    for k, w in want.items():
        for part, keys in w.items():
            mine = got[k].get(part, set())
            if exact and not (k == "tool_open" and part == "delta"):
                assert keys == mine or (part == "tool_call" and keys <= mine), (k, part, keys, mine)
            else:
                assert keys <= mine, (k, part, keys, mine)


@pytest.mark.parametrize("name", sorted(n for n in FIXTURE_CASES if (FIXTURES / f"{n}.expected.json").exists()))
def test_response_key_sets_match_fixture(fleet: Any, name: str) -> None:
    dialect, path, body, exact = FIXTURE_CASES[name]
    body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    exp = json.loads((FIXTURES / f"{name}.expected.json").read_text())
    r = post(fleet[dialect].url, body, path=path)
    assert r.status_code == 200
    got = r.json()

    def keys(o: dict[str, Any]) -> dict[str, set[str]]:
        c = o["choices"][0]
        out = {"top": set(o), "choice": set(c), "usage": set(o["usage"])}
        if "message" in c:
            out["message"] = set(c["message"])
            if c["message"].get("tool_calls"):
                out["tool_call"] = set(c["message"]["tool_calls"][0])
        return out

    want, mine = keys(exp), keys(got)
    for part, ks in want.items():
        assert (ks == mine[part]) if exact else (ks <= mine[part]), (part, ks, mine[part])


def _assemble(route: str, chunks: list[dict[str, Any]], *, ids: bool, dialect: str) -> dict[str, Any]:
    a = Assembler("chat" if route == CHAT else "completion", content_null_when_empty=dialect != "sglang", include_token_ids=ids)
    norm = ToolCallNormaliser()
    for ch in chunks:
        if dialect == "openai":
            norm(ch)
        f = a.feed(ch)
        assert f is None, f
    out = a.finish(prompt_tokens=0)
    assert not isinstance(out, Failure), out
    return out


def _covered(resp: dict[str, Any], route: str) -> dict[str, Any]:
    c = resp["choices"][0]
    out: dict[str, Any] = {"finish_reason": c["finish_reason"], "usage": {k: resp["usage"][k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}}
    if route == CHAT:
        m = c["message"]
        out["content"] = m.get("content") or None  # A20 turns "" into null; engines differ
        for k in ("reasoning", "reasoning_content", "function_call"):
            if m.get(k):
                out[k] = m[k]
        if m.get("refusal"):
            out["refusal"] = m["refusal"]
        out["tool_calls"] = [(t["type"], t["function"]) for t in m.get("tool_calls") or ()]
    else:
        out["text"] = c["text"]
    return out


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_chat_stream_assembles_to_own_response(fleet: Any, dialect: str, scenario: str) -> None:
    ids = dialect == "vllm"
    base = chat_body(mock={"scenario": scenario}, return_token_ids=ids) if ids else chat_body(mock={"scenario": scenario})
    s = sse(fleet[dialect].url, {**base, "stream": True, "stream_options": {"include_usage": True}})
    assert s.status == 200 and s.done and s.error is None
    assert all(isinstance(e, dict) for e in s.events)
    r = post(fleet[dialect].url, base)
    assert r.status_code == 200
    nonstream = r.json()
    assembled = _assemble(CHAT, s.chunks, ids=ids, dialect=dialect)
    assert _covered(assembled, CHAT) == _covered(nonstream, CHAT)
    if ids:
        assert assembled["choices"][0]["token_ids"] == nonstream["choices"][0]["token_ids"]
        assert len(nonstream["choices"][0]["token_ids"]) == nonstream["usage"]["completion_tokens"]
    assert "mock" not in json.dumps(s.chunks) + r.text


@pytest.mark.parametrize("dialect", ["vllm", "sglang", "openai"])
@pytest.mark.parametrize("logprobs", [False, True])
def test_completion_stream_assembles_to_own_response(fleet: Any, dialect: str, logprobs: bool) -> None:
    ids = dialect != "openai"
    base = completion_body(mock={"tokens": 6}, return_token_ids=ids, **({"logprobs": 2} if logprobs else {}))
    s = sse(fleet[dialect].url, {**base, "stream": True, "stream_options": {"include_usage": True}}, path=COMPL)
    assert s.status == 200 and s.done
    nonstream = post(fleet[dialect].url, base, path=COMPL).json()
    assembled = _assemble(COMPL, s.chunks, ids=ids, dialect=dialect)
    assert _covered(assembled, COMPL) == _covered(nonstream, COMPL)
    assert nonstream["choices"][0]["text"] == expected_content(6)
    if logprobs:
        assert assembled["choices"][0]["logprobs"] == nonstream["choices"][0]["logprobs"]
        assert len(nonstream["choices"][0]["logprobs"]["top_logprobs"][0]) == 2
    if ids:
        assert assembled["choices"][0]["token_ids"] == expected_token_ids(6) == nonstream["choices"][0]["token_ids"]
        first = s.chunks[0]["choices"][0]
        assert first["prompt_token_ids"] and all(type(x) is int for x in first["prompt_token_ids"])
        assert all(c["choices"][0].get("prompt_token_ids") is None for c in s.chunks[1:] if c["choices"])


def test_chat_logprobs(fleet: Any) -> None:
    body = chat_body(stream=True, logprobs=True, top_logprobs=3, return_token_ids=True, mock={"tokens": 4})
    s = sse(fleet["vllm"].url, body)
    entries = [e for c in s.chunks if c["choices"] and c["choices"][0].get("logprobs") for e in c["choices"][0]["logprobs"]["content"]]
    assert len(entries) == 4 and all(len(e["top_logprobs"]) == 3 and set(e) == {"token", "logprob", "bytes", "top_logprobs"} for e in entries)
    # the mock key turns logprobs on too
    s2 = sse(fleet["openai"].url, chat_body(stream=True, mock={"logprobs": True, "tokens": 3}))
    assert sum(1 for c in s2.chunks if c["choices"] and c["choices"][0].get("logprobs")) == 2  # EOS sends no openai chunk


# --- token-ID presence rules -------------------------------------------------------------


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_vllm_token_ids_on_every_chunk_but_role_and_usage(fleet: Any, scenario: str) -> None:
    s = sse(fleet["vllm"].url, chat_body(stream=True, return_token_ids=True, stream_options={}, mock={"scenario": scenario}))
    role, *rest, usage = s.chunks
    assert "token_ids" not in role["choices"][0] and isinstance(role["prompt_token_ids"], list)
    assert usage["choices"] == [] and "token_ids" not in json.dumps(usage)
    total = 0
    for ch in rest:
        n, fail = check_token_ids(ch)  # T02-T04: the router's own check passes
        assert fail is None, fail
        assert isinstance(ch["choices"][0]["token_ids"], list)
        total += n
    assert total == usage["usage"]["completion_tokens"]
    if scenario in ("tool_calls", "reasoning"):
        assert any(c["choices"][0]["delta"] == {} and c["choices"][0]["token_ids"] for c in rest)  # held-back tokens


def test_vllm_no_token_ids_unless_asked(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, chat_body(stream=True, mock={"scenario": "tool_calls"}))
    assert s.done and "token_ids" not in json.dumps(s.chunks)
    assert all(c["choices"][0]["delta"] != {} or c["choices"][0]["finish_reason"] for c in s.chunks)  # empty chunks skipped
    c = sse(fleet["vllm"].url, completion_body(stream=True), path=COMPL)
    assert all(ch["choices"][0]["token_ids"] is None and ch["choices"][0]["prompt_token_ids"] is None for ch in c.chunks)


def test_vllm_finish_chunk_carries_eos_and_stop_reason(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, chat_body(stream=True, return_token_ids=True, mock={"tokens": 3}))
    last = s.chunks[-1]["choices"][0]
    assert last == {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": "stop", "stop_reason": None, "token_ids": [EOS_ID]}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in s.chunks) == expected_content(3)


def test_vllm_stream_interval_groups_ids(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, chat_body(stream=True, return_token_ids=True, stream_interval=4, mock={"tokens": 10}))
    sizes = [len(c["choices"][0]["token_ids"]) for c in s.chunks[1:]]
    assert sum(sizes) == 10 and sizes[0] == 1 and max(sizes) == 4
    o = sse(fleet["openai"].url, chat_body(stream=True, stream_interval=4, return_token_ids=True, mock={"tokens": 10}))
    assert "token_ids" not in json.dumps(o.chunks) and len(o.chunks) == 11  # role + 9 words + finish


def test_sglang_streaming_chat_with_token_ids_is_400(fleet: Any) -> None:
    r = post(fleet["sglang"].url, chat_body(stream=True, return_token_ids=True))
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "return_token_ids is not supported with streaming on /v1/chat/completions. Please set stream=false when using return_token_ids=true."
    )
    ns = post(fleet["sglang"].url, chat_body(return_token_ids=True, mock={"tokens": 3})).json()
    assert ns["choices"][0]["token_ids"] == expected_token_ids(3)


def test_sglang_completion_ids_and_usage_null(fleet: Any) -> None:
    s = sse(fleet["sglang"].url, completion_body(stream=True, return_token_ids=True, mock={"tokens": 4}), path=COMPL)
    assert s.chunks[0]["choices"][0]["prompt_token_ids"] and "prompt_token_ids" not in s.chunks[1]["choices"][0]
    assert [x for c in s.chunks for x in c["choices"][0]["token_ids"]] == expected_token_ids(4)
    assert all(c["usage"] is None for c in s.chunks)


def test_sglang_created_changes_once_and_finish_is_separate(fleet: Any) -> None:
    s = sse(fleet["sglang"].url, chat_body(stream=True, mock={"tokens": 8}))
    created = [c["created"] for c in s.chunks]
    assert len(set(created)) == 2 and created == sorted(created)
    assert len({c["id"] for c in s.chunks}) == 1 and len(s.chunks[0]["id"]) == 32
    last = s.chunks[-1]["choices"][0]
    assert last["delta"] == {"reasoning_content": None} and last["finish_reason"] == "stop" and last["matched_stop"] == EOS_ID
    assert all("matched_stop" in c["choices"][0] and "reasoning_content" in c["choices"][0]["delta"] for c in s.chunks)


def test_sglang_tool_call_chunks_dumped_without_exclusions(fleet: Any) -> None:
    s = sse(fleet["sglang"].url, chat_body(stream=True, mock={"scenario": "tool_calls"}))
    tools = [c for c in s.chunks if c["choices"] and c["choices"][0]["delta"].get("tool_calls")]
    assert tools and all(c["usage"] is None for c in tools)
    first, later = tools[0]["choices"][0]["delta"], tools[1]["choices"][0]["delta"]
    assert first["role"] is None and first["content"] is None and first["reasoning_content"] is None
    assert first["tool_calls"][0]["id"].startswith("call_") and first["tool_calls"][0]["function"]["name"] == "get_weather"
    assert later["tool_calls"][0]["id"] is None and later["tool_calls"][0]["function"]["name"] is None
    ns = post(fleet["sglang"].url, chat_body(mock={"scenario": "tool_calls"})).json()
    assert ns["choices"][0]["message"]["content"] == "" and ns["metadata"]


def test_openai_chunks(fleet: Any) -> None:
    s = sse(fleet["openai"].url, chat_body(stream=True, stream_options={"include_usage": True}, mock={"scenario": "refusal"}))
    assert s.chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None, "refusal": ""}
    assert all(list(c)[:7] == ["id", "object", "created", "model", "service_tier", "system_fingerprint", "choices"] for c in s.chunks)
    assert all(isinstance(c["obfuscation"], str) for c in s.chunks)
    assert all(c["usage"] is None for c in s.chunks[:-1]) and s.chunks[-1]["usage"]["completion_tokens"] == 10
    off = sse(fleet["openai"].url, chat_body(stream=True, stream_options={"include_usage": True, "include_obfuscation": False}))
    assert all("obfuscation" not in c for c in off.chunks)
    plain = sse(fleet["openai"].url, chat_body(stream=True))
    assert all("usage" not in c for c in plain.chunks)


def test_openai_legacy_function_call(fleet: Any) -> None:
    s = sse(fleet["openai"].url, chat_body(stream=True, mock={"scenario": "function_call"}))
    fc = [c["choices"][0]["delta"]["function_call"] for c in s.chunks if "function_call" in c["choices"][0]["delta"]]
    assert fc[0] == {"name": "get_weather", "arguments": ""} and "".join(x["arguments"] for x in fc) == '{"city": "Paris"}'
    assert s.chunks[-1]["choices"][0]["finish_reason"] == "function_call"


def test_tgi_quirk_repeats_tool_call_id(fleet: Any) -> None:
    s = sse(fleet["tgi"].url, chat_body(stream=True, mock={"scenario": "tool_calls"}))
    tcs = [tc for c in s.chunks for tc in c["choices"][0]["delta"].get("tool_calls", ())]
    assert len(tcs) == 8 and all(tc["id"] == "0" and tc["type"] == "function" and tc["function"]["name"] == "get_weather" for tc in tcs)
    q = sse(fleet["openai"].url, chat_body(stream=True, mock={"scenario": "tool_calls", "quirks": ["tgi_repeat_ids"]}))
    assert all(tc["id"] == "0" for c in q.chunks for tc in c["choices"][0]["delta"].get("tool_calls", ()))


# --- usage presence rules ----------------------------------------------------------------

USAGE_CASES = [
    # dialect, stream_options, mock usage, expect final usage chunk
    ("vllm", None, None, False),
    ("vllm", {}, None, True),  # include_usage defaults true once stream_options is sent
    ("vllm", {"include_usage": False}, None, False),
    ("sglang", {}, None, False),  # SGLang defaults false
    ("sglang", {"include_usage": True}, None, True),
    ("openai", {"include_usage": True}, None, True),
    ("openai", None, True, True),
    ("vllm", {"include_usage": True}, False, False),
]


@pytest.mark.parametrize(("dialect", "so", "override", "expect"), USAGE_CASES)
def test_usage_chunk_presence(fleet: Any, dialect: str, so: Any, override: Any, expect: bool) -> None:
    body = chat_body(stream=True, mock={"tokens": 3} if override is None else {"tokens": 3, "usage": override})
    if so is not None:
        body["stream_options"] = so
    s = sse(fleet[dialect].url, body)
    usage_chunks = [c for c in s.chunks if c["choices"] == []]
    assert len(usage_chunks) == (1 if expect else 0)
    if expect:
        u = usage_chunks[0]["usage"]
        assert u["completion_tokens"] == 3 and u["total_tokens"] == u["prompt_tokens"] + 3


def test_vllm_continuous_usage(fleet: Any) -> None:
    s = sse(fleet["vllm"].url, chat_body(stream=True, stream_options={"continuous_usage_stats": True}, mock={"tokens": 4}))
    running = [c["usage"]["completion_tokens"] for c in s.chunks]
    assert running == [0, 1, 2, 3, 4, 4]


def test_prompt_tokens_reported(fleet: Any) -> None:
    text = "x" * 400  # 100 tokens + 3 for the message
    r = post(fleet["vllm"].url, chat_body(text))
    assert r.json()["usage"]["prompt_tokens"] == 103
    ids = post(fleet["vllm"].url, completion_body([5, 6, 7, 8], return_token_ids=True), path=COMPL).json()
    assert ids["usage"]["prompt_tokens"] == 4 and ids["choices"][0]["prompt_token_ids"] == [5, 6, 7, 8]


def test_max_tokens_caps_output(fleet: Any) -> None:
    r = post(fleet["vllm"].url, chat_body(max_tokens=3, return_token_ids=True)).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 3
    assert r["choices"][0]["token_ids"] == expected_token_ids(3, stop=False)
    r2 = post(fleet["vllm"].url, chat_body(max_completion_tokens=40)).json()
    assert r2["choices"][0]["finish_reason"] == "stop" and r2["usage"]["completion_tokens"] == 16
    r3 = post(fleet["sglang"].url, chat_body(max_tokens=40, ignore_eos=True)).json()
    assert r3["choices"][0]["finish_reason"] == "length" and r3["usage"]["completion_tokens"] == 40


def test_models_health_and_unknown_model(fleet: Any) -> None:
    for d, m in fleet.items():
        models = get(m.url + "/v1/models", timeout=5.0).json()
        assert models["object"] == "list" and models["data"][0]["id"] == "narwhal-demo"
        assert get(m.url + "/health", timeout=5.0).status_code == 200
        r = post(m.url, {**chat_body(), "model": "other"})
        assert r.status_code == 404 and set(r.json()["error"]) >= {"message", "type", "param", "code"}, d


def test_vllm_include_reasoning_false_drops_ids(fleet: Any) -> None:
    body = chat_body(stream=True, return_token_ids=True, include_reasoning=False, mock={"scenario": "reasoning"})
    s = sse(fleet["vllm"].url, body)
    assert s.done and "token_ids" not in json.dumps(s.chunks) and "reasoning" not in json.dumps(s.chunks)
    assert any(c["choices"] and c["choices"][0]["delta"].get("content") for c in s.chunks)
    assert "prompt_token_ids" not in s.chunks[0]


def test_model_defaults_to_served_model(fleet: Any) -> None:
    body = chat_body()
    del body["model"]
    assert post(fleet["vllm"].url, body).status_code == 200
    assert post(fleet["openai"].url, body).status_code == 404
