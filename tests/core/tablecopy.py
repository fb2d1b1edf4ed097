"""A reordered copy of a spec table, regenerated in process through the specgen's Python
API (what `narwhal spec generate` would write), for the tests that reorder a table and
watch the router follow."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path
from typing import Any

from narwhal import specgen

ROOT = Path(__file__).resolve().parents[2]
SPEC = specgen.load_spec(ROOT)


def swapped(table: str, a: str, b: str, *, renumber: bool) -> str:
    """spec/tables/<table>.yaml with rows `a` and `b` (IDs) trading places (and, with
    `renumber`, their `order` values: 1..N in file order)."""
    text = (ROOT / "spec" / "tables" / f"{table}.yaml").read_text()
    head, rest = text.split("\nrows:\n", 1)
    body, tail = rest.split("\nnotes:\n", 1)
    blocks = re.split(r"(?m)^(?=  - id: )", body + "\n")  # every row's block ends its last line
    lead, rows = blocks[0], blocks[1:]
    ids = [re.match(r"  - id: (\w+)", r).group(1) for r in rows]  # type: ignore[union-attr]
    i, j = ids.index(a), ids.index(b)
    rows[i], rows[j] = rows[j], rows[i]
    if renumber:
        rows = [re.sub(r"(?m)^    order: \d+$", f"    order: {n}", r) for n, r in enumerate(rows, 1)]
    return head + "\nrows:\n" + lead + "".join(rows) + "notes:\n" + tail


def regenerated(text: str, module: str) -> Any:
    """generated/<module>.py rendered from the spec with `text` as its table, imported."""
    src = specgen.render_modules(specgen.with_table(SPEC, text))[f"{module}.py"]
    mod = types.ModuleType(f"{module}_reordered")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up while a class is made
    try:
        exec(compile(src, f"{mod.__name__}.py", "exec"), mod.__dict__)  # noqa: S102 - the generator's own output
    finally:
        del sys.modules[mod.__name__]
    return mod
