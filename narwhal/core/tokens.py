"""Token identity (spec/tables/token_identity.yaml): the ID check run once per engine event.

T02: every choice that carries output (non-empty text, reasoning, tool calls, refusal)
     carries `token_ids`.
T03: a valid list is a JSON array of integers >= 0; a Boolean is not an integer.
T04: IDs on events without output count too (vLLM's `delta: {}` while a parser holds
     tokens back).
The role chunk carries no output and needs no list (ENGINES.md pitfall 3).
"""

from __future__ import annotations

from typing import Any

from narwhal_generated import token_identity as _t

__all__ = ["check_token_ids", "carries_output", "OUTPUT_FIELDS", "ID_FIELDS"]

# T02: the fields whose non-empty value makes a choice output-carrying.
OUTPUT_FIELDS: tuple[str, ...] = _t.T02.fields
_STRING_OUTPUT = tuple(f for f in OUTPUT_FIELDS if f not in ("tool_calls", "function_call"))
# T10: the fields the router strips when it asked for them itself.
ID_FIELDS: tuple[str, ...] = _t.T10.fields


def carries_output(choice: dict[str, Any]) -> bool:
    """T02: does this streamed choice carry generated output?"""
    delta = choice.get("delta")
    src = delta if isinstance(delta, dict) else choice
    for f in _STRING_OUTPUT:
        v = src.get(f)
        if v and isinstance(v, str):
            return True
    tc = src.get("tool_calls")
    if tc:
        return True
    fc = src.get("function_call")
    return bool(fc)


def check_token_ids(obj: dict[str, Any]) -> tuple[int, str | None]:
    """(IDs counted, failure detail or None) for one parsed engine event (T02-T04)."""
    choices = obj.get("choices")
    if not choices or type(choices) is not list:
        return 0, None
    n = 0
    for choice in choices:
        if type(choice) is not dict:
            return n, "a choice is not an object"
        ids = choice.get("token_ids")
        if ids is None:
            if carries_output(choice):
                return n, f"choice {choice.get('index')} carries output without token_ids"  # T02
            continue
        if type(ids) is not list:
            return n, f"choice {choice.get('index')} token_ids is not a list"  # T03
        for x in ids:
            # T03: `type(x) is int` rejects bool (a subclass of int) and floats.
            if type(x) is not int or x < 0:
                return n, f"choice {choice.get('index')} token_ids holds {x!r}, not a nonnegative integer"
        if not ids and carries_output(choice):
            return n, f"choice {choice.get('index')} carries output with an empty token_ids list"
        n += len(ids)  # T04: every valid list counts, output-carrying or not
    return n, None
