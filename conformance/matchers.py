"""Path assertions over JSON documents: the expectation language of the case files.

A path is dotted keys with list indexes: `json.choices[0].message.content`,
`sse.chunks[*].choices[*].token_ids`. `[n]` picks one item (negative counts from the
end), `[*]` every item. A path *selects* the list of values that exist at it; missing
keys and out-of-range indexes select nothing.

Operators (several may be combined in one assertion; all must hold):
  absent: true      nothing is selected           present: true   something is
  absent_or_null: true   nothing is selected, or only nulls (a key sent as null carries no value)
  equals: X         the value is X (with [*]: the list of selected values is X)
  not_equals: X     something is selected and it is not X
  join: "s"         the selected strings, concatenated (nulls skipped), are "s"
  flatten: [..]     the selected lists, concatenated, are [..]
  count: N          N values are selected
  length: N|{min,max}   each value (string, list, object) has that length
  type: T|[T..]     each value has JSON type T: null boolean integer number string array object
  one_of: [..]      each value is one of these
  matches: "re"     each value is a string with a match of the regular expression
  contains: X       each value (string or array) contains X
  min: N, max: N    each value is a number (or a decimal string) within the bounds
  distinct: true    the selected values are pairwise different
  same: true        something is selected and every selected value equals the first
  equals_path: P    the values selected by P (same document) are the selected values
Equality is JSON equality: true is not 1, 1 equals 1.0.
Operators that test "each value" fail when nothing is selected.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

__all__ = ["select", "check", "check_all", "OPS", "json_equal", "json_type", "PathError", "render"]

OPS = frozenset(
    {"absent", "absent_or_null", "present", "equals", "not_equals", "join", "flatten", "count", "length", "type", "one_of", "matches", "contains", "min", "max", "distinct", "same", "equals_path"}
)
_TOKEN = re.compile(r"([^.\[\]]+)|\[(\*|-?\d+)\]|(\.)")


class PathError(ValueError):
    pass


def _parse(path: str) -> list[str | int | None]:
    """Segments: str key, int index, None for [*]."""
    out: list[str | int | None] = []
    pos = 0
    for m in _TOKEN.finditer(path):
        if m.start() != pos:
            raise PathError(f"bad path {path!r} at {pos}")
        pos = m.end()
        if m.group(1) is not None:
            out.append(m.group(1))
        elif m.group(2) is not None:
            out.append(None if m.group(2) == "*" else int(m.group(2)))
    if pos != len(path) or not out:
        raise PathError(f"bad path {path!r}")
    return out


def select(doc: Any, path: str) -> tuple[list[Any], bool]:
    """(selected values, whether the path has a wildcard)."""
    segs = _parse(path)
    cur = [doc]
    for s in segs:
        nxt: list[Any] = []
        for v in cur:
            if isinstance(s, str):
                if isinstance(v, dict) and s in v:
                    nxt.append(v[s])
            elif s is None:
                if isinstance(v, list):
                    nxt.extend(v)
            elif isinstance(v, list) and -len(v) <= s < len(v):
                nxt.append(v[s])
        cur = nxt
    return cur, any(s is None for s in segs)


def json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def json_equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    return type(a) is type(b) and a == b


def render(v: Any, limit: int = 300) -> str:
    import json

    try:
        s = json.dumps(v, ensure_ascii=False, sort_keys=False)
    except (TypeError, ValueError):
        s = repr(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _num(v: Any) -> float | None:
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str) and re.fullmatch(r"-?\d+(\.\d+)?", v.strip()):
        return float(v)
    return None


def _length_ok(v: Any, spec: Any) -> bool:
    if not isinstance(v, (str, list, dict)):
        return False
    n = len(v)
    if isinstance(spec, dict):
        return bool(spec.get("min", n) <= n <= spec.get("max", n))
    return bool(n == spec)


def _contains(v: Any, x: Any) -> bool:
    if isinstance(v, str):
        return isinstance(x, str) and x in v
    if isinstance(v, list):
        return any(json_equal(i, x) for i in v)
    return False


def _distinct(sel: list[Any]) -> bool:
    return all(not json_equal(a, b) for i, a in enumerate(sel) for b in sel[i + 1 :])


def check(doc: Any, assertion: dict[str, Any]) -> list[tuple[str, str, str]]:
    """Failures of one assertion: (what, expected, actual) triples; [] when it holds."""
    path = assertion["path"]
    sel, wild = select(doc, path)
    actual = render(sel if wild else (sel[0] if sel else "<absent>"))
    out: list[tuple[str, str, str]] = []
    for op, want in assertion.items():
        if op in ("path", "why"):
            continue
        if op not in OPS:
            raise PathError(f"unknown operator {op!r} in assertion on {path}")
        failed = _op(op, want, sel, wild, doc)
        if failed is not None:
            expected, act = failed
            out.append((f"{path} ({op})", expected, actual if act is None else act))
    return out


def _op(op: str, want: Any, sel: list[Any], wild: bool, doc: Any) -> tuple[str, str | None] | None:
    """None when the operator holds, else (expected, actual or None for the selection)."""
    if op == "absent":
        return None if bool(sel) != bool(want) else ("absent" if want else "present", None)
    if op == "absent_or_null":
        held = all(v is None for v in sel)
        return None if held == bool(want) else ("absent or null" if want else "a non-null value", None)
    if op == "present":
        return None if bool(sel) == bool(want) else ("present" if want else "absent", None)
    if op == "equals":
        got = sel if wild else (sel[0] if sel else _MISSING)
        return None if got is not _MISSING and json_equal(got, want) else (render(want), None)
    if op == "not_equals":
        return None if sel and not any(json_equal(v, want) for v in sel) else (f"not {render(want)}", None)
    if op == "join":
        parts = [v for v in sel if v is not None]
        joined = "".join(p for p in parts if isinstance(p, str))
        ok = bool(sel) and all(isinstance(p, str) for p in parts) and joined == want
        return None if ok else (render(want), render(joined))
    if op == "flatten":
        flat: list[Any] = []
        for v in sel:
            if not isinstance(v, list):
                return render(want), render(sel)
            flat.extend(v)
        return None if sel and json_equal(flat, want) else (render(want), render(flat))
    if op == "count":
        return None if len(sel) == want else (f"{want} value(s)", f"{len(sel)}: {render(sel)}")
    if op == "distinct":
        return None if not want or _distinct(sel) else ("pairwise distinct values", None)
    if op == "same":
        held = bool(sel) and all(json_equal(v, sel[0]) for v in sel)
        return None if held == bool(want) else ("one value throughout" if want else "values that differ", None)
    if op == "equals_path":
        other, _ = select(doc, want)
        return None if sel and json_equal(sel, other) else (f"the value at {want}: {render(other)}", None)
    pred, expected = _EACH[op](want)
    return None if sel and all(pred(v) for v in sel) else (expected, None)


def _type_ok(types: list[str]) -> Any:
    return lambda v: json_type(v) in types or ("number" in types and json_type(v) == "integer")


def _bound(want: Any, low: bool) -> Any:
    def ok(v: Any) -> bool:
        n = _num(v)
        return n is not None and (n >= want if low else n <= want)

    return ok


# operators that test each selected value: want -> (predicate, what was expected)
_EACH: dict[str, Any] = {
    "length": lambda want: ((lambda v: _length_ok(v, want)), f"length {render(want)}"),
    "type": lambda want: (_type_ok(want if isinstance(want, list) else [want]), f"type {'|'.join(want if isinstance(want, list) else [want])}"),
    "one_of": lambda want: ((lambda v: any(json_equal(v, w) for w in want)), f"one of {render(want)}"),
    "matches": lambda want: ((lambda v: isinstance(v, str) and re.search(want, v) is not None), f"matching /{want}/"),
    "contains": lambda want: ((lambda v: _contains(v, want)), f"containing {render(want)}"),
    "min": lambda want: (_bound(want, True), f">= {want}"),
    "max": lambda want: (_bound(want, False), f"<= {want}"),
}


class _Missing:
    pass


_MISSING = _Missing()


def check_all(doc: Any, assertions: Iterable[dict[str, Any]]) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []
    for a in assertions:
        out.extend(check(doc, a))
    return out
