"""Behaviour parsing and the output script (no I/O)."""

from __future__ import annotations

import pytest

from narwhal.mock.scenarios import (
    EOS_ID,
    FAULTS,
    HIDDEN,
    TOOL_OPEN,
    Behaviour,
    BehaviourError,
    build_script,
    parse_behaviour,
)


def chat(text: str) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": text}]}


def test_plain_request_has_default_behaviour() -> None:
    assert parse_behaviour("chat", chat("hello")) == Behaviour()
    assert parse_behaviour("completions", {"prompt": [1, 2, 3]}) == Behaviour()


def test_body_field() -> None:
    b = parse_behaviour("chat", {"mock": {"scenario": "reasoning", "tokens": 9, "fault": "drop", "fault_after": 3, "fault_engines": ["d0"], "usage": False, "prefill_ms": 5, "unknown": 1}})
    assert (b.scenario, b.tokens, b.fault, b.fault_after, b.fault_engines, b.usage, b.prefill_ms) == ("reasoning", 9, "drop", 3, ("d0",), False, 5.0)
    assert b.fault_on("d0") == "drop" and b.fault_on("d1") is None


def test_directive_nested_json_and_brackets() -> None:
    b = parse_behaviour("completions", {"prompt": 'a [[mock {"fault_engines": ["x]]"], "fault": "reject"}]] b'})
    assert b.fault_engines == ("x]]",) and b.fault == "reject"
    last = parse_behaviour("chat", {"messages": [{"content": '[[mock {"tokens": 1}]]'}, {"content": '[[mock {"tokens": 2}]]'}]})
    assert last.tokens == 2


@pytest.mark.parametrize(
    "opts",
    [{"fault": "bogus"}, {"scenario": "nope"}, {"tokens": 1.5}, {"tokens": True}, {"fault_after": -1}, {"usage": "yes"}, {"fault_engines": [1]}, {"quirks": ["x"]}, {"tpot_ms": -1}],
)
def test_bad_values_raise(opts: dict[str, object]) -> None:
    with pytest.raises(BehaviourError):
        parse_behaviour("chat", {"mock": opts})


def test_tool_faults_imply_tool_calls() -> None:
    assert parse_behaviour("chat", {"mock": {"fault": "tool_call_no_id"}}).scenario == "tool_calls"
    assert "tool_call_no_name" in FAULTS


def test_scripts() -> None:
    plain = build_script(Behaviour(), route="chat", max_tokens=None)
    assert len(plain.pieces) == 16 and plain.pieces[-1].token_id == EOS_ID and plain.finish_reason == "stop"
    cut = build_script(Behaviour(), route="chat", max_tokens=1)
    assert len(cut.pieces) == 1 and cut.finish_reason == "length" and cut.matched_stop is None
    tools = build_script(Behaviour(scenario="tool_calls"), route="chat", max_tokens=None)
    assert tools.finish_reason == "tool_calls" and [p.index for p in tools.pieces if p.kind == TOOL_OPEN] == [0, 1]
    reasoning = build_script(Behaviour(scenario="reasoning", tokens=10), route="chat", max_tokens=None)
    assert len(reasoning.pieces) == 10 and [p.text for p in reasoning.pieces if p.kind == HIDDEN] == ["<think>", "</think>"]
    assert build_script(Behaviour(scenario="empty"), route="chat", max_tokens=None).pieces == ()
    assert build_script(Behaviour(scenario="tool_calls"), route="completions", max_tokens=None).finish_reason == "stop"
    eos = build_script(Behaviour(tokens=2), route="chat", max_tokens=30, ignore_eos=True)
    assert len(eos.pieces) == 30 and eos.finish_reason == "length"
    assert len(build_script(Behaviour(tokens=2), route="chat", max_tokens=None, min_tokens=5).pieces) == 5
