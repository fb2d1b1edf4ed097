"""narwhal/telemetry stands on nothing of the router: the data plane, the HTTP shell and
the authority call into it (tests/core/test_boundaries.py's rules, for this room)."""

from __future__ import annotations

from tests.core.test_boundaries import ROOT, TOOLS, _hits, imports

ROUTER = {"narwhal.core", "narwhal.http", "narwhal.authority", "narwhal.worker", "narwhal.upstream", "narwhal.ipc", "narwhal.mock",
          "narwhal.fleet", "narwhal.tenants", "narwhal.config", "narwhal.compose", "narwhal.workers", "narwhal.cli", *TOOLS}


def test_telemetry_imports_nothing_of_the_router() -> None:
    files = sorted((ROOT / "narwhal" / "telemetry").rglob("*.py"))
    assert files
    for path in files:
        assert not _hits(imports(path), ROUTER), path


def test_the_core_does_not_import_telemetry() -> None:
    for path in sorted((ROOT / "narwhal" / "core").glob("*.py")):
        assert not _hits(imports(path), {"narwhal.telemetry", "opentelemetry"}), path
