"""Introspection routes, request validation, the command line."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

from narwhal.mock import MockConfig, Timing, running_mock
from narwhal.mock.cli import add_arguments, config_from_args

from .support import chat_body, completion_body, get, post, request, wait_until


def test_recorded_requests_and_stats() -> None:
    with running_mock(MockConfig(dialect="sglang", timing=Timing(time_scale=0.01), record_limit=5)) as m:
        assert m.url == f"http://127.0.0.1:{m.port}" and m.name == f"unified-{m.port}"
        for i in range(7):
            post(m.url, chat_body(f"n{i}", return_token_ids=True), headers={"x-request-id": f"r{i}"})
        post(m.url, completion_body(), path="/v1/completions")
        recs = m.requests()
        assert len(recs) == 5 and recs[-1]["route"] == "completions" and recs[-2]["x_request_id"] == "r6"
        assert recs[-2]["body"]["return_token_ids"] is True  # bodies exactly as received
        over_http = get(m.url + "/mock/requests", timeout=5.0).json()
        assert over_http == recs
        stats = get(m.url + "/mock/stats", timeout=5.0).json()
        assert stats["requests"] == 8 and stats["completed"] == 8 and stats["in_flight"] == 0 and stats["prefill_queue"] == 0
        assert request("DELETE", m.url + "/mock/requests", timeout=5.0).status_code == 200 and m.requests() == []


def test_health_toggle() -> None:
    with running_mock(MockConfig(dialect="openai", timing=Timing(time_scale=0.01))) as m:
        assert request("POST", m.url + "/mock/health", json={"healthy": False}, timeout=5.0).json() == {"healthy": False}
        assert get(m.url + "/health", timeout=5.0).status_code == 503
        assert get(m.url + "/v1/models", timeout=5.0).status_code == 503  # the openai dialect's health path
        request("POST", m.url + "/mock/health", json={"healthy": True}, timeout=5.0)
        assert get(m.url + "/health", timeout=5.0).status_code == 200


def test_request_validation(fleet: dict) -> None:  # type: ignore[type-arg]
    v = fleet["vllm"].url
    assert request("POST", v + "/v1/chat/completions", content=b"{not json", timeout=5.0).status_code == 400
    assert post(v, {"model": "narwhal-demo", "messages": []}).status_code == 400
    assert post(v, {"model": "narwhal-demo"}, path="/v1/completions").status_code == 400
    assert post(v, chat_body(max_tokens=0)).status_code == 400
    r = post(v, chat_body(stream_options={"include_usage": True}))  # vLLM: stream_options need stream
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"
    assert post(fleet["openai"].url, chat_body(stream_options={"include_usage": True})).status_code == 200
    assert get(v + "/v1/chat/completions", timeout=5.0).status_code == 405
    assert get(v + "/nowhere", timeout=5.0).status_code == 404
    assert post(v, chat_body(return_token_ids="yes")).status_code == 200  # only `true` turns IDs on
    with running_mock(MockConfig(timing=Timing(time_scale=0.01), max_model_len=100)) as m:
        r = post(m.url, chat_body("x" * 400, max_tokens=10))
        assert r.status_code == 400 and "maximum context length is 100" in r.json()["error"]["message"]


def test_cli_arguments_build_the_config() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--dialect", "sglang", "--role", "decode", "--port", "9", "--model", "m", "--name", "d7", "--time-scale", "0.5", "--tpot-base-ms", "3", "--quirk", "tgi_repeat_ids", "--stream-interval", "2"])
    cfg = config_from_args(args)
    assert (cfg.dialect, cfg.role, cfg.port, cfg.model, cfg.engine_name()) == ("sglang", "decode", 9, "m", "d7")
    assert cfg.timing.time_scale == 0.5 and cfg.timing.tpot_base_ms == 3 and cfg.quirks == {"tgi_repeat_ids"} and cfg.stream_interval == 2
    assert config_from_args(p.parse_args(["--port", "9"])).engine_name() == "unified-9"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_python_dash_m_serves_and_stops() -> None:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "narwhal.mock", "--dialect", "openai", "--port", str(port), "--model", "m1", "--time-scale", "0.01"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        def up() -> bool:
            try:
                return get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, timeout=15, interval=0.05, what="the mock engine to serve")
        r = request("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]}, timeout=5.0)
        assert r.status_code == 200 and r.json()["object"] == "chat.completion"
        proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        assert proc.wait(timeout=10) == 0 and time.monotonic() - t0 < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
