"""The case data: schema, ids, titles, and coverage of every spec row (the same check
as `narwhal conformance check`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from narwhal_conformance import matchers
from narwhal_conformance.cases import CASES_DIR, check_cases, load_cases, spec_rows, untestable
from narwhal_conformance.cli import run
from narwhal_conformance.profiles import PROFILES


def test_every_row_has_a_case_and_every_case_names_a_row() -> None:
    assert check_cases() == []


def test_the_check_command_passes(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from narwhal_conformance.cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--check-coverage"])) == 0
    assert "every spec row covered" in capsys.readouterr().out


def test_cases_cover_all_tables_and_profiles() -> None:
    cases = load_cases()
    assert len(cases) >= 120
    assert {c.id.split("/")[0] for c in cases} == {"refusals", "failures", "assembly", "token_identity", "router_states", "accounting", "migration"}
    assert {p for c in cases for p in c.profiles} == set(PROFILES)
    assert {c.cls for c in cases} == {"interoperability", "narwhal"}
    assert len([c for c in cases if "unified" in c.profiles]) >= 60
    covered = {r for c in cases for r in c.rows}
    for prefix, n in (("R", 14), ("E", 7), ("A", 23), ("D", 3), ("T", 12)):
        assert {f"{prefix}{i:02d}" for i in range(1, n + 1)} <= covered
    assert {r for r in spec_rows() if r.startswith("H")} - set(untestable()) <= covered
    assert {f"G{i:02d}" for i in range(1, 12)} - set(untestable()) <= covered  # stream migration (capability migration)


def _copy(tmp_path: Path) -> Path:
    root = tmp_path / "cases"
    shutil.copytree(CASES_DIR, root)
    return root


@pytest.mark.parametrize(
    ("edit", "problem"),
    [
        (lambda s: s.replace("title: refuses n over one with Invalid sampling width", "title: n over one should be refused"), "says 'should'"),
        (lambda s: s.replace("rows: [R06]", "rows: [R06, R99]"), "R99, which is no spec row"),
        (lambda s: s.replace("id: refusals/R06/1", "id: refusals/R06/2"), "does not match the file name"),
        (lambda s: s.replace("level: MUST", "level: MAYBE"), "MAYBE"),
        (lambda s: s.replace("expect:", "expect:\n      bogus: 1\n", 1), "bogus"),
    ],
)
def test_the_check_catches_bad_case_data(tmp_path: Path, edit: object, problem: str) -> None:
    root = _copy(tmp_path)
    f = root / "refusals" / "R06-1.yaml"
    f.write_text(edit(f.read_text()))  # type: ignore[operator]
    problems = check_cases(root)
    assert any(problem in p for p in problems), problems


def test_the_check_finds_a_row_without_a_case(tmp_path: Path) -> None:
    root = _copy(tmp_path)
    for f in (root / "refusals").glob("R06-*.yaml"):
        f.unlink()
    assert "row R06 (refusals) has no case" in check_cases(root)


@pytest.mark.parametrize(
    ("doc", "assertion", "ok"),
    [
        ({"a": [{"b": 1}, {"b": 2}]}, {"path": "a[*].b", "equals": [1, 2]}, True),
        ({"a": [{"b": 1}, {"b": 2}]}, {"path": "a[-1].b", "equals": 2}, True),
        ({"a": 1}, {"path": "a", "equals": True}, False),  # JSON equality: true is not 1
        ({"a": []}, {"path": "a[*].b", "absent": True}, True),
        ({"a": []}, {"path": "a[*].b", "type": "string"}, False),  # "each" fails on nothing
        ({"x": ["ab", None, "c"]}, {"path": "x[*]", "join": "abc"}, True),
        ({"x": [[1], [2, 3]]}, {"path": "x[*]", "flatten": [1, 2, 3]}, True),
        ({"h": "3"}, {"path": "h", "min": 2, "max": 4}, True),
        ({"h": "1"}, {"path": "h", "min": 2}, False),
        ({"i": ["a", "a"]}, {"path": "i[*]", "distinct": True}, False),
        ({"i": ["a", "a"]}, {"path": "i[*]", "same": True}, True),
        ({"i": ["a", "b"]}, {"path": "i[*]", "same": True}, False),
        ({"i": []}, {"path": "i[*]", "same": True}, False),  # nothing selected: not one value
        ({"p": {"k": 1}, "d": {"k": 1}}, {"path": "d", "equals_path": "p"}, True),
        ({"s": "chatcmpl-tool-ab"}, {"path": "s", "matches": "^chatcmpl-tool-"}, True),
    ],
)
def test_matchers(doc: object, assertion: dict[str, object], ok: bool) -> None:
    assert (matchers.check(doc, assertion) == []) is ok


def test_the_sse_document_keeps_comments() -> None:
    from narwhal_conformance.transport import parse_sse

    doc = parse_sse(b'data: {"id": "x", "choices": []}\n\n: x-narwhal-migrations 1\n\ndata: [DONE]\n\n')
    assert doc["comments"] == ["x-narwhal-migrations 1"] and doc["done"] and len(doc["chunks"]) == 1
    assert parse_sse(b"data: [DONE]\n\n")["comments"] == []
