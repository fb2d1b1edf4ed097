"""Attack: an engine (broken, or hostile) that sends output without bounds — a line that
never ends, an event of endless data lines, a response head or trailers that never end, a
prefill answer of many MiB, an answer of endless small events for a non-streaming client.
Defence: upstream.max_event_bytes bounds every piece of engine output the router holds,
upstream.max_answer_bytes the events one non-streaming answer is assembled from; past
either the attempt fails as E02 malformed_engine_output, in linear time and bounded
memory, and the engine connection is dropped."""

from __future__ import annotations

import asyncio
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from narwhal.core.sse import SSEParser
from narwhal.upstream.engines import EngineSpec
from narwhal.upstream.http1 import BodyTooLarge, ConnectionFailed, H1Pool
from narwhal_generated import errors as E
from tests.abuse.rawengine import (
    SSE_HEAD,
    Answer,
    RawEngine,
    Request,
    chunk,
    raw_engine,
    token_event,
)
from tests.helpers import running_router, sse

LIMIT = 64 * 1024  # upstream.max_event_bytes in these tests
FLOOD = 16 << 20  # what the engine tries to send: 256 times the limit
PIECE = 64 * 1024
PEAK = 8 << 20  # the most Python memory a request may take meanwhile (tracemalloc peak)


def config(relay_path: str = "direct", **upstream: Any) -> dict[str, Any]:
    return {
        "serving": {"relay_path": relay_path},
        "admission": {"mode": "open", "prediction": {"profile_on_start": False}},
        "monitoring": {"poll_interval_ms": 500, "stale_after_ms": 60000, "breaker_failures": 1000},
        "upstream": {"idle_timeout_ms": 5000, "max_event_bytes": LIMIT, **upstream},
    }


class Flood:
    """Scripted engine answers that send FLOOD bytes of one unfinished thing, then end it
    properly (so that a router without a bound would get to the end of it)."""

    def __init__(self) -> None:
        self.sent = 0  # bytes of the flood the engine got onto the wire

    async def _pour(self, w: asyncio.StreamWriter, piece: bytes, *, slow: bool) -> None:
        self.sent = 0
        try:
            while self.sent < FLOOD:
                w.write(chunk(piece))
                await w.drain()
                self.sent += len(piece)
                if slow:
                    await asyncio.sleep(0.002)
        except ConnectionError:
            return

    @staticmethod
    async def _start(w: asyncio.StreamWriter, first_token: bool) -> None:
        w.write(SSE_HEAD)
        if first_token:  # a token on its own: the router sends response headers with it
            w.write(chunk(token_event(0)))
            await w.drain()
            await asyncio.sleep(0.1)

    def line(self, *, first_token: bool, slow: bool = False) -> Answer:
        """`data: xxxx…` with no newline (slow: 1 KiB pieces, a few ms apart)."""

        async def answer(req: Request, w: asyncio.StreamWriter) -> None:
            await self._start(w, first_token)
            w.write(chunk(b"data: "))
            await self._pour(w, b"x" * (1024 if slow else PIECE), slow=slow)
            w.write(chunk(b"\n\ndata: [DONE]\n\n") + b"0\r\n\r\n")

        return answer

    def data_lines(self, *, first_token: bool) -> Answer:
        """One event of endless 1 KB data lines and no blank line (the 50 MB event)."""

        async def answer(req: Request, w: asyncio.StreamWriter) -> None:
            await self._start(w, first_token)
            await self._pour(w, (b"data: " + b"y" * 1018 + b"\n") * 64, slow=False)
            w.write(chunk(b"\ndata: [DONE]\n\n") + b"0\r\n\r\n")

        return answer


@pytest.fixture
def memory() -> Iterator[None]:
    tracemalloc.start()
    try:
        yield
    finally:
        tracemalloc.stop()


def _router(eng: RawEngine, relay_path: str = "direct") -> Any:
    return running_router(config(relay_path), [EngineSpec("u0", eng.url, "unified", "vllm", None, None)])


def body(stream: bool) -> dict[str, Any]:
    return {"model": "narwhal-demo", "messages": [{"role": "user", "content": "hi"}], "stream": stream}


SHAPES = [
    pytest.param("line", False, id="endless-line"),
    pytest.param("line", True, id="endless-line-slow"),
    pytest.param("data_lines", False, id="endless-event"),
]


@pytest.mark.parametrize(("shape", "slow"), SHAPES)
def test_endless_engine_output_non_streaming_is_E02(memory: None, shape: str, slow: bool, relay_path: str) -> None:
    """Non-streaming client: 502 malformed_engine_output naming the bound; the engine is
    cut off long before its flood ends, and the router's memory stays bounded."""
    flood = Flood()
    ans = flood.line(first_token=False, slow=slow) if shape == "line" else flood.data_lines(first_token=False)
    with raw_engine(ans) as eng, _router(eng, relay_path) as rr:
        tracemalloc.reset_peak()
        t0 = time.monotonic()
        r = httpx.post(rr.url + "/v1/chat/completions", json=body(False), timeout=30)
        took = time.monotonic() - t0
        _, peak = tracemalloc.get_traced_memory()
        assert r.status_code == E.E02.status, r.text
        err = r.json()["error"]
        assert err["code"] == E.E02.code and "max_event_bytes" in err["message"] and "u0" in err["message"]
        assert peak < PEAK, f"peak {peak / 2**20:.1f} MiB"
        assert flood.sent < FLOOD // 2, "the engine connection was not dropped"
        assert took < 10
        rr.balanced()


@pytest.mark.parametrize(("shape", "slow"), SHAPES)
def test_endless_engine_output_mid_stream_is_an_E02_event(memory: None, shape: str, slow: bool, relay_path: str) -> None:
    """Streaming client, after the first token: the token, then an error event
    malformed_engine_output, then [DONE]."""
    flood = Flood()
    ans = flood.line(first_token=True, slow=slow) if shape == "line" else flood.data_lines(first_token=True)
    with raw_engine(ans) as eng, _router(eng, relay_path) as rr:
        tracemalloc.reset_peak()
        s = sse(rr.url, body(True))
        _, peak = tracemalloc.get_traced_memory()
        assert s.status == 200 and len(s.chunks) == 1 and s.done
        assert [e["code"] for e in s.errors] == [E.E02.code]
        assert "max_event_bytes" in s.errors[0]["message"]
        assert peak < PEAK, f"peak {peak / 2**20:.1f} MiB"
        assert flood.sent < FLOOD // 2, "the engine connection was not dropped"
        rr.balanced()


def test_huge_prefill_answer_is_E02() -> None:
    """The prefill leg's JSON answer is one body: bounded like an event."""

    async def huge_json(req: Request, w: asyncio.StreamWriter) -> None:
        pad = b"z" * (4 << 20)
        w.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % (len(pad) + 20))
        try:
            w.write(b'{"pad": "' + pad + b'", "x": 1}')
            await w.drain()
        except ConnectionError:
            pass

    with raw_engine(huge_json) as p, raw_engine() as d:
        engines = [EngineSpec("p0", p.url, "prefill", "vllm", None, None), EngineSpec("d0", d.url, "decode", "vllm", None, None)]
        with running_router(config(), engines) as rr:
            r = httpx.post(rr.url + "/v1/chat/completions", json=body(False), timeout=30)
            assert r.status_code == E.E02.status, r.text
            err = r.json()["error"]
            assert err["code"] == E.E02.code and "p0" in err["message"] and str(LIMIT) in err["message"]
            assert not d.posts(), "no decode leg after a failed prefill"
            rr.balanced()


# -- the engine client alone ---------------------------------------------------------


async def _serve_bytes(payload: bytes) -> tuple[asyncio.AbstractServer, str]:
    async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await r.readuntil(b"\r\n\r\n")
            w.write(payload)
            await w.drain()
            await asyncio.sleep(5)  # hold the connection: the client must not wait for a close
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            w.close()

    srv = await asyncio.start_server(h, "127.0.0.1", 0)
    return srv, f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"


HEAD_FLOOD = b"HTTP/1.1 200 OK\r\n" + b"X-Pad: " + b"p" * 100_000 + b"\r\nContent-Length: 0\r\n\r\n"
TRAILER_FLOOD = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n" + b"X-Trailer: t\r\n" * 20_000


@pytest.mark.parametrize(("payload", "what"), [(HEAD_FLOOD, "head"), (TRAILER_FLOOD, "trailers")], ids=["head", "trailers"])
def test_response_head_and_trailers_are_bounded(payload: bytes, what: str) -> None:
    """A 100 KB response head (ended, in one write) and 280 KB of trailers that never end
    fail the request at once, not at the idle timeout."""

    async def main() -> None:
        srv, url = await _serve_bytes(payload)
        pool = H1Pool(idle_timeout_s=3)
        try:
            t0 = time.monotonic()
            with pytest.raises(ConnectionFailed, match=what):
                r = await pool.request("GET", url + "/")
                await r.read()
            assert time.monotonic() - t0 < 2
        finally:
            pool.close()
            srv.close()

    asyncio.run(asyncio.wait_for(main(), 20))


def test_read_stops_at_its_limit() -> None:
    async def main() -> None:
        srv, url = await _serve_bytes(b"HTTP/1.1 200 OK\r\nContent-Length: 3000000\r\n\r\n" + b"b" * 3_000_000)
        pool = H1Pool(idle_timeout_s=3)
        try:
            r = await pool.request("GET", url + "/")
            with pytest.raises(BodyTooLarge):
                await r.read(1 << 20)
            r.close()
        finally:
            pool.close()
            srv.close()

    asyncio.run(asyncio.wait_for(main(), 20))


# -- the parser alone: linear time ----------------------------------------------------


def test_a_long_line_in_small_pieces_costs_linear_time() -> None:
    """16 MiB of one line in 4 KiB reads: each read appends, nothing is copied or scanned
    again (~0.07 s here; a parser that copies the buffer per read moves ~32 GB, ~3 s)."""
    p = SSEParser(max_event_bytes=32 << 20)
    piece = b"x" * 4096
    t0 = time.perf_counter()
    assert p.feed(b"data: ") == []
    for _ in range((16 << 20) // len(piece)):
        assert p.feed(piece) == []
    assert p.feed(b"\n\n") == [b"x" * (16 << 20)]
    assert time.perf_counter() - t0 < 1.0
    assert not p.too_large


def test_an_event_of_endless_empty_data_lines_is_bounded_too() -> None:
    p = SSEParser(max_event_bytes=1024)
    for _ in range(100):
        if p.feed(b"data:\n" * 100):
            break
    assert p.too_large and not p.pending


@pytest.mark.parametrize("split", [None, 1, 7, 4096])
def test_the_parser_stops_past_the_bound_whatever_the_chunking(split: int | None) -> None:
    wire = b"data: ok\n\n" + b"data: " + b"x" * 2000 + b"\n\ndata: [DONE]\n\n"
    p = SSEParser(max_event_bytes=1024)
    got: list[bytes] = []
    step = split or len(wire)
    for i in range(0, len(wire), step):
        got += p.feed(wire[i : i + step])
    assert got == [b"ok"] and p.too_large and not p.pending


# -- an endless answer of small events (upstream.max_answer_bytes) -----------------------

ANSWER_LIMIT = 64 * 1024  # upstream.max_answer_bytes in these tests


class Events:
    """An answer of token events (~200 bytes each, far under max_event_bytes), 64 to a
    write, `total` bytes of them, then its end; `sent` counts what got onto the wire."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.sent = 0

    async def __call__(self, req: Request, w: asyncio.StreamWriter) -> None:
        w.write(SSE_HEAD)
        self.sent = i = 0
        try:
            while self.sent < self.total:
                piece = b"".join(token_event(i + k) for k in range(64))
                w.write(chunk(piece))
                await w.drain()
                self.sent += len(piece)
                i += 64
            w.write(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        except ConnectionError:
            pass


def test_an_endless_answer_for_a_non_streaming_client_is_E02(memory: None, relay_path: str) -> None:
    """An engine that answers a non-streaming client with event after small event and
    never ends: without a bound on the whole answer the router assembled all of it (16 MiB
    of events here) and answered 200. Now: 502 malformed_engine_output naming
    upstream.max_answer_bytes once the events add up past it; the engine cut off long
    before its flood ends; memory bounded; the books balanced (class failed)."""
    ans = Events(FLOOD)
    with raw_engine(ans) as eng, running_router(config(relay_path, max_answer_bytes=ANSWER_LIMIT), [EngineSpec("u0", eng.url, "unified", "vllm", None, None)]) as rr:
        tracemalloc.reset_peak()
        r = httpx.post(rr.url + "/v1/chat/completions", json=body(False), timeout=30)
        _, peak = tracemalloc.get_traced_memory()
        assert r.status_code == E.E02.status, r.text[:300]
        err = r.json()["error"]
        assert err["code"] == E.E02.code and "max_answer_bytes" in err["message"] and "u0" in err["message"], err
        assert str(ANSWER_LIMIT) in err["message"]
        assert peak < PEAK, f"peak {peak / 2**20:.1f} MiB"
        books = rr.balanced()
        assert books["terminal"].get("failed") == 1, books
    assert ans.sent < FLOOD // 2, "the engine connection was not dropped"


def test_the_answer_bound_is_for_assembly_only() -> None:
    """The same long answer (4 times the bound) reaches a streaming client whole; an
    answer under the bound is assembled as before."""
    with raw_engine(Events(4 * ANSWER_LIMIT)) as eng, running_router(config(max_answer_bytes=ANSWER_LIMIT), [EngineSpec("u0", eng.url, "unified", "vllm", None, None)]) as rr:
        s = sse(rr.url, body(True))
        assert s.status == 200 and s.done and not s.errors and len(s.chunks) > 1000
    with raw_engine(Events(ANSWER_LIMIT // 2)) as eng, running_router(config(max_answer_bytes=ANSWER_LIMIT), [EngineSpec("u0", eng.url, "unified", "vllm", None, None)]) as rr:
        r = httpx.post(rr.url + "/v1/chat/completions", json=body(False), timeout=30)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["choices"][0]["message"]["content"].startswith("t0 t1 ")
        rr.balanced()


@pytest.mark.parametrize(("value", "ok"), [(1023, False), (1024, True), (67108864, True), (1 << 30, True), ((1 << 30) + 1, False)])
def test_max_answer_bytes_is_a_bounded_knob(value: int, ok: bool) -> None:
    from narwhal.config import ConfigError, parse_config

    assert parse_config({}).upstream.max_answer_bytes == 64 << 20
    if ok:
        assert parse_config({"upstream": {"max_answer_bytes": value}}).upstream.max_answer_bytes == value
    else:
        with pytest.raises(ConfigError, match="upstream.max_answer_bytes"):
            parse_config({"upstream": {"max_answer_bytes": value}})
