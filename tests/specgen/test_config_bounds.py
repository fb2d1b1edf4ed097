"""Every configuration key is bounded (the project's rule: every buffer, wait and count has
a bound with a default a public deployment can live with; a knob without one is a defect).

`unbounded(schema)` walks spec/schema/config.schema.json through `$ref`, `anyOf`, list
items and map entries and names every value an operator's file could make as large as it
likes: a number without `maximum` (or `exclusiveMaximum`), a list without `maxItems`, a
map of named entries (`tenants.NAME`) without `maxProperties`, a string without
`maxLength` (enumerations and constants are bounded by their values). The real schema
names none; a schema with one such key is named, so the check can fail. Each bound is
also what the loader enforces: one past it is a start-up error naming the key.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from narwhal.config import ConfigError, parse_config

ROOT = Path(__file__).resolve().parents[2]
SCHEMA: dict[str, Any] = json.loads((ROOT / "spec" / "schema" / "config.schema.json").read_text())


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = schema["$defs"][node["$ref"].rsplit("/", 1)[-1]]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


def _types(node: dict[str, Any]) -> list[str]:
    t = node.get("type", [])
    return t if isinstance(t, list) else [t]


def _missing(node: dict[str, Any]) -> list[str]:
    """The bound keywords one node lacks."""
    if "enum" in node or "const" in node:
        return []
    ts, out = _types(node), []
    if ("integer" in ts or "number" in ts) and not {"maximum", "exclusiveMaximum"} & node.keys():
        out.append("maximum")
    if "array" in ts and "maxItems" not in node:
        out.append("maxItems")
    if "string" in ts and "maxLength" not in node:
        out.append("maxLength")
    if isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
        out.append("maxProperties")
    return out


def unbounded(schema: dict[str, Any]) -> list[tuple[str, str]]:
    """(key path, missing keyword) for every unbounded value the configuration holds."""
    out: list[tuple[str, str]] = []

    def walk(raw: dict[str, Any], path: str) -> None:
        node = _resolve(schema, raw)
        out.extend((path, m) for m in _missing(node))
        for alt in node.get("anyOf", []):
            walk(alt, path)
        for name, sub in node.get("properties", {}).items():
            walk(sub, f"{path}.{name}" if path else name)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"], f"{path}.NAME")

    walk(schema, "")
    return out


def test_every_key_of_the_configuration_is_bounded() -> None:
    assert unbounded(SCHEMA) == []


_BOUNDED: dict[str, Any] = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 1, "maximum": 9, "default": 1},
        "r": {"type": ["number", "null"], "exclusiveMaximum": 1, "default": None},
        "mode": {"enum": ["a", "b"], "default": "a"},
        "w": {"anyOf": [{"type": "integer", "maximum": 8}, {"const": "auto"}], "default": 1},
        "xs": {"type": "array", "maxItems": 4, "items": {"type": "string", "maxLength": 8}, "default": []},
        "map": {"type": "object", "maxProperties": 8, "additionalProperties": {"$ref": "#/$defs/E"}, "default": {}},
        "s": {"$ref": "#/$defs/E", "default": {}},
    },
    "$defs": {"E": {"type": "object", "additionalProperties": False, "properties": {"k": {"type": "string", "maxLength": 9}}}},
}

# (what is unbounded, the change that makes it so, what the walk must name)
_ONE_UNBOUNDED = [
    ("a number", lambda s: s["properties"]["n"].pop("maximum"), ("n", "maximum")),
    ("a nullable number", lambda s: s["properties"]["r"].pop("exclusiveMaximum"), ("r", "maximum")),
    ("an anyOf branch", lambda s: s["properties"]["w"]["anyOf"][0].pop("maximum"), ("w", "maximum")),
    ("a list", lambda s: s["properties"]["xs"].pop("maxItems"), ("xs", "maxItems")),
    ("a list's item", lambda s: s["properties"]["xs"]["items"].pop("maxLength"), ("xs[]", "maxLength")),
    ("a map", lambda s: s["properties"]["map"].pop("maxProperties"), ("map", "maxProperties")),
    ("a key of a map's entry", lambda s: s["$defs"]["E"]["properties"]["k"].pop("maxLength"), ("map.NAME.k", "maxLength")),
    ("a new key in a section", lambda s: s["$defs"]["E"]["properties"].update(t={"type": "integer", "minimum": 0, "default": 5}), ("map.NAME.t", "maximum")),
]


def test_a_bounded_schema_passes() -> None:
    assert unbounded(_BOUNDED) == []


@pytest.mark.parametrize(("what", "change", "named"), _ONE_UNBOUNDED, ids=[c[0] for c in _ONE_UNBOUNDED])
def test_one_unbounded_key_is_named(what: str, change: Any, named: tuple[str, str]) -> None:
    schema = json.loads(json.dumps(_BOUNDED))
    change(schema)
    got = unbounded(schema)
    assert named in got and {p for p, _ in got} <= {named[0], named[0].replace("map.NAME", "s")}


def test_the_real_schema_with_one_bound_removed_fails() -> None:
    schema = json.loads(json.dumps(SCHEMA))
    del schema["$defs"]["Admission"]["properties"]["queue_limit"]["maximum"]
    assert unbounded(schema) == [("admission.queue_limit", "maximum")]


# -- the loader enforces each bound: one past it is refused, naming the key -----------------


def _bounded_leaves(raw: dict[str, Any], path: tuple[str, ...]) -> list[tuple[tuple[str, ...], dict[str, Any]]]:
    """(path, schema) of every number and string key with its bound, through sections."""
    node = _resolve(SCHEMA, raw)
    out: list[tuple[tuple[str, ...], dict[str, Any]]] = []
    for alt in node.get("anyOf", []):
        out += _bounded_leaves(alt, path)
    for name, sub in node.get("properties", {}).items():
        out += _bounded_leaves(sub, (*path, name))
    if {"maximum", "maxLength"} & node.keys() and "properties" not in node:
        out.append((path, node))
    return out


_LEAVES = sorted({p: n for p, n in _bounded_leaves(SCHEMA, ()) if p[0] not in ("engines", "tenants")}.items())


_BRANCH = {"serving.workers": "Workers"}  # a union's error names the branch: `serving.workers.Workers: ...`


def _nest(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value  # type: ignore[no-any-return]


@pytest.mark.parametrize(("path", "node"), _LEAVES, ids=[".".join(p) for p, _ in _LEAVES])
def test_one_past_each_bound_is_refused_naming_the_key(path: tuple[str, ...], node: dict[str, Any]) -> None:
    if "maximum" in node:
        over: Any = node["maximum"] + node.get("multipleOf", 1 if "integer" in _types(node) else 0.5)
        said = "less than or equal to"
    else:
        over, said = "a" * (node["maxLength"] + 1), f"at most {node['maxLength']} characters"
    with pytest.raises(ConfigError) as e:
        parse_config(_nest(path, over))
    key = ".".join(path)
    errors = str(e.value).split(": ", 1)[1].split("; ")
    assert any(x.split(": ", 1)[0] in (key, f"{key}.{_BRANCH.get(key)}") and said in x for x in errors), errors


@pytest.mark.parametrize(("key", "entry", "limit"), [
    ("engines", {"name": "e", "url": "http://127.0.0.1:1"}, SCHEMA["properties"]["engines"]["maxItems"]),
    ("upstream.deny_fields", "f", SCHEMA["$defs"]["Upstream"]["properties"]["deny_fields"]["maxItems"]),
    ("admission.prediction.profile_prompt_tokens", 16, SCHEMA["$defs"]["Prediction"]["properties"]["profile_prompt_tokens"]["maxItems"]),
])
def test_a_list_past_its_bound_is_refused_naming_the_key(key: str, entry: Any, limit: int) -> None:
    with pytest.raises(ConfigError, match=rf"{key}: List should have at most {limit} items"):
        parse_config(_nest(tuple(key.split(".")), [entry] * (limit + 1)))
