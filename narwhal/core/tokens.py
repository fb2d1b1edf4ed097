"""Token identity (spec/tables/token_identity.yaml): the ID check run once per engine event.

T02: every choice that carries output (non-empty text, reasoning, tool calls, refusal)
     carries `token_ids`.
T03: a valid list is a JSON array of integers >= 0; a Boolean is not an integer.
T04: IDs on events without output count too (vLLM's `delta: {}` while a parser holds
     tokens back).
The role chunk carries no output and needs no list (docs/engines.md pitfall 3).

A failure comes in two forms (`IdFailure`): `words`, which a client may read (row E03's
message, /v1/engines' profiling error) and which carry no engine-supplied value — not the
offending ID, not the engine's choice index — and `detail`, the same with those values
(shortened), for the log and the engine probe. An engine's values are its business and
the operator's, and a hostile or broken engine must not write into client messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from narwhal_generated import token_identity as _t

__all__ = ["check_token_ids", "token_id_failure", "IdFailure", "carries_output", "OUTPUT_FIELDS", "ID_FIELDS"]

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


@dataclass(frozen=True, slots=True)
class IdFailure:
    """A failed ID check: `words` for clients (no engine values), `detail` for the log."""

    words: str
    detail: str


_SHOW = 40  # characters of an engine value the log detail shows


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= _SHOW else r[:_SHOW] + "..."


def _kind(x: Any) -> str:
    """What an invalid ID is, in words (T03): never the value itself."""
    if type(x) is bool:
        return "a Boolean"
    if x is None:
        return "null"
    return {int: "an integer", float: "a number with a fraction or exponent", str: "a string", list: "a list", dict: "an object"}.get(type(x), "a value")


def _fail(pos: int, choice: dict[str, Any], what: str, value: Any = None, *, show: bool = False) -> IdFailure:
    # the position in `choices` is the router's own count; the engine's `index` is its
    # value, and goes to the log only
    words = f"the choice at position {pos} {what}"
    detail = f"choice {_show(choice.get('index'))} {what}" + (f" (got {_show(value)})" if show else "")
    return IdFailure(words, detail)


def token_id_failure(obj: dict[str, Any]) -> tuple[int, IdFailure | None]:
    """(IDs counted, failure or None) for one parsed engine event (T02-T04)."""
    choices = obj.get("choices")
    if not choices or type(choices) is not list:
        return 0, None
    n = 0
    for pos, choice in enumerate(choices):
        if type(choice) is not dict:
            return n, IdFailure("a choice is not an object", f"a choice is not an object (got {_show(choice)})")
        ids = choice.get("token_ids")
        if ids is None:
            if carries_output(choice):
                return n, _fail(pos, choice, "carries output without token_ids")  # T02
            continue
        if type(ids) is not list:
            return n, _fail(pos, choice, f"has token_ids that is {_kind(ids)}, not a list", ids, show=True)  # T03
        for x in ids:
            # T03: `type(x) is int` rejects bool (a subclass of int) and floats.
            if type(x) is not int or x < 0:
                what = "has a negative token ID" if type(x) is int else f"has a token ID that is {_kind(x)}, not a nonnegative integer"
                return n, _fail(pos, choice, what, x, show=True)
        if not ids and carries_output(choice):
            return n, _fail(pos, choice, "carries output with an empty token_ids list")
        n += len(ids)  # T04: every valid list counts, output-carrying or not
    return n, None


def check_token_ids(obj: dict[str, Any]) -> tuple[int, str | None]:
    """(IDs counted, failure detail or None): `token_id_failure` with the log's detail
    (engine values included), for the engine probe and tests."""
    n, f = token_id_failure(obj)
    return n, (None if f is None else f.detail)
