"""The assembly table (spec/tables/assembly.yaml), row by row, and the engine fixtures.

Each case is (row ID, route, chunks, expectation); the test names cite the row. The
fixtures of shared/fixtures/engine-streams assemble to agree with the engine's own
non-streaming answer on every field the table covers.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from narwhal.core.assembly import Assembler, Failure
from narwhal.core.dialects import ToolCallNormaliser
from narwhal_generated import assembly as T
from tests.shared import FIXTURES  # noqa: E402


def c(delta: dict[str, Any] | None = None, **choice: Any) -> dict[str, Any]:
    ch: dict[str, Any] = {"index": choice.pop("index", 0)}
    if delta is not None:
        ch["delta"] = delta
    ch.update(choice)
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [ch]}


def usage_chunk(p: int = 3, k: int = 2) -> dict[str, Any]:
    return {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [], "usage": {"prompt_tokens": p, "completion_tokens": k, "total_tokens": p + k}}


def assemble(route: str, chunks: list[dict[str, Any]], *, ids: bool = False, null_empty: bool = True, prompt_tokens: int = 7, measured: int | None = None) -> dict[str, Any] | Failure:
    a = Assembler(route, content_null_when_empty=null_empty, include_token_ids=ids)
    for ch in chunks:
        f = a.feed(ch)
        if f is not None:
            return f
    return a.finish(prompt_tokens=prompt_tokens, completion_tokens=measured)


def msg(res: Any) -> dict[str, Any]:
    assert isinstance(res, dict), res
    return res["choices"][0]["message"]


def test_A01_content_concatenates() -> None:
    r = assemble("chat", [c({"role": "assistant", "content": ""}), c({"content": "Hel"}), c({"content": None}), c({"content": "lo"})])
    assert msg(r)["content"] == "Hello"


def test_A02_reasoning_concatenates_under_reasoning() -> None:
    r = msg(assemble("chat", [c({"reasoning": "a"}), c({"reasoning": "b"}), c({"content": "x"})]))
    assert r["reasoning"] == "ab" and "reasoning_content" not in r


def test_A03_reasoning_content_concatenates_under_reasoning_content() -> None:
    r = msg(assemble("chat", [c({"reasoning_content": "a"}), c({"reasoning_content": None}), c({"reasoning_content": "b"})]))
    assert r["reasoning_content"] == "ab" and "reasoning" not in r


def test_D02_reasoning_fields_never_join() -> None:
    r = msg(assemble("chat", [c({"reasoning": "r1"}), c({"reasoning_content": "c1"}), c({"reasoning": "r2"})]))
    assert (r["reasoning"], r["reasoning_content"]) == ("r1r2", "c1")


def test_A04_refusal_concatenates() -> None:
    r = msg(assemble("chat", [c({"role": "assistant", "content": None, "refusal": ""}), c({"refusal": "I can"}), c({"refusal": "'t"})]))
    assert r["refusal"] == "I can't" and r["content"] is None


def test_A05_tool_calls_grouped_by_index_in_index_order() -> None:
    chunks = [
        c({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {"name": "g", "arguments": ""}}]}),
        c({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{\"x\""}}]}),
        c({"tool_calls": [{"index": 1, "function": {"arguments": "{}"}}, {"index": 0, "function": {"arguments": ": 1}"}}]}),
    ]
    calls = msg(assemble("chat", chunks))["tool_calls"]
    assert [t["id"] for t in calls] == ["call_a", "call_b"]
    assert [t["function"]["arguments"] for t in calls] == ['{"x": 1}', "{}"]


def test_A05_id_name_and_arguments_concatenate_independently() -> None:
    chunks = [
        c({"tool_calls": [{"index": 0, "id": "ca", "function": {"name": "get_"}}]}),
        c({"tool_calls": [{"index": 0, "id": "ll", "function": {"name": "weather", "arguments": "{}"}}]}),
    ]
    t = msg(assemble("chat", chunks))["tool_calls"][0]
    assert (t["id"], t["function"]["name"], t["function"]["arguments"]) == ("call", "get_weather", "{}")


def test_A05_two_entries_of_one_index_in_one_chunk_merge() -> None:
    chunks = [c({"tool_calls": [{"index": 0, "id": "a", "function": {"name": "f", "arguments": "["}}, {"index": 0, "function": {"arguments": "]"}}]})]
    assert msg(assemble("chat", chunks))["tool_calls"][0]["function"]["arguments"] == "[]"


def test_A06_legacy_function_call_concatenates() -> None:
    chunks = [c({"role": "assistant", "content": None, "function_call": {"name": "lookup", "arguments": ""}}), c({"function_call": {"arguments": "{\"q\":"}}), c({"function_call": {"arguments": "1}"}})]
    assert msg(assemble("chat", chunks))["function_call"] == {"name": "lookup", "arguments": '{"q":1}'}


def test_A07_chat_logprobs_content_and_refusal_arrays_concatenate() -> None:
    lp = lambda t: {"token": t, "logprob": -0.1, "bytes": None, "top_logprobs": []}  # noqa: E731
    chunks = [c({"content": "a"}, logprobs={"content": [lp("a")]}), c({"content": "b"}, logprobs={"content": [lp("b")], "refusal": [lp("r")]}), c({"content": ""}, logprobs=None)]
    r = assemble("chat", chunks)
    assert isinstance(r, dict)
    assert [x["token"] for x in r["choices"][0]["logprobs"]["content"]] == ["a", "b"]
    assert [x["token"] for x in r["choices"][0]["logprobs"]["refusal"]] == ["r"]


def test_A07_logprobs_null_when_no_chunk_had_them() -> None:
    r = assemble("chat", [c({"content": "a"}, logprobs=None)])
    assert isinstance(r, dict) and r["choices"][0]["logprobs"] is None


def _comp(text: str, **kw: Any) -> dict[str, Any]:
    return {"id": "cmpl", "object": "text_completion", "created": 1, "model": "m", "choices": [{"index": 0, "text": text, **kw}]}


def test_A08_completion_logprob_arrays_concatenate() -> None:
    chunks = [
        _comp(" P", logprobs={"tokens": [" P"], "token_logprobs": [-0.3], "text_offset": [0], "top_logprobs": [{" P": -0.3}]}),
        _comp(".", logprobs={"tokens": ["."], "token_logprobs": [-0.9], "text_offset": [2], "top_logprobs": [{".": -0.9}]}),
    ]
    r = assemble("completion", chunks)
    assert isinstance(r, dict)
    lp = r["choices"][0]["logprobs"]
    assert lp == {"tokens": [" P", "."], "token_logprobs": [-0.3, -0.9], "text_offset": [0, 2], "top_logprobs": [{" P": -0.3}, {".": -0.9}]}


def test_A09_completion_text_concatenates() -> None:
    r = assemble("completion", [_comp("He"), _comp("llo", finish_reason="stop")])
    assert isinstance(r, dict)
    assert (r["object"], r["choices"][0]["text"]) == ("text_completion", "Hello")


@pytest.mark.parametrize(
    "call",
    [
        {"index": 0, "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"index": 0, "id": "", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"index": 0, "id": "c1", "type": "function", "function": {"arguments": "{}"}},
        {"index": 0, "id": "c1", "type": "function", "function": {"name": "", "arguments": "{}"}},
    ],
    ids=["no id", "empty id", "no name", "empty name"],
)
def test_A10_every_tool_call_has_an_id_and_a_function_name(call: dict[str, Any]) -> None:
    r = assemble("chat", [c({"tool_calls": [call]})])
    assert isinstance(r, Failure) and (r.row, r.rule) == ("E02", "A10")


def test_A11_arguments_stay_engine_strings() -> None:
    raw = '{"city": "Par'  # not even valid JSON: the client interprets it
    r = msg(assemble("chat", [c({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": raw}}]})]))
    assert r["tool_calls"][0]["function"]["arguments"] == raw


@pytest.mark.parametrize(
    ("chunk", "what"),
    [
        (c({"audio": {"id": "a1", "data": "UklGR", "transcript": "hi"}}), "audio"),
        (c({"annotations": [{"type": "url_citation"}]}), "annotations"),
        (c({"tool_calls": [{"index": 0, "id": "c", "type": "custom", "custom": {"name": "x", "input": "y"}}]}), "custom tool"),
        (c({"tool_calls": [{"index": 0, "id": "c", "custom": {"input": "y"}}]}), "custom field"),
        (c({"reasoning_details": [{"type": "x"}]}), "unknown delta field"),
        (c({"content": "x"}, audio={"id": "a"}), "choice audio"),
        (c({"content": "x"}, hidden_states=[1.0]), "unknown choice field"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_A12_unsupported_fields_with_a_value_are_refused(chunk: dict[str, Any], what: str) -> None:
    r = assemble("chat", [chunk])
    assert isinstance(r, Failure) and (r.row, r.rule) == ("E01", "A12"), what


def test_A12_unsupported_fields_without_a_value_pass() -> None:
    r = assemble("chat", [c({"content": "x", "audio": None, "annotations": [], "reasoning_details": {}}, routed_experts=None)])
    assert msg(r)["content"] == "x"


@pytest.mark.parametrize(
    "chunk",
    [
        c({"content": 5}),
        c({"tool_calls": {"index": 0}}),
        c({"tool_calls": [{"index": "0", "id": "c"}]}),
        c({"tool_calls": [{"index": 0, "id": 3}]}),
        c({"tool_calls": [{"index": 0, "id": "c", "function": "f"}]}),
        c({"tool_calls": [{"index": 0, "id": "c", "function": {"name": "f", "arguments": {"a": 1}}}]}),
        c({"function_call": "f"}),
        c({"content": "x"}, logprobs={"content": "no"}),
        c({"content": "x"}, logprobs=[1]),
        c({"content": "x"}, finish_reason=1),
        c("delta"),  # type: ignore[arg-type]
        {"choices": {"index": 0}},
        {"choices": ["x"]},
        {"choices": [{"index": "0", "delta": {}}]},
        {"choices": [], "usage": "many"},
    ],
    ids=["content int", "tool_calls not list", "index str", "id int", "function str", "arguments object", "function_call str", "logprobs content str", "logprobs list", "finish_reason int", "delta str", "choices object", "choice str", "choice index str", "usage str"],
)
def test_A13_malformed_supported_fields_are_refused(chunk: dict[str, Any]) -> None:
    r = assemble("chat", [chunk])
    assert isinstance(r, Failure) and (r.row, r.rule) == ("E02", "A13")


def test_A13_non_object_event_is_refused() -> None:
    a = Assembler("chat")
    f = a.feed([1, 2])
    assert isinstance(f, Failure) and f.row == "E02"


def test_A14_metadata_first_non_null_wins() -> None:
    chunks = [
        {"id": "a", "created": 10, "model": "m", "system_fingerprint": None, "choices": [{"index": 0, "delta": {"content": "x"}}], "service_tier": "default"},
        {"id": "a", "created": 11, "model": "m", "system_fingerprint": "fp", "choices": [{"index": 0, "delta": {"content": "y"}}]},
        {"id": "a", "created": 12, "model": "m", "metadata": {"weight_version": "default"}, "choices": []},
    ]
    r = assemble("chat", chunks)
    assert isinstance(r, dict)
    assert (r["id"], r["created"], r["model"], r["system_fingerprint"], r["service_tier"], r["metadata"]) == ("a", 10, "m", "fp", "default", {"weight_version": "default"})
    assert r["object"] == "chat.completion"


def test_A15_last_non_null_usage_is_kept() -> None:
    chunks = [c({"content": "x"}), {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}, {"choices": [], "usage": None}]
    r = assemble("chat", chunks)
    assert isinstance(r, dict) and r["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}


def test_A16_finish_reason_is_kept() -> None:
    r = assemble("chat", [c({"content": "x"}), c({}, finish_reason="length")])
    assert isinstance(r, dict) and r["choices"][0]["finish_reason"] == "length"


def test_A17_stop_reason_and_matched_stop_are_kept() -> None:
    r = assemble("chat", [c({"content": "x"}, stop_reason=None), c({}, finish_reason="stop", stop_reason="\n", matched_stop=151645)])
    assert isinstance(r, dict)
    ch = r["choices"][0]
    assert (ch["stop_reason"], ch["matched_stop"]) == ("\n", 151645)


def test_A17_stop_reason_absent_when_never_sent() -> None:
    r = assemble("chat", [c({"content": "x"}, finish_reason="stop")])
    assert isinstance(r, dict) and "stop_reason" not in r["choices"][0]


def test_A18_usage_computed_when_the_engine_omits_it() -> None:
    r = assemble("chat", [c({"content": "a"}), c({"content": "b"}), c({}, finish_reason="stop")], prompt_tokens=11, measured=5)
    assert isinstance(r, dict) and r["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}


def test_A18_prompt_length_from_prompt_token_ids_when_present() -> None:
    first = c({"role": "assistant", "content": ""})
    first["prompt_token_ids"] = [1, 2, 3, 4]
    r = assemble("chat", [first, c({"content": "a"})], prompt_tokens=99)
    assert isinstance(r, dict) and r["usage"] == {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}


def test_A18_without_ids_output_events_are_counted() -> None:
    r = assemble("chat", [c({"content": "a"}), c({"content": ""}), c({"content": "b"})], prompt_tokens=2)
    assert isinstance(r, dict) and r["usage"]["completion_tokens"] == 2


def test_A19_finish_and_stop_reason_survive_usage_only_frames() -> None:
    r = assemble("chat", [c({"content": "x"}, finish_reason="stop", stop_reason=7), usage_chunk(), {"choices": [], "usage": None}])
    assert isinstance(r, dict)
    assert (r["choices"][0]["finish_reason"], r["choices"][0]["stop_reason"]) == ("stop", 7)


def test_A20_content_null_when_only_empty_content_arrived() -> None:
    chunks = [c({"role": "assistant", "content": ""}), c({"tool_calls": [{"index": 0, "id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})]
    assert msg(assemble("chat", chunks))["content"] is None


def test_A20_empty_answer_keeps_the_engines_empty_string() -> None:
    # vLLM's own non-streaming answer to an empty generation says content ""
    assert msg(assemble("chat", [c({"role": "assistant", "content": ""}), c({"content": ""}, finish_reason="stop")]))["content"] == ""


def test_A20_refusal_only_answer_has_content_null() -> None:
    assert msg(assemble("chat", [c({"role": "assistant", "content": None, "refusal": ""}), c({"refusal": "no"})]))["content"] is None


def test_A20_sglang_content_is_never_null() -> None:
    assert msg(assemble("chat", [c({"role": "assistant", "content": ""})], null_empty=False))["content"] == ""


def test_A21_finish_reason_policy_when_none_arrived() -> None:
    r = assemble("chat", [c({"content": "x"})])
    assert isinstance(r, dict) and r["choices"][0]["finish_reason"] == "stop"
    r = assemble("chat", [c({"tool_calls": [{"index": 0, "id": "0", "type": "function", "function": {"name": "f", "arguments": "{}"}}]})])
    assert isinstance(r, dict) and r["choices"][0]["finish_reason"] == "tool_calls"


def test_A22_token_ids_only_when_the_client_asked() -> None:
    first = c({"role": "assistant", "content": ""})
    first["prompt_token_ids"] = [1, 2]
    chunks = [first, c({"content": "a"}, token_ids=[5]), c({}, token_ids=[6, 7]), c({"content": ""}, finish_reason="stop", token_ids=[8])]
    r = assemble("chat", chunks, ids=True)
    assert isinstance(r, dict)
    assert (r["choices"][0]["token_ids"], r["prompt_token_ids"]) == ([5, 6, 7, 8], [1, 2])
    r = assemble("chat", chunks, ids=False)
    assert isinstance(r, dict)
    assert "token_ids" not in r["choices"][0] and "prompt_token_ids" not in r


def test_A22_completion_prompt_token_ids_live_in_the_choice() -> None:
    chunks = [_comp("a", prompt_token_ids=[1, 2], token_ids=[9]), _comp("", prompt_token_ids=None, token_ids=[10], finish_reason="stop")]
    r = assemble("completion", chunks, ids=True)
    assert isinstance(r, dict)
    assert (r["choices"][0]["token_ids"], r["choices"][0]["prompt_token_ids"]) == ([9, 10], [1, 2])


def test_A23_role_from_the_role_chunk() -> None:
    assert msg(assemble("chat", [c({"content": "x"})]))["role"] == "assistant"


def test_D01_repeated_tgi_tool_call_id_stays_one_id() -> None:
    n = ToolCallNormaliser()
    chunks = [c({"tool_calls": [{"index": 0, "id": "0", "type": "function", "function": {"name": "get_weather", "arguments": "{\"a"}}]}) for _ in range(1)]
    chunks += [c({"tool_calls": [{"index": 0, "id": "0", "type": "function", "function": {"name": "get_weather", "arguments": p}}]}) for p in ("\":", "1}")]
    a = Assembler("chat")
    for ch in chunks:
        n(ch)
        assert a.feed(ch) is None
    r = a.finish(prompt_tokens=1)
    assert isinstance(r, dict)
    t = r["choices"][0]["message"]["tool_calls"][0]
    assert (t["id"], t["function"]["name"], t["function"]["arguments"]) == ("0", "get_weather", '{"a":1}')


def test_D03_null_and_absent_are_equal() -> None:
    a = assemble("chat", [c({"content": "x", "reasoning": None}, logprobs=None, token_ids=None)])
    b = assemble("chat", [c({"content": "x"})])
    assert a == b


def test_every_assembly_row_has_a_test_here() -> None:
    import sys

    names = [n for n in dir(sys.modules[__name__]) if n.startswith("test_")]
    for row in T.ROWS:
        assert any(n.startswith(f"test_{row.id}_") for n in names), f"no test for {row.id}"


# -- fixtures --------------------------------------------------------------------------

COVERED_MESSAGE = ("content", "reasoning", "reasoning_content", "refusal", "tool_calls", "function_call")
COVERED_CHOICE = ("logprobs", "finish_reason", "stop_reason", "matched_stop")


def _norm(v: Any) -> Any:
    """D03: null, absent, [] and {} alike, also for keys inside objects (vLLM drops null
    detail keys from streamed usage)."""
    if isinstance(v, dict):
        v = {k: _norm(x) for k, x in v.items() if _norm(x) is not None}
    return None if v in (None, [], {}) else v


def _dialect(name: str) -> tuple[bool, bool]:
    """(null content when empty, normalise TGI quirks) for a fixture's engine."""
    if "sglang" in name:
        return False, False
    return True, name.startswith(("tgi", "openai"))


FIXTURE_NAMES = sorted(p.name.removesuffix(".expected.json") for p in FIXTURES.glob("*.expected.json"))


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_fixture_assembles_like_the_engine(name: str) -> None:
    chunks = [json.loads(line) for line in (FIXTURES / f"{name}.jsonl").read_text().splitlines() if line.strip()]
    want = json.loads((FIXTURES / f"{name}.expected.json").read_text())
    route = "completion" if want["object"] == "text_completion" else "chat"
    null_empty, quirks = _dialect(name)
    ids = "vllm" in name
    a = Assembler(route, content_null_when_empty=null_empty, include_token_ids=ids)
    norm = ToolCallNormaliser() if quirks else None
    for ch in chunks:
        if norm is not None:
            norm(ch)
        assert a.feed(ch) is None
    got = a.finish(prompt_tokens=0)
    assert isinstance(got, dict), got
    for k in ("id", "object", "created", "model"):
        assert got[k] == want[k], k
    assert _norm(got.get("usage")) == _norm(want.get("usage"))
    if ids and route == "chat":
        assert got.get("prompt_token_ids") == want.get("prompt_token_ids")
    for gc, wc in zip(got["choices"], want["choices"], strict=True):
        for k in COVERED_CHOICE:
            assert _norm(gc.get(k)) == _norm(wc.get(k)), k
        if ids:
            assert gc.get("token_ids") == wc.get("token_ids")
        if route == "chat":
            for k in COVERED_MESSAGE:
                assert _norm(gc["message"].get(k)) == _norm(wc["message"].get(k)), k
        else:
            assert gc["text"] == wc["text"]
            if ids:
                assert gc.get("prompt_token_ids") == wc.get("prompt_token_ids")
