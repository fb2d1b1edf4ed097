"""The HTTP libraries are pinned to the ranges checked (narwhal/http/overrides.py): each
has an upper bound in pyproject.toml equal to overrides.CHECKED, and the installed version
is inside it -- a new h11, hypercorn or h2 fails here until its range is widened, and the
rest of the tests then say whether it may be."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet

from narwhal.http import overrides

_ROOT = Path(__file__).resolve().parents[2]


def _pins() -> dict[str, list[SpecifierSet]]:
    project = tomllib.loads((_ROOT / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for group in project["optional-dependencies"].values() for r in group)]
    out: dict[str, list[SpecifierSet]] = {}
    for r in reqs:
        req = Requirement(r)
        out.setdefault(req.name.lower(), []).append(req.specifier)
    return out


@pytest.mark.parametrize("name", sorted(overrides.CHECKED))
def test_each_http_library_is_pinned_to_the_checked_range(name: str) -> None:
    pins = _pins()[name]
    assert pins and all(p == SpecifierSet(overrides.CHECKED[name]) for p in pins), (name, pins)
    assert any(s.operator == "<" for s in pins[0]), f"{name}: no upper bound"


@pytest.mark.parametrize("name", sorted(overrides.CHECKED))
def test_the_installed_version_is_one_checked(name: str) -> None:
    assert version(name) in SpecifierSet(overrides.CHECKED[name]), f"{name} {version(name)} is outside {overrides.CHECKED[name]}: check it, then widen the range"
    assert name not in overrides.outside()


def test_outside_names_a_version_not_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(overrides.CHECKED, "h2", ">=99")
    assert overrides.outside() == {"h2": version("h2")}


_PRIVATE = re.compile(r"(from|import)\s+(h11|hypercorn|h2)\.([a-z_.]*\.)?_[a-z]|\._cstate|\.__class__\s*=|object\.__setattr__")


def test_nothing_reaches_into_the_http_libraries() -> None:
    """No private import of h11, hypercorn or h2, no class swapped on a live object, no
    frozen object written, and no module global of theirs replaced."""
    bad = []
    for path in (_ROOT / "narwhal").rglob("*.py"):
        text = path.read_text()
        for i, line in enumerate(text.splitlines(), 1):
            if _PRIVATE.search(line) or re.search(r"\b(_?h2mod|_?h11mod|_protocol|_tcp_server|_worker_context|_task_group)\.\w+\s*=", line):
                bad.append(f"{path.relative_to(_ROOT)}:{i}: {line.strip()}")
    assert bad == []
