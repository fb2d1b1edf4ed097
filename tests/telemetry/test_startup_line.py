"""Issue 40 item 8: under `--log-format json` every line the router writes is one JSON
object, the start-up line ("narwhal: serving model ... on ...") included; with text logs
that line stays as it was, on standard output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from narwhal.mock import MockConfig, running_fleet
from tests.helpers import serve_logging


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_every_line_of_narwhal_serve_is_json_under_log_format_json(tmp_path: Path, fmt: str) -> None:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0")]) as (m,), serve_logging(tmp_path, m.url, fmt, "warning") as (url, out, err):
        pass
    lines = [ln for ln in (out.read_text() + err.read_text()).splitlines() if ln.strip()]
    if fmt == "text":
        assert any(ln.startswith("narwhal: serving model 'narwhal-demo' on http://127.0.0.1:") for ln in out.read_text().splitlines())
        return
    objs = [json.loads(ln) for ln in lines]  # every line: a JSON object (a plain line raises here)
    assert all(isinstance(x, dict) for x in objs), lines
    start = [x for x in objs if x.get("event") == "serving"]
    assert len(start) == 1, lines
    assert start[0]["model"] == "narwhal-demo" and start[0]["listen"] == url and start[0]["engines"] == 1
    assert start[0]["level"] == "info" and start[0]["msg"].startswith("narwhal: serving model")
