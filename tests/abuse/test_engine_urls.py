"""Attack: learning the fleet from the outside. Engine URLs with userinfo
(http://user:pass@host) were published on the unauthenticated /v1/engines and sent
upstream as `Host: user:pass@host` with no Authorization; error envelopes reflected engine
addresses and raw engine bytes (`connect to 127.0.0.1:19499: Connection refused`,
`not an HTTP/1.x response: b'\\x00…'`). Defence: userinfo becomes `Authorization: Basic`
on every request to that engine (completions, health polls, profiling), Host names host
and port only, and the URL is published without it; client-facing messages name the
engine and say what happened in words, while the log keeps the address and the bytes
under the request ID (WARNING).

Also here, engine URLs and connections an operator gets wrong: an https:// engine URL
passed the config schema and failed every request (the engine client has no TLS); now
the configuration refuses it at start-up, naming the engine. An engine that accepts no
connection within upstream.connect_timeout_ms was reported with E07's idle-time words
(upstream.idle_timeout_ms); now it is a connect failure, E06, naming the connect knob.
(Other engine messages: test_engine_messages.py.)"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from narwhal.config import ConfigError, parse_config
from narwhal.http.server import free_port
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E
from tests.abuse.rawengine import (
    SSE_HEAD,
    Answer,
    Request,
    chunk,
    closed_port,
    raw_engine,
    token_event,
)
from tests.helpers import running_router, sse

USER, PASSWORD = "al@ice", "s3cr:t/pw"  # written percent-escaped in the URL
USERINFO = "al%40ice:s3cr%3At%2Fpw"
BASIC = "Basic " + base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
SECRETS = ("s3cr", "al%40ice", "al@ice", base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode(), "hunter2")


def base(**prediction: Any) -> dict[str, Any]:
    return {
        "admission": {"mode": "open", "prediction": {"profile_on_start": False, **prediction}},
        "monitoring": {"poll_interval_ms": 100, "stale_after_ms": 60000, "breaker_failures": 1000},
        "upstream": {"idle_timeout_ms": 3000},
    }


def chat(stream: bool = False) -> dict[str, Any]:
    return {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": stream}


@pytest.fixture
def warnings_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    caplog.set_level(logging.WARNING)
    yield caplog


# -- userinfo ------------------------------------------------------------------------


def test_userinfo_becomes_basic_auth_on_every_request_and_is_never_published(warnings_log: pytest.LogCaptureFixture) -> None:
    down = closed_port()
    with raw_engine() as eng:
        cfg = base(profile_prompt_tokens=[16, 32, 64], profile_repeats=1, profile_output_tokens=3, profile_on_start=True)
        cfg["engines"] = [
            {"name": "u0", "url": f"http://{USERINFO}@127.0.0.1:{eng.port}", "role": "unified", "dialect": "vllm"},
            {"name": "u1", "url": f"http://bob:hunter2@127.0.0.1:{down}/", "role": "unified", "dialect": "vllm"},
        ]
        with running_router(cfg) as rr:
            r = rr.post("/v1/chat/completions", json=chat())
            assert r.status_code == 200, r.text
            assert sse(rr.url, chat(stream=True)).done
            engines = rr.get("/v1/engines")
            metrics = rr.get("/metrics")
        seen = eng.all()
    kinds = {(q.method, q.path, "x-narwhal-profiling" in q.headers) for q in seen}
    assert {("GET", "/health", False), ("POST", "/v1/chat/completions", True), ("POST", "/v1/chat/completions", False)} <= kinds
    for q in seen:
        assert q.headers.get("authorization") == BASIC, q
        assert q.headers["host"] == f"127.0.0.1:{eng.port}"
    urls = {e["name"]: e["url"] for e in engines.json()["data"]}
    assert urls == {"u0": f"http://127.0.0.1:{eng.port}", "u1": f"http://127.0.0.1:{down}"}
    u1 = next(e for e in engines.json()["data"] if e["name"] == "u1")
    assert u1["last_error"] and "127.0.0.1" not in u1["last_error"] and str(down) not in u1["last_error"]
    for text in (engines.text, metrics.text, *(rec.getMessage() for rec in warnings_log.records)):
        assert not any(s in text for s in SECRETS), text
    assert any(f"127.0.0.1:{down}" in rec.getMessage() for rec in warnings_log.records), "the log keeps the address"


def test_engines_on_one_host_and_port_share_their_userinfo() -> None:
    cfg = {"engines": [
        {"name": "a", "url": "http://ann:hunter2@10.0.0.1:8000", "role": "unified"},
        {"name": "b", "url": "http://bob:other@10.0.0.1:8000/v2", "role": "unified"},
    ]}
    with pytest.raises(ConfigError, match="same userinfo") as exc:
        parse_config(cfg)
    assert "hunter2" not in str(exc.value) and "other" not in str(exc.value)


def test_engine_spec_keeps_no_credentials_in_its_url() -> None:
    s = EngineSpec("u0", f"http://{USERINFO}@engine.internal:9000/base/", "unified", "vllm", None, None)
    assert (s.url, s.authorization) == ("http://engine.internal:9000/base", BASIC)
    assert not any(x in repr(s) for x in SECRETS)


# -- what clients learn when an engine fails ------------------------------------------


async def _garbage(req: Request, w: asyncio.StreamWriter) -> None:
    w.write(b"\x00\x01\x02garbage 10.9.8.7\r\n\r\n")


async def _broken_chunking(req: Request, w: asyncio.StreamWriter) -> None:
    w.write(SSE_HEAD + chunk(token_event(0)))
    await w.drain()
    await asyncio.sleep(0.1)  # the token reaches the client: response headers are out
    w.write(b"zz garbage 10.9.8.7\r\n")


async def _http_500(req: Request, w: asyncio.StreamWriter) -> None:
    body = b"Traceback: connect to 10.9.8.7:5555 failed \x00\x01"
    w.write(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))


# (engine behaviour, row, words the client reads, raw detail only the log keeps)
FAILURES: list[tuple[str, Answer | None, E.ErrorRow, str, str]] = [
    ("refused", None, E.E06, "unreachable (connection refused)", "connection refused"),
    ("garbage", _garbage, E.E06, "not an HTTP/1.x response", "garbage 10.9.8.7"),
    ("http-500", _http_500, E.E04, "HTTP 500 with a body that is not JSON", "10.9.8.7:5555"),
]
LEAKS = ("127.0.0.1", "10.9.8.7", "garbage", "\\x00", "\x00", "Traceback")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize(("name", "answer", "row", "words", "raw"), FAILURES, ids=[f[0] for f in FAILURES])
def test_failure_messages_name_the_engine_not_its_address_or_bytes(
    warnings_log: pytest.LogCaptureFixture, name: str, answer: Answer | None, row: E.ErrorRow, words: str, raw: str, stream: bool
) -> None:
    with raw_engine(answer or _garbage) as eng:
        port = closed_port() if answer is None else eng.port
        # no health monitor: the engine stays eligible, so the request reaches it
        with running_router(base(), [EngineSpec("u0", f"http://127.0.0.1:{port}", "unified", "vllm", None, None)], start=False) as rr:
            rid = f"leak-{name}-{stream}"
            if stream:
                s = sse(rr.url, chat(stream=True), headers={"x-request-id": rid})
                status, text = s.status, s.body.decode()
            else:
                r = rr.post("/v1/chat/completions", json=chat(), headers={"x-request-id": rid})
                status, text = r.status_code, r.text
    assert status == row.status, text
    err = httpx.Response(status, content=text.encode()).json()["error"]
    assert err["code"] == row.code and "u0" in err["message"] and words in err["message"], err
    assert not any(x in err["message"] for x in (*LEAKS, str(port))), err
    logged = [rec.getMessage() for rec in warnings_log.records if rid in rec.getMessage()]
    assert any(raw in m for m in logged), logged


def test_a_mid_stream_transport_failure_event_names_no_bytes(warnings_log: pytest.LogCaptureFixture) -> None:
    with raw_engine(_broken_chunking) as eng, running_router(base(), [EngineSpec("u0", eng.url, "unified", "vllm", None, None)], start=False) as rr:
        s = sse(rr.url, chat(stream=True), headers={"x-request-id": "leak-mid"})
    assert s.status == 200 and len(s.chunks) == 1 and s.done
    (err,) = s.errors
    assert err["code"] == E.E06.code and "u0" in err["message"] and "chunked encoding" in err["message"]
    assert not any(x in err["message"] for x in (*LEAKS, "zz", str(eng.port))), err
    assert any("leak-mid" in m and "zz" in m for m in (rec.getMessage() for rec in warnings_log.records))


# -- a connect timeout is a connect failure (E06), not the idle timeout (E07) ----------


@contextlib.contextmanager
def unanswered_port() -> Iterator[int]:
    """A loopback port whose connects never complete: a listener with a backlog of 0
    that never accepts, its one queue place taken, so the kernel drops further SYNs."""
    srv = socket.socket()
    filler = socket.socket()
    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        filler.connect(("127.0.0.1", port))
        probe = socket.socket()
        probe.settimeout(0.2)
        try:
            with pytest.raises(OSError):
                probe.connect(("127.0.0.1", port))  # the queue is full: SYNs are dropped
        finally:
            probe.close()
        yield port
    finally:
        filler.close()
        srv.close()


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_connect_timeout_is_E06_naming_connect_timeout_ms(warnings_log: pytest.LogCaptureFixture, stream: bool) -> None:
    cfg = base()
    cfg["upstream"] = {"connect_timeout_ms": 200, "idle_timeout_ms": 3000}
    rid = f"connect-timeout-{stream}"
    with contextlib.ExitStack() as stack:
        port = stack.enter_context(unanswered_port())
        rr = stack.enter_context(running_router(cfg, [EngineSpec("u0", f"http://127.0.0.1:{port}", "unified", "vllm", None, None)], start=False))
        if stream:
            s = sse(rr.url, chat(stream=True), headers={"x-request-id": rid})
            status, text = s.status, s.body.decode()
        else:
            r = rr.post("/v1/chat/completions", json=chat(), headers={"x-request-id": rid})
            status, text = r.status_code, r.text
        books = rr.balanced()
    assert status == E.E06.status, text
    err = httpx.Response(status, content=text.encode()).json()["error"]
    assert err["code"] == E.E06.code and err["type"] == E.E06.type, err
    assert "u0" in err["message"] and "upstream.connect_timeout_ms" in err["message"] and "200 ms" in err["message"], err
    assert "idle_timeout" not in err["message"] and "127.0.0.1" not in err["message"] and str(port) not in err["message"], err
    assert books["terminal"].get("failed") == 1, books
    logged = [rec.getMessage() for rec in warnings_log.records if rid in rec.getMessage()]
    assert any(f"127.0.0.1:{port}" in m and "timed out" in m for m in logged), logged


# -- https:// engine URLs are refused when the configuration loads -----------------------


def test_an_https_engine_url_is_a_config_error_naming_the_engine() -> None:
    cfg = {"engines": [
        {"name": "u0", "url": "http://127.0.0.1:9001", "role": "unified"},
        {"name": "tls-engine", "url": "https://ann:hunter2@engine.example:8443/v1", "role": "unified"},
    ]}
    with pytest.raises(ConfigError) as exc:
        parse_config(cfg)
    msg = str(exc.value)
    assert "engines[1].url" in msg and "'tls-engine'" in msg and "https://" in msg and "cleartext HTTP/1.1" in msg, msg
    assert "hunter2" not in msg and "ann" not in msg and "engine.example" not in msg, msg
    with pytest.raises(ConfigError, match="engines\\[0\\].url: String should match pattern"):
        parse_config({"engines": [{"name": "u0", "url": "ftp://engine:21", "role": "unified"}]})


def test_narwhal_serve_refuses_an_https_engine_and_exits_non_zero(tmp_path: Path) -> None:
    cfg = tmp_path / "narwhal.yaml"
    cfg.write_text("engines:\n  - {name: secure-0, url: \"https://127.0.0.1:9443\", role: unified}\n")
    listen = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "narwhal.cli", "serve", "--config", str(cfg), "--listen", listen],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=30)  # refused while the configuration loads
    except subprocess.TimeoutExpired:
        proc.kill()  # by its PID: it started serving, so the engine was accepted
        proc.communicate()
        pytest.fail("narwhal serve accepted an https:// engine and kept serving")
    assert proc.returncode != 0, (out, err)
    assert "secure-0" in err and "https://" in err and "engines[0].url" in err, err
    assert "serving model" not in out
