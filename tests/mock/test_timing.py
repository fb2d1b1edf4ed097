"""The timing model: FCFS prefill, prompt-length growth, batch-dependent TPOT,
cancellation on disconnect, bounded shutdown. Bounds are generous on purpose."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest

from narwhal.mock import MockConfig, Timing, running_mock
from narwhal.mock.timing import EngineLoad, prompt_size

from .support import MODEL, chat_body, completion_body, request, sse, wait_until


def test_timing_formulas() -> None:
    t = Timing()
    assert t.prefill_ms(0) == 4.0 and t.prefill_ms(1000) == pytest.approx(4 + 20 + 2)
    assert t.tpot_ms(0) == 8.0 and t.tpot_ms(100) == pytest.approx(13.0)
    assert t.transfer_ms(2000) == pytest.approx(2.0)


def test_load_scales_and_batches() -> None:
    load = EngineLoad(Timing(time_scale=0.5))
    assert load.tpot_s() == pytest.approx(0.004)
    load.decoding = 200
    assert load.tpot_s() == pytest.approx((8 + 0.05 * 200) * 0.5 / 1000)
    assert load.tpot_s(override_ms=3) == pytest.approx(0.003)  # overrides are wall-clock
    noisy = [EngineLoad(Timing(noise_sigma=0.5, seed=7)).scaled(10) for _ in range(2)]
    assert noisy[0] == noisy[1] != 0.01  # seeded: deterministic


def test_prompt_size() -> None:
    body = {"messages": [{"role": "system", "content": "abcd" * 10}, {"role": "user", "content": [{"type": "text", "text": "é"}]}]}
    assert prompt_size("chat", body, 4.0) == (11 + 6, None)  # ceil(42 / 4) + 3 per message
    assert prompt_size("completions", {"prompt": [1, 2, 3]}, 4.0) == (3, [1, 2, 3])
    assert prompt_size("completions", {"prompt": "x" * 9}, 4.0) == (3, None)
    assert prompt_size("completions", {"prompt": "x" * 9}, 2.0) == (5, None)


def test_fcfs_prefill_is_one_at_a_time() -> None:
    """Two concurrent requests: the second's first token comes after both prefills."""
    timing = Timing(prefill_base_ms=200, prefill_per_token_ms=0, prefill_quadratic_ms=0, tpot_base_ms=1, tpot_per_seq_ms=0)
    with running_mock(MockConfig(timing=timing)) as m:

        async def one(client: httpx.AsyncClient) -> float:
            t0 = time.monotonic()
            async with client.stream("POST", m.url + "/v1/chat/completions", json=chat_body(stream=True, mock={"tokens": 2})) as r:
                async for line in r.aiter_lines():
                    if '"content":"Narwhals"' in line:
                        return time.monotonic() - t0
            raise AssertionError("no first token")

        async def both() -> list[float]:
            async with httpx.AsyncClient(timeout=5.0) as c:
                return list(await asyncio.gather(one(c), one(c)))

        first, second = sorted(asyncio.run(both()))
        assert 0.15 < first < 0.35
        assert second > 0.37  # 2 x 200 ms, serialised
        assert m.stats()["prefills"] == 2 and m.stats()["prefill_queue"] == 0


def test_prefill_time_grows_with_prompt_length() -> None:
    timing = Timing(prefill_base_ms=1, prefill_per_token_ms=0.05, prefill_quadratic_ms=0, tpot_base_ms=1)
    with running_mock(MockConfig(timing=timing)) as m:
        short = sse(m.url, chat_body("hi", stream=True, mock={"tokens": 1})).arrivals[0]
        long = sse(m.url, chat_body("x" * 16000, stream=True, mock={"tokens": 1})).arrivals[0]  # 4003 tokens: ~200 ms
        assert long - short > 0.1
        ids = sse(m.url, completion_body(list(range(4000)), stream=True, mock={"tokens": 1}), path="/v1/completions").arrivals[0]
        assert ids - short > 0.1


def test_per_request_timing_overrides() -> None:
    with running_mock(MockConfig(timing=Timing(time_scale=0.01))) as m:
        s = sse(m.url, chat_body(stream=True, mock={"tokens": 4, "prefill_ms": 150, "tpot_ms": 50}))
        assert s.arrivals[0] >= 0.13
        gaps = [b - a for a, b in zip(s.arrivals[1:], s.arrivals[2:], strict=False)]
        assert sum(gaps) >= 0.12  # three decode steps of 50 ms


def test_decode_time_grows_with_batch() -> None:
    timing = Timing(prefill_base_ms=0, prefill_per_token_ms=0, prefill_quadratic_ms=0, tpot_base_ms=1, tpot_per_seq_ms=2)
    with running_mock(MockConfig(timing=timing)) as m:
        alone = sse(m.url, chat_body(stream=True, mock={"tokens": 20}))
        t_alone = alone.arrivals[-1] - alone.arrivals[0]

        async def crowd() -> list[float]:
            async with httpx.AsyncClient(timeout=10, limits=httpx.Limits(max_connections=40)) as c:
                async def one() -> float:
                    r = await c.post(m.url + "/v1/chat/completions", json=chat_body(mock={"tokens": 20}))
                    return r.elapsed.total_seconds()

                return list(await asyncio.gather(*(one() for _ in range(30))))

        t_crowd = max(asyncio.run(crowd()))
        assert t_crowd > 2 * t_alone  # ~30 sequences: tpot ~61 ms instead of ~3 ms


def test_client_disconnect_frees_the_engine() -> None:
    with running_mock(MockConfig(timing=Timing(tpot_base_ms=5))) as m:
        with httpx.Client(timeout=5.0) as c, c.stream("POST", m.url + "/v1/chat/completions", json=chat_body(stream=True, mock={"tokens": 10000})) as r:
            lines = r.iter_lines()
            next(lines)
            next(lines)
            assert m.stats()["in_flight"] == 1 and m.stats()["decoding"] == 1
        wait_until(lambda: m.stats()["in_flight"] == 0, timeout=3, what="in-flight back to 0")
        st = m.stats()
        assert st["decoding"] == 0 and st["cancelled"] == 1 and st["completed"] == 0


def test_disconnect_frees_prefill_queue() -> None:
    with running_mock(MockConfig(timing=Timing(prefill_base_ms=5000))) as m:
        errors: list[Exception] = []

        def client() -> None:
            try:
                request("POST", m.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, timeout=httpx.Timeout(5, read=0.4))
            except httpx.ReadTimeout as e:
                errors.append(e)

        threads = [threading.Thread(target=client) for _ in range(3)]
        for t in threads:
            t.start()
        wait_until(lambda: m.stats()["prefill_queue"] == 3, timeout=3, what="three queued prefills")
        for t in threads:
            t.join(5)
        assert len(errors) == 3
        wait_until(lambda: m.stats()["prefill_queue"] == 0 and m.stats()["in_flight"] == 0, timeout=3, what="queue freed")
        assert m.stats()["cancelled"] == 3
        # the engine serves again at once: the cancelled prefill released the server
        r = request("POST", m.url + "/v1/chat/completions", json=chat_body(mock={"prefill_ms": 0}), timeout=5.0)
        assert r.status_code == 200


def test_exit_with_a_stalled_stream_is_bounded() -> None:
    got: list[Any] = []
    t0 = 0.0
    with running_mock(MockConfig(timing=Timing(time_scale=0.01))) as m:

        def reader() -> None:
            got.append(sse(m.url, chat_body(stream=True, mock={"fault": "stall"}), timeout=httpx.Timeout(10.0)))

        th = threading.Thread(target=reader)
        th.start()
        wait_until(lambda: m.stats()["in_flight"] == 1, timeout=3, what="stalled stream open")
        t0 = time.monotonic()
    assert time.monotonic() - t0 < 5
    th.join(5)
    assert got and not got[0].done
