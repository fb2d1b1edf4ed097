"""Issue 40 item 8: under `--log-format json` every line the router writes is one JSON
object, the start-up line ("narwhal: serving model ... on ...") included; with text logs
that line stays as it was, on standard output."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, running_fleet
from tests.helpers import wait_until


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_every_line_of_narwhal_serve_is_json_under_log_format_json(tmp_path: Path, fmt: str) -> None:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0")]) as (m,):
        port = free_port()
        cfg = {"engines": [{"name": "u0", "url": m.url, "role": "unified", "dialect": "vllm"}],
               "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
               "serving": {"shutdown_delay_ms": 0, "shutdown_grace_ms": 500}}
        path = tmp_path / "narwhal.yaml"
        path.write_text(json.dumps(cfg))
        out, err = tmp_path / "out.log", tmp_path / "err.log"
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(path), "--listen", f"127.0.0.1:{port}",
                                     "--log-format", fmt, "--log-level", "warning"],
                                    stdout=o, stderr=e, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            def up() -> bool:
                assert proc.poll() is None, err.read_text()[-2000:]
                with contextlib.suppress(httpx.HTTPError):
                    return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
                return False

            wait_until(up, timeout=45, interval=0.1, what="narwhal serve ready")
            proc.send_signal(signal.SIGTERM)
            proc.wait(20)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    lines = [ln for ln in (out.read_text() + err.read_text()).splitlines() if ln.strip()]
    if fmt == "text":
        assert any(ln.startswith("narwhal: serving model 'narwhal-demo' on http://127.0.0.1:") for ln in out.read_text().splitlines())
        return
    objs = [json.loads(ln) for ln in lines]  # every line: a JSON object (a plain line raises here)
    assert all(isinstance(x, dict) for x in objs), lines
    start = [x for x in objs if x.get("event") == "serving"]
    assert len(start) == 1, lines
    assert start[0]["model"] == "narwhal-demo" and start[0]["listen"] == f"http://127.0.0.1:{port}" and start[0]["engines"] == 1
    assert start[0]["level"] == "info" and start[0]["msg"].startswith("narwhal: serving model")
