"""Token identity checks, rows T02-T04 (spec/tables/token_identity.yaml)."""

from __future__ import annotations

from typing import Any

import pytest

from narwhal.core.tokens import check_token_ids


def chat(delta: dict[str, Any], ids: Any = None, *, key: bool = True) -> dict[str, Any]:
    c: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": None}
    if key:
        c["token_ids"] = ids
    return {"choices": [c]}


def comp(text: str, ids: Any = None, *, key: bool = True) -> dict[str, Any]:
    c: dict[str, Any] = {"index": 0, "text": text}
    if key:
        c["token_ids"] = ids
    return {"choices": [c]}


OK = [
    ("T02 content with ids", chat({"content": "hi"}, [5]), 1),
    ("T02 reasoning with ids", chat({"reasoning": "hm"}, [5, 6]), 2),
    ("T02 reasoning_content with ids", chat({"reasoning_content": "hm"}, [5]), 1),
    ("T02 refusal with ids", chat({"refusal": "no"}, [7]), 1),
    ("T02 tool_calls with ids", chat({"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}, [8]), 1),
    ("T02 completion text with ids", comp("x", [9]), 1),
    ("T03 zero is a valid id", chat({"content": "a"}, [0]), 1),
    ("T04 ids on an empty delta count", chat({}, [151668, 271]), 2),
    ("T04 ids on a final empty-content chunk count", chat({"content": ""}, [151645]), 1),
    ("role chunk needs no ids (ENGINES pitfall 3)", chat({"role": "assistant", "content": ""}, key=False), 0),
    ("usage-only chunk", {"choices": [], "usage": {"prompt_tokens": 1}}, 0),
    ("null token_ids on a text-less chunk", chat({"content": ""}, None), 0),
    ("several ids in one event", chat({"content": "ab"}, [1, 2, 3]), 3),
]

BAD = [
    ("T02 content without the key", chat({"content": "hi"}, key=False)),
    ("T02 content with null ids", chat({"content": "hi"}, None)),
    ("T02 reasoning without ids", chat({"reasoning": "x"}, key=False)),
    ("T02 refusal without ids", chat({"refusal": "x"}, key=False)),
    ("T02 tool call without ids", chat({"tool_calls": [{"index": 0}]}, key=False)),
    ("T02 function_call without ids", chat({"function_call": {"name": "f"}}, key=False)),
    ("T02 completion text without ids", comp("x", key=False)),
    ("T02 empty list on output", chat({"content": "hi"}, [])),
    ("T03 Boolean id", chat({"content": "hi"}, [True])),
    ("T03 Boolean false id", chat({}, [False])),
    ("T03 negative id", chat({"content": "hi"}, [-1])),
    ("T03 float id", chat({"content": "hi"}, [1.0])),
    ("T03 string id", chat({"content": "hi"}, ["12"])),
    ("T03 not a list", chat({"content": "hi"}, 12)),
    ("T03 nested list", chat({"content": "hi"}, [[1]])),
    ("T03 malformed list on a text-less event", chat({}, [None])),
]


@pytest.mark.parametrize(("name", "event", "count"), OK, ids=[c[0] for c in OK])
def test_T02_T04_valid_lists_count(name: str, event: dict[str, Any], count: int) -> None:
    assert check_token_ids(event) == (count, None)


@pytest.mark.parametrize(("name", "event"), BAD, ids=[c[0] for c in BAD])
def test_T02_T03_missing_or_malformed_lists_fail(name: str, event: dict[str, Any]) -> None:
    _, err = check_token_ids(event)
    assert err is not None
