"""generated/CONFIG.md, the configuration reference (narwhal/specgen/config_doc.py): every key
of spec/schema/config.schema.json is rendered with its type, default, bound and
description; a synthetic schema covers each shape the renderer meets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.specgen import render
from narwhal.specgen.config_doc import config_keys, render_config_md

ROOT = Path(__file__).resolve().parents[2]
SCHEMA = json.loads((ROOT / "spec" / "schema" / "config.schema.json").read_text())

TOY = {
    "type": "object",
    "properties": {
        "a": {"$ref": "#/$defs/A", "default": {}},
        "b": {"anyOf": [{"$ref": "#/$defs/B"}, {"type": "null"}], "default": None},
        "list": {"type": ["array", "null"], "items": {"$ref": "#/$defs/B"}, "default": None},
        "map": {"type": "object", "maxProperties": 8, "additionalProperties": {"$ref": "#/$defs/B"}, "default": {}},
        "w": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 256}, {"const": "auto"}], "default": 1},
    },
    "$defs": {
        "A": {
            "type": "object",
            "description": "section A",
            "properties": {
                "n": {"type": "integer", "minimum": 1, "maximum": 10, "default": 3, "description": "a | b"},
                "mode": {"enum": ["x", "y"], "default": "x"},
                "on": {"type": "boolean", "default": True},
                "path": {"type": ["string", "null"], "default": None},
                "xs": {"type": "array", "items": {"type": "integer", "minimum": 1}, "maxItems": 4, "default": [1]},
            },
        },
        "B": {"type": "object", "required": ["k"], "properties": {"k": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 9}}},
    },
}

EXPECTED = [  # (path, type, default, bound)
    ("a", "section", "{}", ""),
    ("a.n", "integer", "3", ">= 1, <= 10"),
    ("a.mode", "enum", '"x"', '"x" | "y"'),
    ("a.on", "boolean", "true", "true | false"),
    ("a.path", "string or null", "null", "unbounded"),
    ("a.xs", "array of integer", "[1]", "<= 4 items, each >= 1"),
    ("b", "section", "null", ""),
    ("b.k", "string", "", "length <= 9, pattern `^[a-z]+$`"),
    ("list", "array of object or null", "null", "unbounded"),
    ("list[].k", "string", "", "length <= 9, pattern `^[a-z]+$`"),
    ("map", "object", "{}", "<= 8 entries"),
    ("map.NAME.k", "string", "", "length <= 9, pattern `^[a-z]+$`"),
    ("w", 'integer or "auto"', "1", '>= 1, <= 256, "auto"'),
]


@pytest.mark.parametrize("i", range(len(EXPECTED)), ids=[e[0] for e in EXPECTED])
def test_each_shape_renders_its_type_default_and_bound(i: int) -> None:
    keys = config_keys(TOY)
    assert [k["path"] for k in keys] == [e[0] for e in EXPECTED]
    k = keys[i]
    assert (k["path"], k["type"], k["default"], k["bound"]) == EXPECTED[i]


def test_a_cell_never_breaks_the_table() -> None:
    md = render_config_md(TOY)
    row = next(line for line in md.splitlines() if line.startswith("| `a.n`"))
    assert row == "| `a.n` | integer | `3` | >= 1, <= 10 | a \\| b |"
    assert "| **`a`** | section | `{}` |  | section A |" in md
    assert "| `list[].k` | string | *required* | length <= 9, pattern `^[a-z]+$` |  |" in md
    assert [k["path"] for k in config_keys(TOY) if k["required"]] == ["b.k", "list[].k", "map.NAME.k"]


def test_every_schema_key_is_in_the_reference_with_its_default_and_a_bound() -> None:
    md = (ROOT / "generated" / "CONFIG.md").read_text()
    rows = {line.split(" | ")[0].strip("|* `"): line for line in md.splitlines() if line.startswith("| ")}
    keys = config_keys(SCHEMA)
    assert len(keys) > 100
    for k in keys:
        assert k["path"] in rows, f"{k['path']} is not in generated/CONFIG.md"
        if k["default"] and not k["section"]:
            assert k["bound"], f"{k['path']} has a default and shows no bound"
            assert f"`{k['default']}`".replace("|", "\\|") in rows[k["path"]]


def test_the_generator_writes_the_reference() -> None:
    assert render(ROOT)["CONFIG.md"] == (ROOT / "generated" / "CONFIG.md").read_text()
