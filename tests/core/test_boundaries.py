"""The sans-IO core imports no web framework, no socket, no event loop (STYLE.md P4), and
the layers import only downwards (NARWHAL.md's house)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN_IN_CORE = {"starlette", "hypercorn", "httpx", "anyio", "asyncio", "socket", "h11", "h2", "prometheus_client", "uvloop", "narwhal.http", "narwhal.engines", "narwhal.mock", "narwhal.bench", "narwhal_conformance"}
LAYERS = {
    "narwhal/core": {"narwhal.http", "narwhal.engines", "narwhal.mock", "narwhal.bench", "narwhal.cli", "narwhal_conformance"},
    "narwhal/engines": {"narwhal.http", "narwhal.bench", "narwhal.cli", "narwhal_conformance"},
    "narwhal/mock": {"narwhal.http", "narwhal.engines", "narwhal.bench", "narwhal.cli", "narwhal_conformance"},
    "generated": {"narwhal"},
}


def imports(path: Path) -> set[str]:
    out: set[str] = set()
    tree = ast.parse(path.read_text())
    pkg = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                out.add(".".join([*base, node.module or ""]).strip("."))
            elif node.module:
                out.add(node.module)
    return out


def _hits(names: set[str], banned: set[str]) -> set[str]:
    return {n for n in names for b in banned if n == b or n.startswith(b + ".")}


@pytest.mark.parametrize("path", sorted((ROOT / "narwhal" / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_is_sans_io(path: Path) -> None:
    assert not _hits(imports(path), FORBIDDEN_IN_CORE)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_downwards(layer: str) -> None:
    for path in sorted((ROOT / layer).rglob("*.py")):
        bad = _hits(imports(path), LAYERS[layer])
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
