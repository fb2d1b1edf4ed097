"""core/migration.py: whether a broken decode leg may be carried on, and the continuation."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.core.migration import (
    DROPPED_FIELDS,
    REASONS,
    Progress,
    Rejoin,
    continuation,
    obstacle,
    straddles,
)
from narwhal.mock.scenarios import sequence_script

PLAIN = Progress(output_ids=(1000, 1001), text="Hello wor", plain=True, attempts=0, deadline_left_ms=None)
CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "temperature": 0}


def progress(**kw: Any) -> Progress:
    return Progress(**{**{f: getattr(PLAIN, f) for f in PLAIN.__slots__}, **kw})


# (name, route, body changes, progress changes, max_attempts, token_ids, projected ttft ms, reason)
CASES = [
    ("carried on", "chat", {}, {}, 1, True, 50.0, None),
    ("off by default", "chat", {}, {}, 0, True, 50.0, "not_enabled"),
    ("no token IDs", "chat", {}, {}, 1, False, 50.0, "no_token_ids"),
    ("attempts spent", "chat", {}, {"attempts": 2}, 2, True, 50.0, "attempts_spent"),
    ("one attempt left", "chat", {}, {"attempts": 1}, 2, True, 50.0, None),
    ("deadline too close", "chat", {}, {"deadline_left_ms": 40.0}, 1, True, 50.0, "deadline"),
    ("deadline far enough", "chat", {}, {"deadline_left_ms": 400.0}, 1, True, 50.0, None),
    ("echo", "completion", {"echo": True}, {}, 1, True, 50.0, "echo"),
    ("suffix", "completion", {"suffix": "x"}, {}, 1, True, 50.0, "echo"),
    ("logprobs (chat)", "chat", {"logprobs": True, "top_logprobs": 3}, {}, 1, True, 50.0, "logprobs"),
    ("logprobs false", "chat", {"logprobs": False}, {}, 1, True, 50.0, None),
    ("logprobs (completions)", "completion", {"logprobs": 2}, {}, 1, True, 50.0, "logprobs"),
    ("tools", "chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 1, True, 50.0, "structured"),
    ("response_format", "chat", {"response_format": {"type": "json_object"}}, {}, 1, True, 50.0, "structured"),
    ("guided_json", "completion", {"guided_json": {}}, {}, 1, True, 50.0, "structured"),
    ("reasoning seen", "chat", {}, {"plain": False}, 1, True, 50.0, "not_plain"),
    ("stop begun before the cut", "chat", {"stop": ["world!"]}, {}, 1, True, 50.0, "stop_straddles"),
    ("stop not begun", "chat", {"stop": ["END"]}, {}, 1, True, 50.0, None),
    ("stop as a string", "chat", {"stop": "or"}, {"text": "Hello wo"}, 1, True, 50.0, "stop_straddles"),
    ("every token out already", "chat", {}, {"max_tokens": 2}, 1, True, 50.0, "nothing_left"),
    ("one token left", "chat", {}, {"max_tokens": 3}, 1, True, 50.0, None),
    ("a batch of prompts", "completion", {"prompt": ["one", "two"]}, {}, 1, True, 50.0, "several_prompts"),
    ("a batch of token-ID prompts", "completion", {"prompt": [[1, 2], [3]]}, {}, 1, True, 50.0, "several_prompts"),
    ("one token-ID prompt", "completion", {"prompt": [1, 2, 3]}, {}, 1, True, 50.0, None),
    ("a batch of one", "completion", {"prompt": ["one"]}, {}, 1, True, 50.0, None),
]


@pytest.mark.parametrize(("name", "route", "body", "prog", "attempts", "ids", "ttft", "reason"), CASES, ids=[c[0] for c in CASES])
def test_obstacle(name: str, route: str, body: dict[str, Any], prog: dict[str, Any], attempts: int, ids: bool, ttft: float, reason: str | None) -> None:
    got = obstacle(route, {**CHAT, **body}, progress(**prog), max_attempts=attempts, token_ids=ids, projected_ttft_ms=ttft)
    assert (got.reason if got is not None else None) == reason


def test_every_reason_obstacle_decides_has_a_case() -> None:
    assert {c[-1] for c in CASES} - {None} == set(REASONS) - {"placement_refused", "carry_on"}


def test_obstacle_checks_the_rows_in_the_tables_order() -> None:
    """Everything wrong at once: take away the reason obstacle names, one at a time; the
    reasons come out in the order of spec/tables/migration.yaml."""
    body: dict[str, Any] = {**CHAT, "echo": True, "logprobs": True, "tools": [{}], "stop": ["wor" + "ld"], "prompt": ["a", "b"]}
    p = progress(attempts=1, deadline_left_ms=1.0, plain=False, max_tokens=2)
    kw: dict[str, Any] = {"max_attempts": 0, "token_ids": False, "projected_ttft_ms": 50.0}
    fixes = {
        "not_enabled": lambda: kw.update(max_attempts=1),
        "no_token_ids": lambda: kw.update(token_ids=True),
        "attempts_spent": lambda: kw.update(max_attempts=2),
        "deadline": lambda: kw.update(projected_ttft_ms=0.0),
        "echo": lambda: body.pop("echo"),
        "logprobs": lambda: body.pop("logprobs"),
        "structured": lambda: body.pop("tools"),
        "not_plain": lambda: None,
        "stop_straddles": lambda: body.pop("stop"),
        "several_prompts": lambda: body.update(prompt="hi"),
        "nothing_left": lambda: None,
    }
    seen: list[str] = []
    while (row := obstacle("completion", body, p, **kw)) is not None:
        why = row.reason
        seen.append(why)
        if why == "not_plain":
            p = progress(attempts=1, deadline_left_ms=1.0, plain=True)
        if why == "nothing_left":
            p = progress(attempts=1, deadline_left_ms=1.0, plain=False)
        fixes[why]()
    assert seen == [r for r in REASONS if r not in ("placement_refused", "carry_on")]


@pytest.mark.parametrize(("text", "stops", "expected"), [
    ("abc", ["cd"], True), ("abc", ["abc"], False), ("ab", ["abc"], True), ("", ["x"], False), ("xyz", ["q", "yzw"], True), ("z", [""], False),
])
def test_straddles(text: str, stops: list[str], expected: bool) -> None:
    assert straddles(text, stops) is expected


def test_the_continuation_asks_for_what_is_left_with_the_same_sampling() -> None:
    body = {**CHAT, "max_completion_tokens": 10, "min_tokens": 4, "seed": 7, "top_p": 0.9, "stop": ["END"], "stream_options": {"include_usage": False},
            "logit_bias": {"5": 1}, "vendor_field": 1, "tool_choice": None}
    c = continuation(body, max_tokens=10, prompt_ids=[1, 2, 3], output_ids=[1000, 1001, 1002])
    assert c == {"model": "m", "prompt": [1, 2, 3, 1000, 1001, 1002], "max_tokens": 7, "min_tokens": 1, "temperature": 0, "seed": 7, "top_p": 0.9,
                 "stop": ["END"], "logit_bias": {"5": 1}, "vendor_field": 1, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    assert not DROPPED_FIELDS & (c.keys() - {"prompt", "max_tokens", "min_tokens", "stream", "stream_options", "return_token_ids"})
    assert "max_tokens" not in continuation(CHAT, max_tokens=None, prompt_ids=[1], output_ids=[2])
    with pytest.raises(ValueError):
        continuation(CHAT, max_tokens=3, prompt_ids=[1], output_ids=[2, 3, 4])


@pytest.mark.parametrize("cut", [1, 9, 25])
def test_on_a_sequence_mock_the_joined_answer_equals_the_uninterrupted_one(cut: int) -> None:
    prompt = [32256, 32259, 32257, 777, 778]
    whole = [p.token_id for p in sequence_script(prompt, max_tokens=32, ignore_eos=True).pieces]
    c = continuation({**CHAT, "ignore_eos": True}, max_tokens=32, prompt_ids=prompt, output_ids=whole[:cut])
    rest = [p.token_id for p in sequence_script(c["prompt"], max_tokens=c["max_tokens"], ignore_eos=c["ignore_eos"]).pieces]
    assert whole[:cut] + rest == whole


def _events(raw: bytes) -> list[object]:
    import orjson

    out: list[object] = []
    for part in raw.split(b"\n\n"):
        if part.startswith(b"data: "):
            body = part[6:]
            out.append(body.decode() if body == b"[DONE]" else orjson.loads(body))
    return out


CONT = [  # a vLLM completions stream on a token-ID prompt (docs/engines.md section 4)
    b'data: {"id":"cmpl-9","object":"text_completion","created":2,"model":"m","choices":[{"index":0,"text":" brave","logprobs":null,"finish_reason":null,'
    b'"stop_reason":null,"prompt_token_ids":[1,2,3,1000],"token_ids":[1007]}]}\n\n',
    b'data: {"id":"cmpl-9","object":"text_completion","created":2,"model":"m","choices":[{"index":0,"text":"","logprobs":null,"finish_reason":"length",'
    b'"stop_reason":null,"prompt_token_ids":null,"token_ids":[1008]}]}\n\n',
    b'data: {"id":"cmpl-9","object":"text_completion","created":2,"model":"m","choices":[],"usage":{"prompt_tokens":4,"total_tokens":6,"completion_tokens":2}}\n\n',
    b"data: [DONE]\n\n",
]


def test_rejoin_gives_a_chat_client_its_own_stream_one_id_and_usage_counted_once() -> None:
    rj = Rejoin(route="chat", id="chatcmpl-1", created=1, model="narwhal-demo", prompt_tokens=3, before=1, cached_tokens=0)
    evs = _events(b"".join(rj.feed(b[:7]) + rj.feed(b[7:]) for b in CONT))  # split mid-event: the parser holds the rest
    assert evs == [
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo",
         "choices": [{"index": 0, "delta": {"content": " brave"}, "logprobs": None, "finish_reason": None, "stop_reason": None, "token_ids": [1007]}]},
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo",
         "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length", "stop_reason": None, "token_ids": [1008]}]},
        {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "narwhal-demo", "choices": [],
         "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6, "prompt_tokens_details": {"cached_tokens": 0}}},
        "[DONE]",
    ]


def test_rejoin_for_a_completions_client_keeps_the_shape_and_drops_the_continuations_prompt_ids() -> None:
    rj = Rejoin(route="completion", id="cmpl-1", created=1, model="narwhal-demo", prompt_tokens=3, before=1)
    evs = _events(b"".join(rj.feed(b) for b in CONT))
    first = evs[0]
    assert isinstance(first, dict) and first["id"] == "cmpl-1" and first["object"] == "text_completion"
    assert "prompt_token_ids" not in first["choices"][0] and first["choices"][0]["text"] == " brave"
    assert evs[2] == {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "narwhal-demo", "choices": [],
                      "usage": {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}}


def test_rejoin_passes_errors_and_garbage_on_for_the_relay_to_judge_and_is_bounded() -> None:
    rj = Rejoin(route="chat", id="x", created=1, model="m", prompt_tokens=1, before=0, max_event_bytes=64)
    assert rj.feed(b'data: {"error":{"message":"boom"}}\n\ndata: not json\n\n') == b'data: {"error":{"message":"boom"}}\n\ndata: not json\n\n'
    rj.feed(b"data: " + b"x" * 100)
    assert rj.too_large
