"""The router's threat model, the files it watches (issue 40 items 1-3): an operator's
slip or an attacker with write access to a mounted volume must not be able to hang the
router, wipe its configuration, or keep a revoked key alive.

  * a keys file (or discovery.file, the JWKS file, --config) replaced by a FIFO (a hung
    network mount acts the same) neither blocks the watch nor the stop: the failure is
    logged and counted, a regular file put back later is read, SIGTERM ends the process;
  * a keys file edited with its size and modification time kept (touch -r, rsync
    --inplace -t) is seen: the revoked key is refused;
  * an empty configuration file is refused on SIGHUP (H11, nothing changed).

The routers run as `narwhal serve` in subprocesses of their own session, in front of a mock
engine; every wait is bounded and every process stopped by its PID in a `finally`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, running_fleet
from tests.helpers import wait_until

MODEL = "narwhal-demo"
KEY_A, KEY_B = "sk-watched-aaaa", "sk-watched-bbbb"


def _sha(k: str) -> str:
    return hashlib.sha256(k.encode()).hexdigest()


def _keys(*keys: str) -> str:
    return "".join(f"- {{id: k{k[-1]}, tenant: t, sha256: {_sha(k)}}}\n" for k in keys)


@pytest.fixture(scope="module")
def engine() -> Iterator[str]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", model=MODEL, name="u0")]) as fleet:
        yield fleet[0].url


@contextlib.contextmanager
def _serve(tmp: Path, cfg: dict[str, Any]) -> Iterator[tuple[subprocess.Popen[bytes], str, Path, Path]]:
    port = free_port()
    cfg = {**cfg, "serving": {"model": MODEL, "listen": f"127.0.0.1:{port}", "shutdown_delay_ms": 0, "shutdown_grace_ms": 1000}}
    path = tmp / "narwhal.yaml"
    path.write_text(json.dumps(cfg))
    log = tmp / "router.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(path), "--log-level", "info"],
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert proc.poll() is None, log.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/ready", timeout=1).status_code == 200
            return False

        wait_until(up, timeout=45, interval=0.1, what="narwhal serve ready")
        yield proc, url, path, log
    finally:
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)


def _status(url: str, key: str) -> int:
    return httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=5).status_code


def _base(engine: str) -> dict[str, Any]:
    return {"admission": {"mode": "open", "prediction": {"profile_on_start": False}},
            "engines": [{"name": "u0", "url": engine, "role": "unified", "dialect": "vllm"}]}


def test_a_keys_file_replaced_by_a_fifo_hangs_neither_the_watch_nor_the_stop(engine: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(_keys(KEY_A, KEY_B))
    cfg = {**_base(engine), "auth": {"keys_file": str(keys), "keys_interval_ms": 100}}
    with _serve(tmp_path, cfg) as (proc, url, _, log):
        assert _status(url, KEY_B) == 200
        keys.unlink()
        os.mkfifo(keys)  # opened by a blocking read, this waits for a writer for ever
        time.sleep(1.0)
        keys.unlink()
        keys.write_text(_keys(KEY_A))  # B revoked
        wait_until(lambda: _status(url, KEY_B) == 401, timeout=10, what="the revocation read after the FIFO")
        assert _status(url, KEY_A) == 200
        metrics = httpx.get(url + "/metrics", timeout=5).text
        errs = [ln for ln in metrics.splitlines() if ln.startswith('narwhal_auth_source_errors_total{source="keys_file"')]
        assert errs and float(errs[0].split()[-1]) >= 1, [ln for ln in metrics.splitlines() if "auth" in ln]
        assert "not a regular file" in log.read_text()
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)  # before: "stopped" logged, the process never exited


def test_sigterm_ends_the_router_while_a_watched_file_is_a_fifo(engine: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(_keys(KEY_A))
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text("[]\n")
    cfg = {**_base(engine), "auth": {"keys_file": str(keys), "keys_interval_ms": 100},
           "discovery": {"file": str(fleet), "file_interval_ms": 100}}
    with _serve(tmp_path, cfg) as (proc, _url, _, _log):
        for f in (keys, fleet):
            f.unlink()
            os.mkfifo(f)
        time.sleep(1.0)
        os.kill(proc.pid, signal.SIGTERM)
        proc.wait(20)


def test_a_keys_edit_keeping_size_and_mtime_is_seen(engine: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text(_keys(KEY_A, KEY_B))
    cfg = {**_base(engine), "auth": {"keys_file": str(keys), "keys_interval_ms": 100}}
    with _serve(tmp_path, cfg) as (_proc, url, _, _log):
        assert _status(url, KEY_B) == 200
        st = keys.stat()
        # B's line rewritten in place as another key of the same length, the time put back
        # (touch -r, rsync --inplace -t)
        text = _keys(KEY_A, "sk-watched-cccc")
        assert len(text) == st.st_size
        with keys.open("r+") as fh:
            fh.write(text)
        os.utime(keys, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert keys.stat().st_mtime_ns == st.st_mtime_ns and keys.stat().st_size == st.st_size
        wait_until(lambda: _status(url, KEY_B) == 401, timeout=5, what="the revocation of an edit keeping size and mtime")
        assert _status(url, "sk-watched-cccc") == 200


def test_an_empty_configuration_on_sighup_changes_nothing(engine: str, tmp_path: Path) -> None:
    with _serve(tmp_path, {**_base(engine), "admission": {"mode": "open", "queue_limit": 23, "prediction": {"profile_on_start": False}}}) as (proc, url, path, log):
        path.write_text("")
        os.kill(proc.pid, signal.SIGHUP)
        wait_until(lambda: "config_reload_failed" in log.read_text() or "nothing changed" in log.read_text(), timeout=10, what="the refusal logged")
        view = httpx.get(url + "/v1/engines", timeout=5).json()
        assert view["router"]["scheduler"]["queue_limit"] == 23 and view["router"]["scheduler"]["mode"] == "open"
        assert [e["name"] for e in view["data"]] == ["u0"]


def test_a_hung_read_times_out_is_counted_and_starts_no_second_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import narwhal.config as config
    from narwhal.config import FileRead, WatchedFile

    release = threading.Event()
    calls: list[str] = []
    real = config.read_watched

    def hung(path: str, max_bytes: int, *, setting: str = "") -> FileRead:
        calls.append(path)
        release.wait(10)  # a read on a hung network mount
        return real(path, max_bytes)

    monkeypatch.setattr(config, "read_watched", hung)
    f = tmp_path / "x.yaml"
    f.write_text("[]\n")
    w = WatchedFile(str(f), 1024, timeout=0.2)

    async def go() -> list[FileRead]:
        out = [await w.read(), await w.read()]
        release.set()
        await asyncio.sleep(0.1)
        out.append(await w.read())
        return out

    t0 = time.monotonic()
    first, second, third = asyncio.run(go())
    assert time.monotonic() - t0 < 3
    assert first.raw is None and "not read within" in str(first.error)
    assert second.raw is None and "has not returned" in str(second.error)
    assert third.raw == b"[]\n" and len(calls) == 2  # no read started while one hung
    assert w.failures == 2
