"""Engines that cache, over HTTP and ZMQ: cached_tokens in usage, prefill charged for the
uncached tokens only, /tokenize, and vLLM's KV events on a SUB socket."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import zmq

from narwhal.core.dialects import decode_body, prefill_body
from narwhal.mock import MockConfig, RunningMock, Timing, decode_batch, running_fleet, running_mock
from narwhal.mock.cache import AllBlocksCleared, BlockRemoved, BlockStored, block_hashes
from narwhal.mock.cli import add_arguments, config_from_args

from .support import MODEL, completion_body, get, post, request, sse

FAST = Timing(time_scale=0.01)
BS = 16
SYSTEM = "You are a helpful narwhal who answers questions about the Arctic ocean. " * 3


def turn1() -> list[dict[str, Any]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "How long is a narwhal's tusk?"}]


def turn2(answer: str) -> list[dict[str, Any]]:
    return [*turn1(), {"role": "assistant", "content": answer}, {"role": "user", "content": "And how heavy is it?"}]


def full_blocks(n: int) -> int:
    return n // BS * BS


@pytest.fixture(scope="module")
def caching() -> Iterator[dict[str, RunningMock]]:
    cfgs = [MockConfig(dialect=d, name=d, timing=FAST, prefix_cache_tokens=100_000) for d in ("vllm", "sglang", "openai")]
    with running_fleet(cfgs) as mocks:
        yield {m.name: m for m in mocks}


@pytest.mark.parametrize("stream", [False, True])
def test_second_turn_reports_the_first_turns_full_blocks_and_prefills_faster(stream: bool) -> None:
    with running_mock(MockConfig(timing=FAST, prefix_cache_tokens=100_000)) as m:
        extra: dict[str, Any] = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}

        def ask(msgs: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
            body = {"model": MODEL, "messages": msgs, **extra}
            if stream:
                s = sse(m.url, body)
                assert s.status == 200 and s.done
                text = "".join(c["choices"][0]["delta"].get("content") or "" for c in s.chunks if c["choices"])
                return s.chunks[-1]["usage"], text
            r = post(m.url, body)
            assert r.status_code == 200
            return r.json()["usage"], r.json()["choices"][0]["message"]["content"]

        u1, answer = ask(turn1())
        n1 = u1["prompt_tokens"]
        assert n1 > BS and n1 % BS  # the first turn has a partial last block
        # vLLM reports no detail for 0 cached tokens: absent in a stream, null in a response
        assert ("prompt_tokens_details" not in u1) if stream else (u1["prompt_tokens_details"] is None)
        u2, _ = ask(turn2(answer))
        n2 = u2["prompt_tokens"]
        assert u2["prompt_tokens_details"] == {"cached_tokens": full_blocks(n1)}
        r1, r2 = (r["prefill"] for r in m.requests())
        t = m.config.timing
        assert r1 == {"prompt_tokens": n1, "cached_tokens": 0, "ms": pytest.approx(t.prefill_ms(n1))}
        assert r2 == {"prompt_tokens": n2, "cached_tokens": full_blocks(n1), "ms": pytest.approx(t.prefill_ms(n2 - full_blocks(n1)))}
        assert r2["ms"] < r1["ms"] < t.prefill_ms(n2)  # the longer prompt prefills faster
        st = get(m.url + "/mock/stats").json()
        assert st["prompt_tokens"] == n1 + n2 and st["cached_tokens"] == full_blocks(n1)
        assert st["prefill_ms"] == pytest.approx(r1["ms"] + r2["ms"])
        assert st["prefix_cache"] == {"block_size": BS, "blocks": full_blocks(n2) // BS, "capacity_blocks": 100_000 // BS,
                                      "capacity_tokens": 100_000 // BS * BS, "kv_events": None, "kv_event_batches": 0}  # fmt: skip
        metrics = get(m.url + "/metrics").text
        assert f'vllm:prefix_cache_hits_total{{model_name="{MODEL}"}} {float(full_blocks(n1))}' in metrics


def test_a_repeated_prompt_hits_all_but_its_last_token() -> None:
    """vLLM computes at least one prompt token: a block-aligned repeat hits n - BS tokens."""
    with running_mock(MockConfig(timing=FAST, prefix_cache_tokens=4096)) as m:
        prompt = list(range(100, 100 + 4 * BS))
        usages = [post(m.url, completion_body(prompt), path="/v1/completions").json()["usage"] for _ in range(2)]
        assert usages[0]["prompt_tokens_details"] is None and usages[1]["prompt_tokens_details"] == {"cached_tokens": 3 * BS}
        unaligned = [post(m.url, completion_body(prompt + [7]), path="/v1/completions").json()["usage"] for _ in range(2)]
        assert unaligned[1]["prompt_tokens_details"] == {"cached_tokens": 4 * BS}


def test_every_dialect_reports_cached_tokens(caching: dict[str, RunningMock]) -> None:
    for name, m in caching.items():
        first = post(m.url, {"model": MODEL, "messages": turn1()}).json()
        answer = first["choices"][0]["message"]["content"]
        n1 = first["usage"]["prompt_tokens"]
        s = sse(m.url, {"model": MODEL, "messages": turn2(answer), "stream": True, "stream_options": {"include_usage": True}})
        details = s.chunks[-1]["usage"]["prompt_tokens_details"]
        if name == "vllm":
            assert first["usage"]["prompt_tokens_details"] is None
            assert details == {"cached_tokens": full_blocks(n1)}
        elif name == "sglang":  # --enable-cache-report: always, 0 included
            assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
            assert details == {"cached_tokens": full_blocks(n1)}
        else:
            assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0, "audio_tokens": 0}
            assert details == {"cached_tokens": full_blocks(n1), "audio_tokens": 0}


def test_fcfs_a_queued_request_sees_the_blocks_of_the_one_before_it() -> None:
    """Lookups happen when a prefill starts: of two identical requests sent together, the
    second (queued behind the first) hits the first's blocks."""
    timing = Timing(prefill_base_ms=100, prefill_per_token_ms=0, prefill_quadratic_ms=0, tpot_base_ms=1, tpot_per_seq_ms=0)
    with running_mock(MockConfig(timing=timing, prefix_cache_tokens=4096)) as m:
        import concurrent.futures

        prompt = list(range(1, 3 * BS + 2))
        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            rs = list(ex.map(lambda _: post(m.url, completion_body(prompt), path="/v1/completions"), range(2)))
        cached = sorted((r.json()["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) for r in rs)
        assert cached == [0, 3 * BS]


def test_decode_engines_neither_look_up_nor_store() -> None:
    cfgs = [MockConfig(role="prefill", name="p", timing=FAST, prefix_cache_tokens=4096), MockConfig(role="decode", name="d", timing=FAST, prefix_cache_tokens=4096)]
    with running_fleet(cfgs) as (p, d):
        client = {"model": MODEL, "prompt": list(range(1, 2 * BS + 2)), "max_tokens": 3}
        for i in range(2):
            kv = post(p.url, prefill_body(client, route="completions"), path="/v1/completions", headers={"x-request-id": f"r{i}"}).json()
            assert kv["usage"]["prompt_tokens_details"] == ({"cached_tokens": 2 * BS} if i else None)
            out = sse(d.url, decode_body(client, dialect="vllm", kv_transfer_params=kv["kv_transfer_params"], disaggregated=True), path="/v1/completions")
            usage = out.chunks[-1]["usage"]
            assert "prompt_tokens_details" not in usage and usage["completion_tokens"] == 3
        assert p.stats()["cached_tokens"] == 2 * BS and p.stats()["prefix_cache"]["blocks"] == 2
        assert d.stats()["cached_tokens"] == 0 and d.stats()["prefix_cache"]["blocks"] == 0


def test_tokenize_answers_the_engines_own_ids(caching: dict[str, RunningMock]) -> None:
    m = caching["vllm"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count the tokens of this prompt."}]
    tok = post(m.url, {"model": MODEL, "messages": msgs}, path="/tokenize").json()
    done = post(m.url, {"model": MODEL, "messages": msgs, "return_token_ids": True}).json()
    assert tok["count"] == len(tok["tokens"]) == done["usage"]["prompt_tokens"] and tok["max_model_len"] == 131072
    assert done["prompt_token_ids"] == tok["tokens"] and tok["token_strs"] is None
    p = post(m.url, {"model": MODEL, "prompt": "Once upon a time"}, path="/tokenize").json()
    assert p["count"] == 4 == post(m.url, completion_body("Once upon a time"), path="/v1/completions").json()["usage"]["prompt_tokens"]
    assert post(m.url, {"model": MODEL, "prompt": [5, 6, 7]}, path="/tokenize").json()["tokens"] == [5, 6, 7]
    assert post(m.url, {"model": "other", "prompt": "x"}, path="/tokenize").status_code == 404
    assert post(m.url, {"model": MODEL}, path="/tokenize").status_code == 400
    assert post(caching["sglang"].url, {"model": MODEL, "prompt": "x"}, path="/tokenize").status_code == 404  # vllm only


def test_cache_off_by_default() -> None:
    with running_mock(MockConfig(timing=FAST)) as m:
        r = post(m.url, {"model": MODEL, "messages": turn1()}).json()
        assert r["usage"]["prompt_tokens_details"] is None and "prefill" not in m.requests()[0]
        assert m.stats()["prefix_cache"] is None and m.stats()["cached_tokens"] == 0
        assert request("POST", m.url + "/reset_prefix_cache").status_code == 404


# --- KV events over ZMQ ------------------------------------------------------------------


class Subscriber:
    """A vLLM KV-event subscriber: SUB socket, [topic, seq, payload] frames."""

    def __init__(self, endpoint: str, topic: bytes = b"") -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)

    def recv(self, timeout_s: float = 5.0) -> tuple[bytes, int, bytes]:
        assert self.sock.poll(int(timeout_s * 1000)), "no KV event message"
        topic, seq, payload = self.sock.recv_multipart()
        assert len(seq) == 8
        return topic, int.from_bytes(seq, "big"), payload

    def join(self, m: RunningMock) -> int:
        """Wait out ZMQ's slow joiner: reset the cache (an AllBlocksCleared batch) until one
        arrives; then drain. Returns the next sequence number."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            assert request("POST", m.url + "/reset_prefix_cache").status_code == 200
            if self.sock.poll(100):
                break
        seq = -1
        while self.sock.poll(200):
            _, seq, payload = self.recv()
            assert decode_batch(payload)[1] == [AllBlocksCleared()]
        assert seq >= 0, "the subscriber never joined"
        return seq + 1

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.mark.parametrize("fmt", ["array", "map"])
def test_kv_events_on_a_sub_socket(fmt: str) -> None:
    cfg = MockConfig(timing=FAST, prefix_cache_tokens=2 * 4, block_size=4, kv_events="tcp://127.0.0.1:*", kv_events_topic="kv", kv_events_format=fmt)
    with running_mock(cfg) as m:
        endpoint = m.stats()["prefix_cache"]["kv_events"]
        assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith("*")
        sub = Subscriber(endpoint, b"kv")
        try:
            seq = sub.join(m)
            a, b = list(range(1, 10)), list(range(11, 20))  # two full blocks each (+ one token)
            post(m.url, completion_body(a), path="/v1/completions")
            topic, s, payload = sub.recv()
            ha = block_hashes(a, 4)
            assert (topic, s) == (b"kv", seq)
            ts, events, rank = decode_batch(payload)
            assert abs(ts - time.time()) < 60 and rank == 0
            assert events == [BlockStored(tuple(ha), None, tuple(a[:8]), 4)]
            raw = msgpack.unpackb(payload)
            if fmt == "array":
                assert raw[1][0] == ["BlockStored", ha, None, a[:8], 4, None, "GPU", None]
            else:
                assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["token_ids"] == a[:8]
            # b needs both slots: a's leaf goes first, then its parent
            post(m.url, completion_body(b), path="/v1/completions")
            _, s, payload = sub.recv()
            hb = block_hashes(b, 4)
            assert s == seq + 1
            assert decode_batch(payload)[1] == [BlockRemoved((ha[1],)), BlockRemoved((ha[0],)), BlockStored(tuple(hb), None, tuple(b[:8]), 4)]
            # a full hit changes nothing and publishes nothing
            post(m.url, completion_body(b), path="/v1/completions")
            assert not sub.sock.poll(300)
            assert m.stats()["prefix_cache"]["kv_event_batches"] == seq + 2
        finally:
            sub.close()


def test_kv_events_config_and_cli() -> None:
    with pytest.raises(ValueError, match="vllm"):
        MockConfig(dialect="sglang", prefix_cache_tokens=64, kv_events="tcp://127.0.0.1:5557")
    with pytest.raises(ValueError, match="prefix cache"):
        MockConfig(kv_events="tcp://127.0.0.1:5557")
    with pytest.raises(ValueError):
        MockConfig(block_size=0)
    p = argparse.ArgumentParser()
    add_arguments(p)
    cfg = config_from_args(p.parse_args(["--port", "9", "--block-size", "32", "--prefix-cache-tokens", "8192", "--kv-events", "tcp://127.0.0.1:5557", "--kv-events-format", "map"]))
    assert (cfg.block_size, cfg.prefix_cache_tokens, cfg.kv_events, cfg.kv_events_format, cfg.kv_events_topic) == (32, 8192, "tcp://127.0.0.1:5557", "map", "")
    d = config_from_args(p.parse_args(["--port", "9"]))
    assert (d.block_size, d.prefix_cache_tokens, d.kv_events) == (16, 0, None)
