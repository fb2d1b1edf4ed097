"""The load tool against real servers: the mock engine (tokens, TTFT, rate), a refusing
server (refusals counted, codes kept), and the HTTP/1.1 parser fed one byte at a time."""

from __future__ import annotations

import asyncio

import pytest

from narwhal.mock import MockConfig, running_mock
from narwhal_bench.harness.client import H1Pool, SSERecorder, _H1Conn, make_client
from narwhal_bench.harness.load import RequestShape, fixed_rate, phases_at_once, run_open_loop
from narwhal_bench.harness.stats import Result, summarize


def _run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("http", ["1", "2", "2-httpx"])
def test_open_loop_against_a_mock_engine(http: str) -> None:
    with running_mock(MockConfig(dialect="vllm")) as m:
        arrivals = fixed_rate(40, 1.0, output_tokens=6, uniform=True)
        shape = RequestShape(mock={"prefill_ms": 5, "tpot_ms": 5}, extra_body={"return_token_ids": True})

        async def go() -> list[Result]:
            c = make_client(m.url, http)
            try:
                return await run_open_loop(c, arrivals, shape, timeout_s=10, drain_s=10)
            finally:
                await c.aclose()

        res = _run(go())
    s = summarize(res)
    assert s["offered"] == 40 and s["ok"] == 40, s["error_samples"]
    assert all(r.tokens == 6 for r in res)  # token_ids counted, EOS included
    # first token after the 5 ms prefill (never before it); 5 tokens more, at least 5 ms
    # apart. Upper bounds only catch a broken clock, not a slow machine (no timing tests).
    assert all(r.ttft is not None and 0.004 < r.ttft < 10.0 for r in res)
    assert 0.004 <= s["tpot"]["p50"] < 1.0
    # the rate was respected: 40 sends spread over ~1 s, none bunched at the start
    sent = sorted(r.sent for r in res)
    assert 0.9 < sent[-1] - sent[0] < 10.0
    assert s["send_lag"]["p50"] < 1.0


def test_phases_at_once_interleave_their_arms() -> None:
    """The TTFT part's direct and routed arms (narwhal bench versus): each arm's own
    arrivals to its own server, all in one run, so their requests interleave in time."""
    with running_mock(MockConfig(dialect="vllm")) as a, running_mock(MockConfig(dialect="vllm")) as b:
        shape = RequestShape(mock={"prefill_ms": 1, "tpot_ms": 1})
        arms = [(a.url, {}, fixed_rate(20, 1.0, output_tokens=3, uniform=True)), (b.url, {}, fixed_rate(40, 1.0, output_tokens=3, uniform=True))]
        ra, rb = phases_at_once(arms, "1", shape, timeout_s=10, drain_s=10)
    assert (len(ra), len(rb)) == (20, 40)  # one list per arm, in the arms' order
    assert all(r.ok and r.ttft is not None for r in ra + rb)
    sa, sb = sorted(r.sent for r in ra), sorted(r.sent for r in rb)
    # the two arms ran over the same second, not one after the other: each sent most of
    # its requests between the other's first and last
    assert sum(sa[0] < t < sa[-1] for t in sb) >= 30 and sum(sb[0] < t < sb[-1] for t in sa) >= 15


def test_non_streaming_records_completion_tokens() -> None:
    with running_mock(MockConfig(dialect="vllm")) as m:
        async def go() -> list[Result]:
            c = H1Pool(m.url)
            try:
                return await run_open_loop(c, fixed_rate(20, 0.25, output_tokens=4, uniform=True), RequestShape(stream=False, mock={"tpot_ms": 1}), timeout_s=10)
            finally:
                await c.aclose()

        res = _run(go())
    assert len(res) == 5 and all(r.ok and r.tokens == 4 for r in res)


async def _refusing_server(statuses: list[int]) -> asyncio.AbstractServer:
    """Answers each request with the next status: 429/503 with an OpenAI error envelope."""
    it = iter(statuses)

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                n = int(next(ln.split(b":")[1] for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length")))
                await reader.readexactly(n)
                st = next(it)
                code = {429: b"admission_queue_full", 503: b"backend_unavailable"}.get(st, b"x")
                body = b'{"error":{"message":"no","type":"rate_limit_error","param":null,"code":"' + code + b'"}}'
                writer.write(b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\nretry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (st, len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, StopIteration):
            writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_refusals_are_counted_with_their_codes() -> None:
    async def go() -> list[Result]:
        srv = await _refusing_server([429, 503, 429, 429, 503, 429])
        port = srv.sockets[0].getsockname()[1]
        c = H1Pool(f"http://127.0.0.1:{port}")
        try:
            return await run_open_loop(c, fixed_rate(50, 0.12, uniform=True), RequestShape(), timeout_s=5)
        finally:
            await c.aclose()
            srv.close()

    res = _run(go())
    s = summarize(res, ttft_target_s=1.0)
    assert (s["offered"], s["refused"], s["errors"], s["ok"]) == (6, 6, 0, 0)
    assert s["refusal_codes"] == {"admission_queue_full": 4, "backend_unavailable": 2}
    assert s["goodput"] == 0.0 and s["refusal_rate"] == 1.0
    assert all(r.retry_after == "1" for r in res)


def test_h1_parser_one_byte_at_a_time() -> None:
    events = [b'data: {"choices":[{"index":0,"delta":{"content":"a"},"token_ids":[5,6]}]}\n\n', b'data: {"choices":[{"index":0,"delta":{"content":"b"}}]}\r\n\r\n', b"data: [DONE]\n\n"]
    body = b"".join(b"%x;ext=1\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\nx-trailer: 1\r\n\r\n"
    raw = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n" + body

    async def go() -> tuple[Result, bool]:
        conn = _H1Conn(None)  # type: ignore[arg-type]

        class T:
            def write(self, data: bytes) -> None:
                pass

        conn.transport = T()  # type: ignore[assignment]
        r = Result(scheduled=0.0)
        fut = conn.send(b"", SSERecorder(r))
        for i in range(len(raw)):
            conn.data_received(raw[i:i + 1])
        return r, await fut

    r, keep = _run(go())
    assert keep and r.status == 200 and r.error is None
    assert r.tokens == 3 and r.events == 3 and r.done_at is not None


def test_h2_bodies_larger_than_the_flow_control_window() -> None:
    """Request bodies past the server's 64 KiB window wait for WINDOW_UPDATE, not fail."""
    with running_mock(MockConfig(dialect="vllm")) as m:
        async def go() -> list[Result]:
            c = make_client(m.url, "2")
            try:
                return await run_open_loop(c, fixed_rate(20, 0.2, prompt_tokens=40_000, output_tokens=2, uniform=True), RequestShape(mock={"prefill_ms": 0, "tpot_ms": 1}), timeout_s=10)
            finally:
                await c.aclose()

        res = _run(go())
    assert len(res) == 4 and all(r.ok and r.tokens >= 1 and r.prompt_tokens == 40_000 for r in res), [r.error for r in res]
