"""The router's threat model, client side: slow, silent and hostile clients cannot starve
the router or make it buffer without bound, and whatever they do, every offered request
ends in one terminal class. Each test rebuilds one attack at small scale on loopback,
bounded in count and time (serving.* limits are shrunk so that a test takes seconds).

  attack                                        bound (config key)                  row / class
  body at 1 byte per interval (HTTP/1.1)        serving.read_timeout_ms             H07 408, invalid_requests
  HTTP/2 HEADERS, never END_STREAM              serving.read_timeout_ms             H07 408, invalid_requests
  HTTP/2 client that never reads (window 0)     serving.send_stall_ms               cancelled, engine freed
  HTTP/1.1 client that never reads              serving.send_stall_ms               cancelled, engine freed
  FIN after one request (CLOSE-WAIT)            closed at once                      -
  more streams than advertised                  serving.max_streams_per_connection  REFUSED_STREAM, connection kept
  a flood of streams past the limit             serving.h2_control_frames_per_second GOAWAY ENHANCE_YOUR_CALM
  PING / SETTINGS flood                         serving.h2_control_frames_per_second GOAWAY ENHANCE_YOUR_CALM
  reconnecting after ENHANCE_YOUR_CALM          serving.abuse_penalty_ms            closed at accept
  rapid reset (HEADERS+DATA+RST_STREAM)         never dispatched                    cancelled, no engine request
  body in 1-byte chunks                         one byte of memory per body byte    -
  an early answer while the body still arrives  never blocks on the app's queue     H07 408, invalid_requests
  a body in 1-byte pieces (chunks, DATA frames) past 4,096 pieces under 64 B avg       H10 400, invalid_requests
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.settings
import pytest

from narwhal.mock import MockConfig, Timing, running_fleet
from narwhal.upstream.engines import EngineSpec
from tests.helpers import RunningRouter, running_router, wait_until

READ_MS, STALL_MS, PENALTY_MS = 600, 600, 1500


@pytest.fixture(scope="module")
def rr(relay_path: str) -> Iterator[tuple[RunningRouter, Any]]:
    with running_fleet([MockConfig(dialect="vllm", role="unified", name="u0", timing=Timing(time_scale=0.25))]) as mocks:
        specs = [EngineSpec(m.name, m.url, "unified", "vllm", None, None) for m in mocks]
        cfg = {
            "serving": {"relay_path": relay_path, "read_timeout_ms": READ_MS, "send_stall_ms": STALL_MS, "keep_alive_ms": 3000, "max_streams_per_connection": 4,
                        "h2_control_frames_per_second": 50, "abuse_penalty_ms": PENALTY_MS},
            "admission": {"mode": "open", "http_retention_limit": 8, "prediction": {"profile_on_start": False}},
            "monitoring": {"poll_interval_ms": 200, "stale_after_ms": 60000},
        }
        with running_router(cfg, specs) as r:
            yield r, mocks[0]


def _addr(rr: RunningRouter) -> tuple[str, int]:
    host, port = rr.url.split("://", 1)[1].rsplit(":", 1)
    return host, int(port)


def _body(**kw: Any) -> bytes:
    return json.dumps({"model": "narwhal-demo", "messages": [{"role": "user", "content": "hello"}], **kw}).encode()


def _terminal(rr: RunningRouter, cls: str) -> float:
    return float(rr.books()["terminal"].get(cls, 0))


def _recv_all(s: socket.socket, timeout: float) -> bytes:
    s.settimeout(timeout)
    out = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            d = s.recv(65536)
        except TimeoutError:
            break
        if not d:
            break
        out += d
    return out


def _assert_calmed(c: H2Client, timeout: float) -> None:
    """The router ended `c`'s connection with GOAWAY ENHANCE_YOUR_CALM."""
    evs = c.pump(timeout, until=lambda e: any(isinstance(x, h2.events.ConnectionTerminated) for x in e))
    term = [e for e in evs if isinstance(e, h2.events.ConnectionTerminated)]
    assert term and term[0].error_code == h2.errors.ErrorCodes.ENHANCE_YOUR_CALM, evs[-5:]


class H2Client:
    """A raw HTTP/2 client on a socket (h2's own state machine), for what httpx will not do."""

    def __init__(self, addr: tuple[str, int], *, window: int | None = None, source: str | None = None) -> None:
        # source: another loopback address (127.0.0.0/8), for an attacker the router
        # penalises (serving.abuse_penalty_ms) without penalising the other tests' clients
        self.sock = socket.create_connection(addr, timeout=5, source_address=(source, 0) if source else None)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
        self.conn.initiate_connection()
        if window is not None:
            self.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.flush()
        self.events: list[h2.events.Event] = []

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def request(self, body: bytes | None, *, end: bool = True, path: str = "/v1/chat/completions") -> int:
        sid = self.conn.get_next_available_stream_id()
        hdrs = [(":method", "POST"), (":path", path), (":scheme", "http"), (":authority", "x"), ("content-type", "application/json")]
        self.conn.send_headers(sid, hdrs, end_stream=body is None and end)
        if body is not None:
            self.conn.send_data(sid, body, end_stream=end)
        self.flush()
        return sid

    def pump(self, timeout: float, until: Any = None, *, ack: bool = True) -> list[h2.events.Event]:
        end = time.monotonic() + timeout
        self.sock.settimeout(0.05)
        while time.monotonic() < end:
            try:
                data = self.sock.recv(65536)
            except TimeoutError:
                data = None
            except OSError:
                break
            if data == b"":
                break
            if data:
                try:
                    evs = self.conn.receive_data(data)
                except h2.exceptions.ProtocolError:
                    break
                for ev in evs:
                    if ack and isinstance(ev, h2.events.DataReceived):
                        self.conn.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
                self.events += evs
                self.flush()
            if until is not None and until(self.events):
                break
        return self.events

    def close(self) -> None:
        self.sock.close()


def _status(events: list[h2.events.Event], sid: int) -> str | None:
    for ev in events:
        if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
            return dict(ev.headers).get(":status")
    return None


def test_a_body_at_one_byte_per_interval_gets_408_within_read_timeout(rr: tuple[RunningRouter, Any]) -> None:
    router, _ = rr
    before = _terminal(router, "invalid_requests")
    body = _body()
    with socket.create_connection(_addr(router)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body))
        t0 = time.monotonic()
        answer = b""
        for i in range(len(body)):  # 1 byte per 50 ms: the whole body would take seconds
            try:
                s.sendall(body[i : i + 1])
            except OSError:
                break
            s.settimeout(0.05)
            try:
                answer += s.recv(65536)
            except TimeoutError:
                pass
            if b"\r\n\r\n" in answer or time.monotonic() - t0 > 5:
                break
        answer += _recv_all(s, 1.0)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b'"code":"request_timeout"' in answer
    assert time.monotonic() - t0 < READ_MS / 1000 + 2
    router.balanced()
    assert _terminal(router, "invalid_requests") == before + 1


def test_an_h2_stream_that_never_ends_gets_408(rr: tuple[RunningRouter, Any]) -> None:
    router, _ = rr
    c = H2Client(_addr(router))
    try:
        sid = c.request(_body()[:10], end=False)
        evs = c.pump(READ_MS / 1000 + 3, until=lambda e: _status(e, sid) is not None)
        assert _status(evs, sid) == "408"
    finally:
        c.close()
    router.balanced()


def test_slow_uploaders_do_not_lock_out_other_clients(rr: tuple[RunningRouter, Any]) -> None:
    """http_retention_limit is 8: eight stalled uploads hold every slot, but only for
    read_timeout_ms; a normal client after that is served."""
    router, _ = rr
    socks = []
    for _ in range(8):
        s = socket.create_connection(_addr(router))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n{")
        socks.append(s)
    try:
        time.sleep(READ_MS / 1000 + 0.5)
        r = router.post("/v1/chat/completions", json={"model": "narwhal-demo", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200, r.text
    finally:
        for s in socks:
            s.close()
    router.balanced()


def test_an_h2_client_that_never_reads_is_dropped_and_frees_the_engine(rr: tuple[RunningRouter, Any]) -> None:
    router, mock = rr
    cancelled = mock.stats()["cancelled"]
    before = _terminal(router, "cancelled")
    c = H2Client(_addr(router), window=0)  # a stream window of 0: the router may send no DATA
    try:
        sid = c.request(_body(stream=True, mock={"tokens": 4000, "tpot_ms": 1}))
        c.pump(0.3, ack=False)
        # the router's writer blocks at the stream buffer's high-water mark; after
        # send_stall_ms it gives the client up and cancels the engine request
        wait_until(lambda: mock.stats()["cancelled"] > cancelled, timeout=STALL_MS / 1000 + 5, what="the engine request cancelled")
        evs = c.pump(1.0, ack=False)
        assert any(isinstance(e, h2.events.StreamReset) and e.stream_id == sid for e in evs), evs
    finally:
        c.close()
    router.balanced()
    assert _terminal(router, "cancelled") == before + 1
    assert mock.stats()["in_flight"] == 0


def test_an_h1_client_that_never_reads_is_dropped_and_frees_the_engine(rr: tuple[RunningRouter, Any]) -> None:
    """The kernel's socket buffers absorb the first megabytes; once they are full the
    router's writes block, and after send_stall_ms the request ends (cancelled) while the
    client still holds its connection open and reads nothing."""
    router, mock = rr
    before = _terminal(router, "cancelled")
    body = _body(stream=True, mock={"tokens": 60000, "tpot_ms": 0.01})
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(_addr(router))
    try:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: _terminal(router, "cancelled") > before, timeout=STALL_MS / 1000 + 20, what="the request dropped (class cancelled)")
        router.balanced()
        # the router closed the engine connection; the mock notices between two of its
        # 0.01 ms tokens, which on a busy 2-core machine took 6.5 s once (bounded, 30 s)
        wait_until(lambda: mock.stats()["in_flight"] == 0, timeout=30, what="the engine free")
        # a mock that busy misses its health polls (E07): the next test starts once the
        # router sees it eligible again (healthy, its breaker closed)
        wait_until(lambda: all(e["eligible"] for e in router.get("/v1/engines").json()["data"]), timeout=30, what="the engine eligible again")
    finally:
        s.close()


def test_a_clients_fin_releases_its_connection_at_once(rr: tuple[RunningRouter, Any]) -> None:
    """keep_alive_ms is 3 s here: the router closes its side well before that."""
    router, _ = rr
    with socket.create_connection(_addr(router)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _recv_all(s, 0.5).startswith(b"HTTP/1.1 200")
        s.shutdown(socket.SHUT_WR)
        t0 = time.monotonic()
        s.settimeout(2.5)
        assert s.recv(100) == b""  # the router's FIN
        assert time.monotonic() - t0 < 1.0


def test_streams_past_the_limit_are_refused_and_the_connection_stays(rr: tuple[RunningRouter, Any]) -> None:
    router, _ = rr
    c = H2Client(_addr(router))
    try:
        c.pump(0.2)  # the server's SETTINGS (max_concurrent_streams 4)
        c.conn.remote_settings = h2.settings.Settings(client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 100})
        held = [c.request(_body()[:5], end=False) for _ in range(4)]
        extra = [c.request(_body()[:5], end=False) for _ in range(3)]
        evs = c.pump(5.0, until=lambda e: sum(isinstance(x, h2.events.StreamReset) for x in e) >= 3)
        refused = {e.stream_id for e in evs if isinstance(e, h2.events.StreamReset) and e.error_code == h2.errors.ErrorCodes.REFUSED_STREAM}
        assert refused == set(extra), evs
        assert not any(isinstance(e, h2.events.ConnectionTerminated) for e in evs)
        for sid in held:
            c.conn.reset_stream(sid)
        c.flush()
        ok = c.request(_body(max_tokens=2))
        evs = c.pump(5.0, until=lambda e: _status(e, ok) is not None)
        assert _status(evs, ok) == "200"
    finally:
        c.close()
    router.balanced()


def test_a_flood_of_streams_past_the_limit_is_calmed(rr: tuple[RunningRouter, Any]) -> None:
    # hyper.py defect 9: each refused stream costs the router a RST_STREAM; a client that
    # keeps opening them past the limit (here 150 at once, the bucket's burst is 100) is
    # flooding, and gets GOAWAY ENHANCE_YOUR_CALM like a PING flood
    router, _ = rr
    c = H2Client(_addr(router), source="127.0.0.5")
    try:
        c.pump(0.2)
        c.conn.remote_settings = h2.settings.Settings(client=False, initial_values={h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: 1000})
        for _ in range(154):
            sid = c.conn.get_next_available_stream_id()
            c.conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"), (":authority", "x")])
        c.flush()
        _assert_calmed(c, 3.0)
    finally:
        c.close()
    assert router.get("/health").status_code == 200
    router.balanced()


@pytest.mark.parametrize("frame", ["ping", "settings"])
def test_a_control_frame_flood_gets_goaway_enhance_your_calm(rr: tuple[RunningRouter, Any], frame: str) -> None:
    router, _ = rr
    c = H2Client(_addr(router), source="127.0.0.2" if frame == "ping" else "127.0.0.3")
    try:
        for i in range(400):
            if frame == "ping":
                c.conn.ping(i.to_bytes(8, "big"))
            else:
                c.conn.update_settings({h2.settings.SettingCodes.MAX_HEADER_LIST_SIZE: 65536 + i})
        c.flush()
        _assert_calmed(c, 2.0)
    finally:
        c.close()
    r = router.get("/health")  # other clients are fine
    assert r.status_code == 200


def _penalised(router: RunningRouter) -> float:
    """Summed over workers (each sample carries its `worker` label)."""
    seen = [float(line.split()[-1]) for line in router.get("/metrics").text.splitlines() if line.startswith("narwhal_penalised_connections_total{")]
    if not seen:
        raise AssertionError("narwhal_penalised_connections_total is not on /metrics")
    return sum(seen)


def _closed_at_accept(addr: tuple[str, int], source: str) -> bool:
    """True when the router closes a new connection from `source` before answering it."""
    with socket.create_connection(addr, timeout=2, source_address=(source, 0)) as s:
        try:
            s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            return _recv_all(s, 2.0) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True


def test_a_calmed_address_is_refused_at_accept_for_the_penalty(rr: tuple[RunningRouter, Any]) -> None:
    # serving.abuse_penalty_ms (hyper.py defect 8): after ENHANCE_YOUR_CALM the attacker's
    # reconnects are closed before any frame is parsed; other addresses are served; the
    # penalty ends
    router, _ = rr
    addr, bad = _addr(router), "127.0.0.4"
    before = _penalised(router)
    c = H2Client(addr, source=bad)
    try:
        for i in range(400):
            c.conn.ping(i.to_bytes(8, "big"))
        c.flush()
        _assert_calmed(c, 2.0)
    finally:
        c.close()
    assert _closed_at_accept(addr, bad)
    assert router.get("/health").status_code == 200  # 127.0.0.1 is not penalised
    assert _penalised(router) >= before + 1
    assert wait_until(lambda: not _closed_at_accept(addr, bad), timeout=PENALTY_MS / 1000.0 + 5.0)


def test_rapid_reset_never_reaches_an_engine(rr: tuple[RunningRouter, Any]) -> None:
    router, mock = rr
    mock.clear_requests()
    before = router.books()["offered"]
    c = H2Client(_addr(router))
    try:
        for _ in range(3):  # max_streams_per_connection is 4
            sid = c.conn.get_next_available_stream_id()
            c.conn.send_headers(sid, [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"), (":authority", "x")])
            c.conn.send_data(sid, _body(max_tokens=2), end_stream=True)
            c.conn.reset_stream(sid, h2.errors.ErrorCodes.CANCEL)
        c.flush()  # all in one write, as the attack sends them
        c.pump(1.0)
    finally:
        c.close()
    time.sleep(0.3)
    # opened and reset in one read: never created (hyper.py), so never offered; a reset
    # that arrives later is offered and ends cancelled before dispatch
    assert router.books()["offered"] - before <= 3
    router.balanced()
    assert mock.requests() == []


def test_an_early_answer_to_a_body_still_arriving_does_not_deadlock(rr: tuple[RunningRouter, Any]) -> None:
    # hyper.py defect 10: 1-byte chunks arrive faster than the app reads them, so the
    # app's receive queue is full when the read deadline answers 408; hypercorn then put
    # http.disconnect into that full queue from the app's own task and the request was
    # held for ever (never a terminal class)
    router, _ = rr
    before = _terminal(router, "invalid_requests")
    host, port = _addr(router)
    socks = []
    for _ in range(3):  # (H10 refuses such a body too, and penalises its address: not ours)
        s = socket.create_connection((host, port), timeout=2, source_address=("127.0.0.8", 0))
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        socks.append(s)
    piece = b"1\r\nx\r\n" * 4000
    end = time.monotonic() + READ_MS / 1000.0 + 0.6
    while time.monotonic() < end:  # past the read deadline, as fast as the router takes it
        for s in socks:
            try:
                s.sendall(piece)
            except OSError:
                pass
    for s in socks:
        s.close()
    router.balanced()
    assert _terminal(router, "invalid_requests") - before >= 1


def test_H10_a_body_in_one_byte_chunks_is_refused_long_before_the_read_deadline(rr: tuple[RunningRouter, Any]) -> None:
    # 8 such uploads kept the router's core parsing chunks (~9 us each) until the read
    # deadline and slowed every other client (the soak's chunked-1-byte row)
    router, _ = rr
    before = _terminal(router, "invalid_requests")
    with socket.create_connection(_addr(router), timeout=5, source_address=("127.0.0.6", 0)) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\n\r\n")
        s.sendall(b"1\r\n \r\n" * 6000 + b"0\r\n\r\n")
        got = _recv_all(s, 3.0)
    assert got.startswith(b"HTTP/1.1 400"), got[:200]
    assert b'"code":"request_body_fragmented"' in got
    router.balanced()
    assert _terminal(router, "invalid_requests") - before == 1
    # its reconnects are closed at accept for serving.abuse_penalty_ms (the attack
    # reconnected at once, and each new body cost the router the same 4,096 pieces)
    assert _closed_at_accept(_addr(router), "127.0.0.6")
    assert router.get("/health").status_code == 200


def test_H10_h2_data_frames_of_one_byte_are_refused(rr: tuple[RunningRouter, Any]) -> None:
    router, _ = rr
    c = H2Client(_addr(router), source="127.0.0.7")
    try:
        c.pump(0.2)
        sid = c.request(None, end=False)
        for _ in range(5000):  # 5,000 bytes: within the stream's flow-control window
            c.conn.send_data(sid, b" ")
        c.flush()
        evs = c.pump(5.0, until=lambda e: _status(e, sid) is not None)
        assert _status(evs, sid) == "400", evs[-5:]
    finally:
        c.close()
    router.balanced()


def test_a_body_in_one_byte_chunks_costs_one_byte_per_byte() -> None:
    """Measured in a fresh process (tracemalloc's peak counts every thread of this one)."""
    import subprocess
    import sys

    code = (
        "import asyncio, tracemalloc\n"
        "from narwhal.http.completions import _read_body\n"
        "n = 4_000\n"
        "msgs = iter([{'type': 'http.request', 'body': b'x', 'more_body': True}] * (n - 1) + [{'type': 'http.request', 'body': b'x', 'more_body': False}])\n"
        "async def receive():\n"
        "    return next(msgs)\n"
        "tracemalloc.start()\n"
        "body = asyncio.run(_read_body({'headers': []}, receive, 1 << 20, 10.0))\n"
        "print(len(body), tracemalloc.get_traced_memory()[1])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout.split()
    n, peak = int(out[0]), int(out[1])
    assert n == 4_000  # (past 4,096 such pieces H10 refuses the body)
    assert peak < 6 * n + 4096, peak  # a list of 1-byte bytes objects is ~35 bytes a byte


def test_metrics_show_open_client_connections_by_state(rr: tuple[RunningRouter, Any]) -> None:
    router, _ = rr
    with socket.create_connection(_addr(router)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        _recv_all(s, 0.3)
        text = router.get("/metrics").text
        idle = next(float(line.split()[-1]) for line in text.splitlines() if line.startswith('narwhal_client_connections{') and 'state="idle"' in line)
        assert idle >= 1, text
    assert "narwhal_h2_refused_streams_total" in text and "narwhal_client_connections_h2" in text


def test_an_idle_keep_alive_connection_closes_after_keep_alive_ms(rr: tuple[RunningRouter, Any]) -> None:
    """hyper.py item 14 (the keep-alive timer as a loop timer): a request on the connection
    stops the timer and its response's end starts it anew; idle keep_alive_ms (3 s), the
    router closes the connection."""
    router, _ = rr
    with socket.create_connection(_addr(router)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _recv_all(s, 0.5).startswith(b"HTTP/1.1 200")
        time.sleep(2.0)  # idle, under keep_alive_ms: the connection stays
        s.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert _recv_all(s, 0.5).startswith(b"HTTP/1.1 200")
        t0 = time.monotonic()
        s.settimeout(8.0)
        assert s.recv(100) == b""  # the router's FIN, keep_alive_ms after the last answer
        assert time.monotonic() - t0 > 1.5  # not the first answer's timer (it was restarted)
