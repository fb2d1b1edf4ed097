"""The house's rules, read from the imports (every import counts, those under
TYPE_CHECKING and inside functions too):

  * the sans-IO core imports no web framework, no socket, no event loop (docs/style.md P4);
  * the layers import only downwards, and the two planes meet only at the seam
    (narwhal/core/lease.py): the data plane (narwhal/worker) never reaches the authority's
    scheduler or fleet state, the authority never the data plane or HTTP;
  * the engine client (narwhal/upstream) stands on nothing of the router's;
  * the router's package imports neither the benchmark harness nor the conformance suite;
  * no module of the router imports itself back through others (no import circle).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = {"narwhal_bench", "narwhal_conformance"}
FORBIDDEN_IN_CORE = {"starlette", "hypercorn", "httpx", "anyio", "asyncio", "socket", "h11", "h2", "prometheus_client", "uvloop",
                     "narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.compose", "narwhal.workers", "narwhal.ipc",
                     "narwhal.mock", *TOOLS}
# the composition modules (narwhal/compose.py, narwhal/workers.py, narwhal/cli.py) may import anything of the router
ABOVE = {"narwhal.compose", "narwhal.workers", "narwhal.cli"}
LAYERS = {
    "narwhal/core": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.ipc", "narwhal.mock", *ABOVE, *TOOLS},
    "narwhal/upstream": {"narwhal.core", "narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.ipc", "narwhal.mock", "narwhal.config", *ABOVE, *TOOLS},
    # the authority: fleet truth and admission; never the data plane, HTTP or the mock engines
    "narwhal/authority": {"narwhal.http", "narwhal.worker", "narwhal.mock", *ABOVE, *TOOLS},
    # the data plane: admission only through the Lease (no scheduler, no EngineState)
    "narwhal/worker": {"narwhal.authority", "narwhal.http", "narwhal.core.admission", "narwhal.core.fleet", "narwhal.core.prediction", "narwhal.mock", *ABOVE, *TOOLS},
    # the ASGI shell: over the data plane only
    "narwhal/http": {"narwhal.authority", "narwhal.core.admission", "narwhal.core.fleet", "narwhal.mock", *ABOVE, *TOOLS},
    # the gateway's endpoint picker (issue 41): a shell over the data plane like narwhal/http,
    # admission only through the Lease
    "narwhal/gateway": {"narwhal.authority", "narwhal.core.admission", "narwhal.core.fleet", "narwhal.mock", *ABOVE, *TOOLS},
    # fleet sources: emit what they read; the authority applies it (never the other way)
    "narwhal/fleet": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.mock", *ABOVE, *TOOLS},
    # who is asking (issue 22): identity over the core and the configuration; no HTTP, no
    # planes (the data plane holds it, the authority will hold tenant limits)
    "narwhal/tenants": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.fleet", "narwhal.ipc", "narwhal.mock", *ABOVE, *TOOLS},
    # what operators see (issue 23): spans and log records of facts handed to it; it
    # reaches into no plane, no HTTP and no engine
    "narwhal/telemetry": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.fleet", "narwhal.mock", *ABOVE, *TOOLS},
    "narwhal/mock": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", *ABOVE, *TOOLS},
    "narwhal/specgen": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.mock", *ABOVE, *TOOLS},
    "narwhal/ipc.py": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.mock", *ABOVE, *TOOLS},
    "narwhal/config.py": {"narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.mock", *ABOVE, *TOOLS},
    "narwhal/compose.py": TOOLS,
    "narwhal/workers.py": TOOLS,
    "generated": {"narwhal"},
}


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


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
                mod = ".".join([*base, node.module or ""]).strip(".")
                if node.module is None:  # `from . import x`: the sibling modules, not the package face
                    out.update(f"{mod}.{a.name}" for a in node.names)
                else:
                    out.add(mod)
                    out.update(f"{mod}.{a.name}" for a in node.names)
            elif node.module:
                out.add(node.module)
                out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def _hits(names: set[str], banned: set[str]) -> set[str]:
    return {n for n in names for b in banned if n == b or n.startswith(b + ".")}


def _files(layer: str) -> list[Path]:
    p = ROOT / layer
    return [p] if p.suffix == ".py" else sorted(p.rglob("*.py"))


@pytest.mark.parametrize("path", sorted((ROOT / "narwhal" / "core").glob("*.py")), ids=lambda p: p.name)
def test_core_is_sans_io(path: Path) -> None:
    assert not _hits(imports(path), FORBIDDEN_IN_CORE)


def test_identity_is_sans_io() -> None:
    """narwhal/tenants/identity.py decides R15/R16 like the core decides rows: no I/O (the
    files are keys.py's), no web framework, no event loop."""
    assert not _hits(imports(ROOT / "narwhal" / "tenants" / "identity.py"), FORBIDDEN_IN_CORE | {"narwhal.config", "os", "yaml"})


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_downwards(layer: str) -> None:
    files = _files(layer)
    assert files, f"{layer} is gone: update LAYERS"
    for path in files:
        bad = _hits(imports(path), LAYERS[layer])
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_the_router_imports_no_tool() -> None:
    for path in sorted((ROOT / "narwhal").rglob("*.py")):
        bad = _hits(imports(path), TOOLS)
        assert not bad, f"{path.relative_to(ROOT)} imports {bad}"


def test_no_import_circle() -> None:
    """Module graph of narwhal/ (a module importing a package counts as importing its
    face, __init__): no strongly connected component of more than one module."""
    mods = {module_of(p): p for p in (ROOT / "narwhal").rglob("*.py")}
    graph = {m: {i for i in imports(p) if i in mods and i != m} for m, p in mods.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert not circles, f"import circles: {circles}"


def test_the_circle_that_was_cut_stays_cut() -> None:
    """core/fleet.py held a TYPE_CHECKING import of core/admission.py (Ticket)."""
    assert not _hits(imports(ROOT / "narwhal" / "core" / "fleet.py"), {"narwhal.core.admission"})
