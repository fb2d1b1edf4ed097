"""Engine health polling and the circuit breaker; profiling that fails on bad token IDs (T07)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import httpx
import pytest

from narwhal.http.server import free_port
from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E
from tests.helpers import running_router, wait_until

BODY = {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def test_breaker_opens_on_failed_polls_and_closes_after_the_cooldown() -> None:
    with running_fleet([MockConfig(name="u0", timing=Timing(time_scale=0.2))]) as (m,):
        cfg = {
            "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
            "monitoring": {"poll_interval_ms": 50, "stale_after_ms": 60000, "breaker_failures": 3, "breaker_cooldown_ms": 400},
        }
        with running_router(cfg, [EngineSpec("u0", m.url, "unified", "vllm", None, None)]) as rr:
            assert rr.post("/v1/chat/completions", json=BODY).status_code == 200
            httpx.post(m.url + "/mock/health", json={"healthy": False}, timeout=5)

            def eng() -> dict[str, object]:
                return rr.get("/v1/engines").json()["data"][0]

            wait_until(lambda: "circuit_open" in eng()["ineligible_reasons"], timeout=10, what="the breaker to open")
            assert "unhealthy" in eng()["ineligible_reasons"]
            r = rr.post("/v1/chat/completions", json=BODY)
            assert r.status_code == 503 and r.json()["error"]["code"] == E.R09.code
            httpx.post(m.url + "/mock/health", json={"healthy": True}, timeout=5)
            wait_until(lambda: eng()["eligible"], timeout=10, what="the breaker to close after the cooldown")
            assert eng()["circuit_breaker"]["opens"] >= 1
            assert rr.post("/v1/chat/completions", json=BODY).status_code == 200
            rr.balanced()


@pytest.fixture
def bad_ids_engine() -> Iterator[str]:
    """A vLLM-dialect engine whose streams carry text without token IDs."""
    port = free_port()
    loop = asyncio.new_event_loop()
    stop = threading.Event()

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await r.readuntil(b"\r\n\r\n")
                n = next((int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length:")), 0)
                if n:
                    await r.readexactly(n)
                if head.startswith(b"GET"):
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}")
                else:
                    ev = b'data: {"id":"x","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}\n\ndata: [DONE]\n\n'
                    w.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n" % len(ev) + ev)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            w.close()

    async def main() -> None:
        srv = await asyncio.start_server(handle, "127.0.0.1", port)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        srv.close()

    th = threading.Thread(target=lambda: loop.run_until_complete(main()), daemon=True)
    th.start()
    yield f"http://127.0.0.1:{port}"
    stop.set()
    th.join(5)


def test_T07_profiling_with_bad_token_ids_fails(bad_ids_engine: str) -> None:
    cfg = {"monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000}}
    with running_router(cfg, [EngineSpec("u0", bad_ids_engine, "unified", "vllm", None, None)]) as rr:
        prof = rr.get("/v1/engines").json()["data"][0]["profile"]
        assert prof["status"] == "failed" and prof["error"].startswith("E03"), prof
        assert prof["prefill"]["fitted"] is False  # the models keep their previous values


def test_an_engine_down_at_start_is_profiled_when_it_comes_up() -> None:
    port = free_port()
    cfg = {"monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000}, "admission": {"prediction": {"profile_prompt_tokens": [16, 64, 128], "profile_repeats": 1}}}
    with running_router(cfg, [EngineSpec("u0", f"http://127.0.0.1:{port}", "unified", "vllm", None, None)]) as rr:
        eng = lambda: rr.get("/v1/engines").json()["data"][0]  # noqa: E731
        assert eng()["profile"]["status"] == "pending" and not eng()["healthy"]
        import socket as _s

        from narwhal.mock import create_mock_app, serve_in_thread

        sock = _s.socket()
        sock.setsockopt(_s.SOL_SOCKET, _s.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        with serve_in_thread(lambda: [create_mock_app(MockConfig(name="u0", port=port, timing=Timing(time_scale=0.2)))], [sock]):
            wait_until(lambda: eng()["profile"]["status"] == "ok", timeout=20, what="the late engine to be profiled")
            assert eng()["profile"]["prefill"]["fitted"]
