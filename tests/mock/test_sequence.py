"""MockConfig.sequence_output: answers that are a function of the whole token sequence, so
a continuation from the prompt's IDs plus the first k output IDs equals the uninterrupted
answer from token k on (issue 24, the test equipment of stream migration)."""

from __future__ import annotations

import pytest

from narwhal.mock import MockConfig, Timing, running_mock
from narwhal.mock.scenarios import EOS_ID, SEQUENCE_MAX_TOKENS, VOCAB, sequence_script

from .support import chat_body, completion_body, post, sse

PROMPT = [32256, 32259, 32257, 4711, 815, 99]


def ids(script) -> list[int]:  # type: ignore[no-untyped-def]
    return [p.token_id for p in script.pieces]


@pytest.mark.parametrize("k", [0, 1, 7, 30, 59])
def test_a_continuation_from_any_cut_equals_the_uninterrupted_answer(k: int) -> None:
    whole = sequence_script(PROMPT, max_tokens=60, ignore_eos=True)
    assert len(whole.pieces) == 60 and whole.finish_reason == "length"
    rest = sequence_script(PROMPT + ids(whole)[:k], max_tokens=60 - k, ignore_eos=True)
    assert ids(whole)[:k] + ids(rest) == ids(whole)
    assert [p.text for p in whole.pieces[k:]] == [p.text for p in rest.pieces]


def test_the_natural_end_is_kept_across_a_cut_min_tokens_reduced_alike() -> None:
    whole = sequence_script(PROMPT, max_tokens=None, min_tokens=5, eos_every=8)
    assert whole.finish_reason == "stop" and ids(whole)[-1] == EOS_ID and len(whole.pieces) > 5
    k = 3
    rest = sequence_script(PROMPT + ids(whole)[:k], max_tokens=None, min_tokens=5 - k, eos_every=8)
    assert ids(whole)[:k] + ids(rest) == ids(whole) and rest.finish_reason == "stop"


def test_different_prompts_give_different_answers_and_bounds_hold() -> None:
    a = ids(sequence_script(PROMPT, max_tokens=20, ignore_eos=True))
    b = ids(sequence_script(PROMPT[:-1] + [100], max_tokens=20, ignore_eos=True))
    assert a != b
    assert all(1000 <= t < 1000 + len(VOCAB) for t in a)
    assert len(sequence_script(PROMPT, max_tokens=None, eos_every=0).pieces) == SEQUENCE_MAX_TOKENS
    assert sequence_script(PROMPT, max_tokens=0).pieces == ()


def test_over_http_a_token_id_prompt_continues_a_chat_answer() -> None:
    """A chat answer, cut after k tokens, continued on another engine from the chat's
    prompt IDs (/tokenize) + the k output IDs as a completions token prompt."""
    cfg = MockConfig(dialect="vllm", timing=Timing(time_scale=0.0), sequence_output=True)
    with running_mock(cfg) as a, running_mock(cfg) as b:
        body = chat_body("tell me a long story", max_tokens=40, ignore_eos=True, stream=True, return_token_ids=True)
        whole = sse(a.url, body)
        out = [t for c in whole.chunks for ch in c.get("choices", []) for t in (ch.get("token_ids") or [])]
        assert len(out) == 40
        prompt = post(a.url, {"model": "narwhal-demo", "messages": body["messages"]}, path="/tokenize").json()["tokens"]
        k = 17
        rest = post(b.url, completion_body(prompt + out[:k], max_tokens=40 - k, ignore_eos=True, return_token_ids=True), path="/v1/completions").json()
        choice = rest["choices"][0]
        assert out[:k] + choice["token_ids"] == out
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in whole.chunks if c.get("choices"))
        assert text.endswith(choice["text"])


def test_without_sequence_output_answers_are_as_before() -> None:
    with running_mock(MockConfig(dialect="vllm", timing=Timing(time_scale=0.0))) as m:
        r = post(m.url, completion_body([5, 6, 7], max_tokens=3, return_token_ids=True), path="/v1/completions").json()
        assert r["choices"][0]["token_ids"] == [1000, 1001, 1002]


def test_a_request_may_ask_for_a_sequence_answer_itself() -> None:
    """`mock: {sequence: true}`: one request's answer as sequence_output makes it, on any
    engine (a continuation carries the body's `mock` field on)."""
    with running_mock(MockConfig(dialect="vllm", timing=Timing(time_scale=0.0))) as m:
        r = post(m.url, completion_body([5, 6, 7], max_tokens=3, return_token_ids=True, mock={"sequence": True}), path="/v1/completions").json()
        assert r["choices"][0]["token_ids"] == [p.token_id for p in sequence_script([5, 6, 7], max_tokens=3).pieces]
