"""The router's HTTP/1.1 (narwhal/http/h1/cycle.py) and its switches to HTTP/2
(narwhal/http/h2conn.py) over real sockets: pipelined requests answered in order, 100
Continue, the refusal envelopes (H08, H09), an h2c upgrade and a prior-knowledge preface on
the same port."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import h2.events
import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import RunningRouter, running_router


@pytest.fixture(scope="module")
def router() -> Iterator[RunningRouter]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=Timing(time_scale=0.25))]) as mocks:
        specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None) for m in mocks]
        cfg = {"admission": {"mode": "open", "prediction": {"profile_on_start": False}}, "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000}}
        with running_router(cfg, specs) as rr:
            yield rr


def _sock(rr: RunningRouter) -> socket.socket:
    host, port = rr.url.split("://", 1)[1].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _read_until(s: socket.socket, want: bytes, n: int = 1) -> bytes:
    got = b""
    while got.count(want) < n:
        piece = s.recv(65536)
        if not piece:
            break
        got += piece
    return got


def test_pipelined_requests_are_answered_in_order(router: RunningRouter) -> None:
    with _sock(router) as s:
        s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        got = _read_until(s, b"HTTP/1.1 ", 3)
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", got)
    assert statuses[:3] == [b"200", b"404", b"200"], got


def test_expect_100_continue_is_answered_before_the_body(router: RunningRouter) -> None:
    with _sock(router) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n")
        assert _read_until(s, b"\r\n\r\n").startswith(b"HTTP/1.1 100 ")
        s.sendall(b"{}")
        assert b"HTTP/1.1 400 " in _read_until(s, b"HTTP/1.1 4")


@pytest.mark.parametrize(("data", "status", "code"), [
    (b"GET / HTTP/1.1\r\n\r\n", b"400", b"invalid_request"),  # no Host
    (b"\x16\x03\x01garbage\r\n\r\n", b"400", b"invalid_request"),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 20000, b"431", b""),
])
def test_bytes_that_are_not_http_get_the_error_envelope_and_the_connection_closes(router: RunningRouter, data: bytes, status: bytes, code: bytes) -> None:
    with _sock(router) as s:
        s.sendall(data)
        got = b""
        while piece := s.recv(65536):
            got += piece
    assert got.startswith(b"HTTP/1.1 " + status), got
    assert b"connection: close" in got.lower() and b'"error"' in got
    assert code in got


def _h2_response(conn: h2.connection.H2Connection, s: socket.socket, rest: bytes, sid: int) -> tuple[dict[bytes, bytes], bytes]:
    headers: dict[bytes, bytes] = {}
    body = b""
    events: list[Any] = conn.receive_data(rest) if rest else []
    while True:
        for ev in events:
            if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                headers = dict(ev.headers)
            elif isinstance(ev, h2.events.DataReceived) and ev.stream_id == sid:
                body += ev.data
                conn.acknowledge_received_data(ev.flow_controlled_length, sid)
            elif isinstance(ev, h2.events.StreamEnded) and ev.stream_id == sid:
                return headers, body
        s.sendall(conn.data_to_send())
        data = s.recv(65536)
        assert data, "closed before the answer"
        events = conn.receive_data(data)


def test_an_h2c_upgrade_goes_on_as_http2_with_the_request_as_stream_1(router: RunningRouter) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    settings = conn.initiate_upgrade_connection()
    with _sock(router) as s:
        s.sendall(b"GET /ready HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: " + settings + b"\r\n\r\n")
        got = _read_until(s, b"\r\n\r\n")
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 101 ") and b"upgrade: h2c" in head.lower()
        s.sendall(conn.data_to_send())
        headers, _ = _h2_response(conn, s, rest, 1)
    assert headers[b":status"] == b"200"


def test_a_prior_knowledge_preface_goes_on_as_http2(router: RunningRouter) -> None:
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    conn.initiate_connection()
    conn.send_headers(1, [(b":method", b"GET"), (b":path", b"/ready"), (b":scheme", b"http"), (b":authority", b"x")], end_stream=True)
    with _sock(router) as s:
        s.sendall(conn.data_to_send())
        headers, _ = _h2_response(conn, s, b"", 1)
    assert headers[b":status"] == b"200"
