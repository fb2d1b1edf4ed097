"""`narwhal spec check`: regenerating gives a byte-identical tree, and any hand edit to
generated/ or changed row in spec/ is caught (docs/style.md P7)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from narwhal.specgen import SpecError, check, generate
from narwhal.specgen._load import load_spec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("repo")
    shutil.copytree(ROOT / "spec", d / "spec")
    shutil.copytree(ROOT / "generated", d / "generated", ignore=shutil.ignore_patterns("__pycache__"))
    return d


def test_checked_in_tree_is_up_to_date() -> None:
    assert check(ROOT) == []


def test_regenerating_is_byte_identical(tree: Path) -> None:
    before = {p.relative_to(tree).as_posix(): p.read_bytes() for p in (tree / "generated").rglob("*") if p.is_file()}
    generate(tree)
    after = {p.relative_to(tree).as_posix(): p.read_bytes() for p in (tree / "generated").rglob("*") if p.is_file()}
    assert before == after


@pytest.mark.parametrize("rel", ["errors.py", "openapi.json", "models/config.py", "MANIFEST", "TABLES.md", "assembly.py"])
def test_hand_edit_to_generated_fails(tree: Path, rel: str) -> None:
    p = tree / "generated" / rel
    orig = p.read_bytes()
    try:
        p.write_bytes(orig.replace(b"\n", b"\n# edited by hand\n", 1))
        assert check(tree) == [f"differs: generated/{rel}"]
    finally:
        p.write_bytes(orig)
    assert check(tree) == []


def test_stale_and_missing_files_fail(tree: Path) -> None:
    extra = tree / "generated" / "extra.py"
    extra.write_text("x = 1\n")
    try:
        assert check(tree) == ["stale (not generated): generated/extra.py"]
    finally:
        extra.unlink()
    p = tree / "generated" / "dialects.py"
    orig = p.read_bytes()
    p.unlink()
    try:
        assert check(tree) == ["missing: generated/dialects.py"]
    finally:
        p.write_bytes(orig)


def test_changed_spec_row_without_regenerating_fails(tree: Path) -> None:
    p = tree / "spec" / "tables" / "refusals.yaml"
    orig = p.read_text()
    try:
        p.write_text(orig.replace("code: admission_queue_full", "code: queue_full", 1))
        problems = check(tree)
        assert "differs: generated/errors.py" in problems and "differs: generated/MANIFEST" in problems
    finally:
        p.write_text(orig)


def test_invalid_table_names_the_row(tree: Path) -> None:
    p = tree / "spec" / "tables" / "refusals.yaml"
    orig = p.read_text()
    try:
        p.write_text(orig.replace("status: 413", "status: 200", 1))
        with pytest.raises(SpecError, match=r"refusals.yaml: rows/6/status"):
            load_spec(tree)
        p.write_text(orig.replace("code: request_too_large", "code: invalid_request", 1))
        with pytest.raises(SpecError, match="already names"):
            load_spec(tree)
    finally:
        p.write_text(orig)


def test_cli_check_exit_codes(tree: Path) -> None:
    ok = subprocess.run([sys.executable, "-m", "narwhal.cli", "spec", "check", "--root", str(tree)], capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    p = tree / "generated" / "errors.py"
    orig = p.read_bytes()
    p.write_bytes(orig + b"\n")
    try:
        bad = subprocess.run([sys.executable, "-m", "narwhal.cli", "spec", "check", "--root", str(tree)], capture_output=True, text=True, timeout=120)
        assert bad.returncode == 1 and "differs: generated/errors.py" in bad.stderr
    finally:
        p.write_bytes(orig)
