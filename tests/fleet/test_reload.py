"""Configuration reload over HTTP (POST /admin/config/reload; narwhal/authority/reconfig.py):
the whole file validated first, run-time keys changed at once in the authority and the
data plane, restart-only keys named and left, an invalid file changing nothing (H11)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from narwhal.mock import MockConfig, running_fleet
from tests.helpers import RunningRouter, running_router, sse, wait_until

TOKEN = "reload-test-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def mocks() -> Iterator[dict[str, Any]]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name=n) for n in ("m0", "m1")]) as ms:
        yield {m.name: m for m in ms}


@pytest.fixture(autouse=True)
def admin_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NARWHAL_ADMIN_TOKEN", TOKEN)


def cfg(mocks: dict[str, Any], names: tuple[str, ...] = ("m0",), **admission: Any) -> dict[str, Any]:
    return {
        "serving": {"listen": "127.0.0.1:8000"},
        "admission": {"mode": "open", "queue_limit": 10, "prediction": {"profile_on_start": False}, **admission},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000},
        "engines": [{"name": f"e{n[1]}", "url": mocks[n].url, "role": "unified"} for n in names],
    }


def reload(rr: RunningRouter) -> httpx.Response:
    return httpx.post(rr.url + "/admin/config/reload", headers=AUTH, timeout=10)


def router_view(rr: RunningRouter) -> dict[str, Any]:
    return rr.get("/v1/engines").json()["router"]


def test_reload_changes_run_time_keys_names_the_rest_and_refuses_an_invalid_file(mocks: dict[str, Any], tmp_path: Path) -> None:
    f = tmp_path / "narwhal.yaml"
    first = cfg(mocks)
    f.write_text(yaml.safe_dump(first))
    with running_router(first) as rr:
        assert reload(rr).status_code == 404  # started without a file: H05
        rr.call(lambda: setattr(rr.router, "config_path", str(f)))
        r = reload(rr)
        assert r.status_code == 200, r.text
        assert r.json()["changed"] == [] and r.json()["restart_needed"] == []
        sha = r.json()["config"]["sha256"]
        assert router_view(rr)["config"]["sha256"] == sha

        new = cfg(mocks, ("m0", "m1"), queue_limit=20)
        new["serving"]["listen"] = "127.0.0.1:9999"
        new["upstream"] = {"deny_fields": ["colour"]}
        f.write_text(yaml.safe_dump(new))
        r = reload(rr)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["changed"] == ["admission.queue_limit", "engines", "upstream.deny_fields"]
        assert got["restart_needed"] == ["serving.listen"]
        assert got["fleet"]["added"] == ["e1"]
        assert got["config"]["sha256"] != sha
        view = router_view(rr)
        assert view["scheduler"]["queue_limit"] == 20 and view["config"]["sha256"] == got["config"]["sha256"]
        wait_until(lambda: {e["name"]: e["lifecycle"]["state"] for e in rr.get("/v1/engines").json()["data"]} == {"e0": "active", "e1": "active"},
                   timeout=10, what="e1 joined")
        # the data plane has the new deny-list: the field never reaches an engine
        for m in mocks.values():
            m.clear_requests()
        s = sse(rr.url, {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True, "colour": "red"})
        assert s.status == 200 and s.done
        bodies = [q["body"] for m in mocks.values() for q in m.requests()]
        assert len(bodies) == 1 and "colour" not in bodies[0]

        # invalid: nothing changes, the answer names the key
        bad = cfg(mocks, ("m1",), queue_limit=30)
        bad["admission"]["queue_limt"] = 5
        f.write_text(yaml.safe_dump(bad))
        r = reload(rr)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["code"] == "invalid_configuration" and "admission.queue_limt: unknown key" in err["message"], err
        assert router_view(rr)["scheduler"]["queue_limit"] == 20
        assert {e["name"] for e in rr.get("/v1/engines").json()["data"]} == {"e0", "e1"}
        f.write_text("admission: [\n")
        assert reload(rr).json()["error"]["code"] == "invalid_configuration"

        # engines removed by the file leave through the lifecycle; the config's own hash follows
        f.write_text(yaml.safe_dump(cfg(mocks, ("m1",), queue_limit=20)))
        r = reload(rr)
        assert r.json()["fleet"]["removed"] == ["e0"] and r.json()["restart_needed"] == []
        wait_until(lambda: [e["name"] for e in rr.get("/v1/engines").json()["data"]] == ["e1"], timeout=10, what="e0 gone")
        assert httpx.post(rr.url + "/admin/config/reload", timeout=10).status_code == 401
        rr.balanced()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_sighup_reloads_narwhal_serve_and_a_command_line_override_is_not_a_change(mocks: dict[str, Any], tmp_path: Path, workers: str) -> None:
    import os
    import signal
    import subprocess
    import sys

    from narwhal.http.server import free_port

    f = tmp_path / "narwhal.yaml"
    c = cfg(mocks)
    c["serving"]["shutdown_delay_ms"] = 0
    f.write_text(yaml.safe_dump(c))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "narwhal.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(f), "--listen", f"127.0.0.1:{port}", "--workers", workers],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        def view() -> dict[str, Any] | None:
            try:
                r = httpx.get(url + "/v1/engines", timeout=2)
            except httpx.HTTPError:
                return None
            return r.json()["router"] if r.status_code == 200 else None

        wait_until(view, timeout=45, what="narwhal serve up")
        assert view()["config"]["sha256"]  # type: ignore[index]
        c["admission"]["queue_limit"] = 33
        f.write_text(yaml.safe_dump(c))
        os.kill(proc.pid, signal.SIGHUP)
        wait_until(lambda: (v := view()) is not None and v["scheduler"]["queue_limit"] == 33, timeout=10, what="the reload on SIGHUP")
        r = httpx.post(url + "/admin/config/reload", headers=AUTH, timeout=10)
        assert r.status_code == 200 and r.json()["restart_needed"] == [], r.text  # --workers is the command line's
        assert proc.poll() is None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    assert "configuration reloaded" in log.read_text(), log.read_text()[-2000:]


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n"], ids=["empty", "blank", "comment only"])
def test_an_empty_configuration_is_refused_and_nothing_changes(mocks: dict[str, Any], tmp_path: Path, text: str) -> None:
    """Issue 40 item 1: an empty file answered 200 and applied every default (discovery
    dropped, admission to predictive, migration attempts 0). Now H11, nothing changed."""
    f = tmp_path / "narwhal.yaml"
    first = cfg(mocks, queue_limit=17)
    f.write_text(yaml.safe_dump(first))
    with running_router(first) as rr:
        rr.call(lambda: setattr(rr.router, "config_path", str(f)))
        assert reload(rr).status_code == 200
        sha = router_view(rr)["config"]["sha256"]
        f.write_text(text)
        r = reload(rr)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_configuration", r.text
        assert "empty" in r.json()["error"]["message"]
        view = router_view(rr)
        assert view["scheduler"]["queue_limit"] == 17 and view["config"]["sha256"] == sha
        assert [e["name"] for e in rr.get("/v1/engines").json()["data"]] == ["e0"]


def test_a_reload_during_an_in_place_write_waits_for_the_file_to_stand_still(mocks: dict[str, Any], tmp_path: Path) -> None:
    """Issue 40 item 1: a reload that reads the file half-written (truncated, then written
    a little later) takes the file as finally written, never the truncated one."""
    import threading
    import time

    f = tmp_path / "narwhal.yaml"
    first = cfg(mocks, queue_limit=17)
    f.write_text(yaml.safe_dump(first))
    with running_router(first) as rr:
        rr.call(lambda: setattr(rr.router, "config_path", str(f)))
        text = yaml.safe_dump(cfg(mocks, queue_limit=29))
        f.write_text(text[: len(text) // 3])  # the write under way: a valid but partial file

        def finish() -> None:
            time.sleep(0.1)
            f.write_text(text)

        t = threading.Thread(target=finish)
        t.start()
        r = reload(rr)
        t.join()
        assert r.status_code == 200, r.text
        assert router_view(rr)["scheduler"]["queue_limit"] == 29
