"""`narwhal serve --log-format json` (workers 1 and 2) with traces to an in-test OTLP
receiver: one JSON line per request at its end with the documented fields, the router's
events (state change, fleet change over the admin API, reload) as JSON lines, traces from
the worker processes, and no prompt text, API key or admin token anywhere in the output."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from narwhal.http.server import free_port
from narwhal.telemetry.logs import REQUEST_FIELDS, ROUTER_EVENTS
from tests.telemetry.fleet import Recorded, recorded_fleet
from tests.telemetry.otlp import Receiver, receiver

ADMIN_ENV = "NARWHAL_TEST_TELEMETRY_ADMIN"
ADMIN = "admin-token-QUOKKA-93517"
KEY = "sk-live-PANGOLIN-SECRET-77104"
PROMPT = "the ocelot sings ZANZIBAR-PROMPT-55821 at dawn"
START_S = 45.0
STOP_S = 20.0


def sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Served:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, out: Path, err: Path, config: Path) -> None:
        self.proc, self.url, self.out, self.err, self.config = proc, url, out, err, config

    def post(self, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(self.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {KEY}", **(headers or {})}, timeout=30)

    def admin(self, method: str, path: str, body: Any = None) -> httpx.Response:
        return httpx.request(method, self.url + path, json=body, headers={"authorization": f"Bearer {ADMIN}"}, timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_S)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)  # the router's own group (start_new_session)
                self.proc.wait(10)

    def lines(self) -> list[dict[str, Any]]:
        """stderr: every line must be one JSON object."""
        out = []
        for ln in self.err.read_text(errors="replace").splitlines():
            if ln.strip():
                obj = json.loads(ln)
                assert isinstance(obj, dict), ln
                out.append(obj)
        return out


@contextlib.contextmanager
def served(tmp: Path, engines: list[Any], workers: int, otlp: Receiver) -> Iterator[Served]:
    keys = tmp / "keys.yaml"
    keys.write_text(yaml.safe_dump([{"id": "k-ocelot", "tenant": "acme", "sha256": sha(KEY)}]))
    port = free_port()
    cfg = {
        "engines": [{"name": m.name, "url": m.url, "role": "unified", "dialect": "vllm"} for m in engines],
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 200},
        "admin": {"token_env": ADMIN_ENV},
        "auth": {"keys_file": str(keys)},
        "serving": {"shutdown_delay_ms": 0, "shutdown_grace_ms": 2000},
        "observability": {"otlp_endpoint": otlp.endpoint, "sample_ratio": 1.0, "schedule_delay_ms": 20},
    }
    config = tmp / "narwhal.yaml"
    config.write_text(json.dumps(cfg))
    out, err = tmp / "stdout.log", tmp / "stderr.log"
    argv = [sys.executable, "-m", "narwhal.cli", "serve", "--config", str(config), "--listen", f"127.0.0.1:{port}",
            "--workers", str(workers), "--log-format", "json"]
    with open(out, "wb") as o, open(err, "wb") as e:
        proc = subprocess.Popen(argv, stdout=o, stderr=e, start_new_session=True, env={**os.environ, ADMIN_ENV: ADMIN, "PYTHONUNBUFFERED": "1"})
    s = Served(proc, f"http://127.0.0.1:{port}", out, err, config)
    try:
        end = time.monotonic() + START_S
        while True:
            assert proc.poll() is None, f"narwhal serve exited with {proc.returncode}: {err.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(s.url + "/ready", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < end, f"not ready in {START_S} s: {err.read_text()[-3000:]}"
            time.sleep(0.05)
        yield s
    finally:
        s.stop()


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[list[Any], dict[str, Recorded]]]:
    with recorded_fleet([("u0", "unified"), ("u1", "unified"), ("u9", "unified")]) as (mocks, rec):
        yield mocks, rec


@pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
def test_json_logs_and_traces_of_a_served_router(workers: int, fleet: Any, tmp_path: Path) -> None:
    mocks, rec = fleet
    two, spare = mocks[:2], mocks[2]
    client_tp = "00-5a1e0000000000000000000000000042-1111111111111111-01"
    with receiver() as otlp, served(tmp_path, two, workers, otlp) as r:
        for x in rec.values():
            x.seen.clear()
        msgs = [{"role": "user", "content": PROMPT}]
        a = r.post({"model": "narwhal-demo", "messages": msgs, "stream": True}, {"x-request-id": "log-stream-1", "traceparent": client_tp})
        b = r.post({"model": "narwhal-demo", "messages": msgs}, {"x-request-id": "log-plain-1"})
        c = r.post({"model": "nope", "messages": msgs}, {"x-request-id": "log-invalid-1"})
        d = httpx.post(r.url + "/v1/chat/completions", json={"model": "narwhal-demo", "messages": msgs},
                       headers={"x-request-id": "log-nokey-1", "authorization": "Bearer sk-wrong-WOMBAT-0001"}, timeout=30)
        assert (a.status_code, b.status_code, c.status_code, d.status_code) == (200, 200, 404, 401)
        # router events: state, fleet (PUT and DELETE), reload
        assert r.admin("POST", "/admin/state", {"state": "standby"}).status_code == 200
        assert r.admin("POST", "/admin/state", {"state": "active"}).status_code == 200
        assert r.admin("PUT", f"/admin/engines/{spare.name}", {"name": spare.name, "url": spare.url, "role": "unified", "dialect": "vllm"}).status_code == 200
        assert r.admin("DELETE", f"/admin/engines/{spare.name}").status_code == 200
        cfg = json.loads(r.config.read_text())
        cfg["admission"]["queue_limit"] = 100
        r.config.write_text(json.dumps(cfg))
        got = r.admin("POST", "/admin/config/reload")
        assert got.status_code == 200, got.text
        spans = otlp.wait_spans(lambda ss: {"log-stream-1", "log-plain-1"} <= {s.attrs.get("narwhal.request_id") for s in ss if s.name == "narwhal.request"})
        # an engine got the leg's traceparent, in the client's trace
        tps = [tp for n in ("u0", "u1") for _, tp, rid in rec[n].seen if rid == "log-stream-1"]
        r.stop()
        lines = r.lines()
        everything = r.out.read_text(errors="replace") + r.err.read_text(errors="replace")
    # -- traces from the data plane (a worker process with workers 2) --
    root = next(s for s in spans if s.name == "narwhal.request" and s.attrs["narwhal.request_id"] == "log-stream-1")
    assert root.trace_id == "5a1e0000000000000000000000000042" and root.parent_id == "1111111111111111"
    assert root.attrs["narwhal.tenant"] == "acme"
    mine = {s.name for s in spans if s.trace_id == root.trace_id}
    assert mine == {"narwhal.request", "narwhal.admission", "narwhal.decode", "narwhal.relay"}
    if workers == 2:
        assert root.resource.get("narwhal.worker") in (0, 1)
    dec = next(s for s in spans if s.trace_id == root.trace_id and s.name == "narwhal.decode")
    assert tps == [f"00-{root.trace_id}-{dec.span_id}-01"]
    # -- request_end lines: one per request, every documented field --
    ends = {x["request_id"]: x for x in lines if x.get("event") == "request_end"}
    assert sum(1 for x in lines if x.get("event") == "request_end") == 4
    assert set(ends) == {"log-stream-1", "log-plain-1", "log-invalid-1", "log-nokey-1"}
    for x in ends.values():
        assert set(REQUEST_FIELDS) <= set(x), set(REQUEST_FIELDS) - set(x)
        assert {"ts", "level", "logger"} <= set(x)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", x["ts"])
    s1, p1, i1, k1 = ends["log-stream-1"], ends["log-plain-1"], ends["log-invalid-1"], ends["log-nokey-1"]
    assert s1["class"] == "completed" and s1["status"] == 200 and s1["stream"] is True and s1["row"] is None
    assert s1["trace_id"] == root.trace_id and s1["sampled"] is True
    assert s1["tenant"] == "acme" and s1["key_id"] == "k-ocelot" and len(s1["engines"]) == 1
    assert s1["output_tokens"] == 16 and s1["ttft_ms"] > 0 and s1["tpot_ms"] is not None and s1["events"] >= 16
    assert s1["prompt_tokens"] > 0 and s1["request_bytes"] > len(PROMPT) and s1["finish_reason"] == "stop"
    assert p1["stream"] is False and p1["response_bytes"] > 0 and p1["class"] == "completed"
    assert (i1["class"], i1["row"], i1["status"]) == ("invalid_requests", "R05", 404)
    assert (k1["class"], k1["row"], k1["status"], k1["tenant"]) == ("invalid_requests", "R16", 401, None)
    if workers == 2:
        assert all(x.get("worker") in (0, 1) for x in ends.values())
    # -- the router's own events --
    events = [x for x in lines if x.get("event") in ROUTER_EVENTS]
    kinds = [x["event"] for x in events]
    states = [(x["state"], x["previous"]) for x in events if x["event"] == "router_state"]
    assert ("standby", "active") in states and ("active", "standby") in states
    assert {"engine_joining", "engine_leaving", "engine_gone", "config_reload"} <= set(kinds), kinds
    assert any(x["event"] == "engine_joining" and x["engine"] == spare.name and x["source"] == "admin" for x in events)
    reload = next(x for x in events if x["event"] == "config_reload")
    assert reload["changed"] == ["admission.queue_limit"] and len(reload["sha256"]) == 64
    for x in events:
        assert set(ROUTER_EVENTS[x["event"]]) <= set(x) | {"added", "updated", "replaced", "rejoining", "removed", "refused"}, x
    if workers == 2:
        assert "worker_up" in kinds
    # -- nothing secret, no client content --
    for secret in (PROMPT, "ZANZIBAR", KEY, "PANGOLIN", "WOMBAT", ADMIN, "QUOKKA"):
        assert secret not in everything, secret
