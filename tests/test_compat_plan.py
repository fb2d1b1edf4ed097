"""scripts/compat/matrix.py's plan: which rows of docs/compatibility.md run now and which
are kept from the raw directory (--merge). A rerun of one profile or one router must not
drop the page's other rows."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SERVES = {"narwhal": ["unified", "reference", "sglang"], "vllm-router": ["unified", "sglang"], "envoy": ["unified"]}


def _matrix() -> ModuleType:
    path = Path(__file__).resolve().parents[1] / "scripts" / "compat" / "matrix.py"
    spec = importlib.util.spec_from_file_location("compat_matrix", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("compat_matrix", mod)
    spec.loader.exec_module(mod)
    return mod


def _rows(routers: list[str], profiles: list[str], merge: bool) -> tuple[set[tuple[str, str]], set[tuple[str, str]]]:
    plan = _matrix().plan(SERVES, routers, profiles, merge=merge)
    return {(r, p) for r, p, now in plan if now}, {(r, p) for r, p, now in plan if not now}


ALL = {(r, p) for r, ps in SERVES.items() for p in ps}

CASES = [
    # (routers, profiles, merge, run now, kept)
    ("everything afresh", list(SERVES), ["unified", "reference", "sglang"], False, ALL, set()),
    ("one router, merged", ["vllm-router"], ["unified", "reference", "sglang"], True,
     {("vllm-router", "unified"), ("vllm-router", "sglang")}, ALL - {("vllm-router", "unified"), ("vllm-router", "sglang")}),
    ("one profile, merged: the other profiles' rows stay", list(SERVES), ["unified"], True,
     {("narwhal", "unified"), ("vllm-router", "unified"), ("envoy", "unified")},
     {("narwhal", "reference"), ("narwhal", "sglang"), ("vllm-router", "sglang")}),
    ("one router on one profile, merged", ["envoy"], ["unified"], True, {("envoy", "unified")}, ALL - {("envoy", "unified")}),
    ("one profile afresh: the page has only it", list(SERVES), ["sglang"], False, {("narwhal", "sglang"), ("vllm-router", "sglang")}, set()),
    ("a profile the router does not serve runs nothing for it", ["envoy"], ["sglang"], True, set(), ALL),
]


@pytest.mark.parametrize(("routers", "profiles", "merge", "now", "kept"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_a_rerun_keeps_every_row_it_does_not_run(routers: list[str], profiles: list[str], merge: bool, now: set[tuple[str, str]], kept: set[tuple[str, str]]) -> None:
    assert _rows(routers, profiles, merge) == (now, kept)


def test_the_page_keeps_the_routers_and_profiles_in_order() -> None:
    plan = _matrix().plan(SERVES, ["envoy"], ["unified"], merge=True)
    assert [(r, p) for r, p, _ in plan] == [(r, p) for r, ps in SERVES.items() for p in ps]
