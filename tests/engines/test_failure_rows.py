"""A leg's failure carries its row typed, as the IPC messages do (narwhal/ipc.py: rows
travel by ID and come back as the generated constants): `UpstreamError.row` and
`Failed.row` are `narwhal_generated.errors` rows, never their IDs as strings.

  * each transport failure maps to the generated row itself (E07, E06, E02);
  * a Failed built from it keeps that row, and the row crosses the seam (Retry, Close)
    and comes back as the same object;
  * no call in the package builds a Failed or an UpstreamError from a string row.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from narwhal import ipc
from narwhal.upstream.client import Upstream, UpstreamError
from narwhal.upstream.h1conn import (
    BodyTooLarge,
    ConnectionFailed,
    ConnectTimeout,
    H1Error,
    ReadTimeout,
)
from narwhal.worker.failures import Failed
from narwhal_generated import errors as E

ROOT = Path(__file__).resolve().parents[2]

MAPPED = [  # (transport failure, its row, words the client reads)
    (ReadTimeout("sent nothing for 30000 ms"), E.E07, "sent nothing for 30000 ms"),
    (ConnectTimeout("no connection within 2000 ms"), E.E06, "no connection within 2000 ms (upstream.connect_timeout_ms)"),
    (BodyTooLarge("a body over 4194304 bytes"), E.E02, "a body over 4194304 bytes"),
    (ConnectionFailed("closed the connection", "connection closed by the engine (EOF)"), E.E06, "closed the connection"),
]


@pytest.mark.parametrize(("exc", "row", "detail"), MAPPED, ids=[type(m[0]).__name__ for m in MAPPED])
def test_a_transport_failure_maps_to_the_generated_row(exc: H1Error, row: E.ErrorRow, detail: str) -> None:
    x = Upstream.mapped(exc)
    assert isinstance(x, UpstreamError) and x.row is row and x.detail == detail
    assert str(x) == f"{row.id}: {detail}"
    f = Failed(x.row, f"engine d0: {x.detail}")
    assert f.row is row
    # the row crosses the seam by ID and comes back as the generated row itself
    for msg in (ipc.Retry(1, "d0", f.row, "decode", 2.0), ipc.Close(1, 2.0, None, "d0", f.row, None, None, None, None, None, None)):
        back = ipc.decode(ipc.encode(msg)[4:])
        assert back == msg and (back.row if isinstance(back, ipc.Retry) else back.failed_row) is row


def _string_rows(source: str, name: str) -> list[str]:
    """Calls of Failed(...) or UpstreamError(...) whose row is a string: a literal, or a
    row's `.id`."""
    out = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("Failed", "UpstreamError") and node.args:
            row = node.args[0]
            parts = [row.body, row.orelse] if isinstance(row, ast.IfExp) else [row]
            if any(isinstance(p, ast.Constant) or (isinstance(p, ast.Attribute) and p.attr == "id") for p in parts):
                out.append(f"{name}:{node.lineno}")
    return out


def test_the_scan_finds_a_string_row() -> None:
    probe = 'Failed(E.E02.id, "x")\nUpstreamError("E06", "y")\nFailed(E.E05.id if s < 500 else E.E04.id, "z")\nFailed(E.E02, "ok")\n'
    assert _string_rows(probe, "probe.py") == ["probe.py:1", "probe.py:2", "probe.py:3"]


def test_no_failure_is_built_from_a_string_row() -> None:
    found = [hit for p in sorted((ROOT / "narwhal").rglob("*.py")) for hit in _string_rows(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []
