"""A new maintainer's checks on the README's house table and on what the repository cites.

  * Every path the house table names exists: its first column from the repository's root,
    every backticked file or folder in its second column from the row's folder, from a
    folder the same cell names, or from the root.
  * Every top-level folder git tracks (dot-folders aside) and every package under
    `narwhal/` has a row (or, for `narwhal/`, rows of its own packages).
  * No tracked file outside `generated/` (which only the generator writes) cites the
    outside documents the project was built from: what it relies on is stated in its own
    `spec/` and `docs/` (docs/contract.md, prediction.md, engines.md, stack.md, style.md).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_FILE = re.compile(r"\.(py|c|pyi|yaml|yml|json|md|png|ini|toml|sh|txt|jsonl|csv)$")


def house_rows(readme: str) -> list[tuple[str, str]]:
    """(first cell, second cell) of each row of the table under '## The house'."""
    section = readme.split("## The house", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        if line.startswith("| `"):
            cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
            rows.append((cells[0], " | ".join(cells[1:])))
    return rows


def _paths(cell: str) -> list[str]:
    """The file and folder paths a cell names in backticks (a word with a file extension,
    or one ending in '/'); commands, keys, routes and dotted names are not paths."""
    out = []
    for code in re.findall(r"`([^`\n]+)`", cell):
        for word in code.split():
            word = word.rstrip(".,:;)")
            if word.startswith(("/", "-", "http")) or any(c in word for c in "<>*{}$"):
                continue
            m = _FILE.search(word)
            if word.endswith("/") or (m is not None and "." not in word[: m.start()].rsplit("/", 1)[-1]):
                out.append(word)
    return out


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()


ROWS = house_rows((ROOT / "README.md").read_text())
FIRST = [p for first, _ in ROWS for p in _paths(first)]


def test_the_parser_reads_cells_as_paths() -> None:
    cell = "`tables/refusals.yaml` R01–R20, `admission.py`, `narwhal serve --log-format json`, `serving.relay_native`, `/v1/engines`, `narwhal/core/` (`quota.py`)"
    assert _paths(cell) == ["tables/refusals.yaml", "admission.py", "narwhal/core/", "quota.py"]
    assert house_rows("## The house\n\n| folder | holds |\n|---|---|\n| `spec/` | the `x.py` |\n\n## Next\n| `no/` | x |\n") == [("`spec/`", "the `x.py`")]


def test_the_house_table_has_rows() -> None:
    assert len(ROWS) >= 15 and len(FIRST) == len(ROWS)


@pytest.mark.parametrize("row", range(len(ROWS)), ids=[r[0].strip("`") for r in ROWS])
def test_every_path_the_house_table_names_exists(row: int) -> None:
    first, holds = ROWS[row]
    (folder,) = _paths(first)
    assert (ROOT / folder).exists(), f"{folder} does not exist"
    base = ROOT / folder if folder.endswith("/") else (ROOT / folder).parent
    named = [p for p in _paths(holds) if p.endswith("/")]
    bases = [base, ROOT, *(b / p for b in (ROOT, base) for p in named if (b / p).is_dir())]
    missing = [p for p in _paths(holds) if not any((b / p).exists() for b in bases)]
    assert not missing, f"the row {folder} names paths that are not in the tree: {missing}"


def test_every_top_level_folder_and_every_package_has_a_row() -> None:
    tracked = _tracked()
    top = {f.split("/", 1)[0] for f in tracked if "/" in f and not f.startswith(".")}
    named = {p.split("/", 1)[0] for p in FIRST}
    assert top - named == set(), f"top-level folders without a row in the README's house table: {sorted(top - named)}"
    packages = {f.split("/")[1] for f in tracked if f.startswith("narwhal/") and f.endswith("/__init__.py") and f.count("/") == 2}
    rows = {p.rstrip("/").split("/")[1] for p in FIRST if p.startswith("narwhal/") and p.count("/") >= 2}
    assert packages - rows == set(), f"packages of narwhal/ without a row in the house table: {sorted(packages - rows)}"


_OUTSIDE = [n + ".md" for n in ("NARWHAL", "PREDICTION", "ENGINES", "STACK", "STYLE", "ARCHITECTURE-REVIEW")]


def test_no_file_cites_a_document_the_repository_does_not_hold() -> None:
    found = []
    for rel in _tracked():
        if rel.startswith("generated/"):
            continue
        path = ROOT / rel
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if any(name in line for name in _OUTSIDE):
                found.append(f"{rel}:{i}: {line.strip()[:100]}")
    assert not found, "files cite documents the repository does not hold:\n" + "\n".join(found)


# -- small parts (issue 39): what one reading holds ----------------------------------------

MAX_FILE_LINES = 600
MAX_FUNCTION_LINES = 80
_SIZED = ("narwhal", "narwhal_bench", "conformance")


def _sources() -> list[Path]:
    return sorted(p for root in _SIZED for p in (ROOT / root).rglob("*.py") if ".venv" not in p.parts)


def test_no_source_file_is_past_600_lines() -> None:
    """generated/ aside (the generator writes it), no module of the router, the bench or
    the suite is longer than one reading holds."""
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files past {MAX_FILE_LINES} lines: {long}"


def test_no_function_is_past_80_lines() -> None:
    import ast

    long = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            end = getattr(node, "end_lineno", None)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and end is not None and end - node.lineno >= MAX_FUNCTION_LINES:
                long.append(f"{p.relative_to(ROOT)}:{node.lineno} {node.name} ({end - node.lineno + 1} lines)")
    assert not long, "functions past 80 lines: " + "; ".join(long)
