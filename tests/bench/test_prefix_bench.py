"""`narwhal bench prefix`'s pure parts: the trace selection and scaling, the block texts
(shared hash prefixes are shared token prefixes for the mock's cache), the header
accuracy, and the recorder's usage parsing against a caching mock engine."""

from __future__ import annotations

import asyncio

import orjson

from narwhal.mock import MockConfig, running_mock
from narwhal.mock.cache import block_hashes
from narwhal.mock.tokens import prompt_token_ids
from narwhal_bench.harness.client import make_client
from narwhal_bench.harness.stats import Result
from narwhal_bench.prefix import PrefixRecorder, header_accuracy
from narwhal_bench.prefix_workload import (
    TraceRequest,
    block_text,
    ideal_hit_rate,
    prompt_content,
    request_body,
    scale,
    select,
)


def _row(ts: int, ids: list[int], n: int | None = None, out: int = 100) -> dict[str, object]:
    return {"timestamp": ts, "input_length": n if n is not None else 512 * len(ids), "output_length": out, "hash_ids": ids}


def test_block_text_is_a_function_of_the_id_and_sized() -> None:
    a, b = block_text(7, 64), block_text(7, 64)
    assert a == b and len(a) == 256 and a.isascii()
    assert block_text(8, 64)[:3] != a[:3]  # different IDs differ at once
    assert len(block_text(123456, 16)) == 64


def test_shared_hash_prefix_is_a_shared_token_prefix() -> None:
    t = 64
    p1 = prompt_content([0, 1, 2, 3], 4 * t, t)
    p2 = prompt_content([0, 1, 2, 9, 10], 5 * t - 10, t)
    assert len(p1) == 4 * t * 4 and len(p2) == (5 * t - 10) * 4
    cut = 3 * t * 4
    assert p1[:cut] == p2[:cut] and p1[cut : cut + 4] != p2[cut : cut + 4]

    def ids(text: str) -> list[int]:
        return prompt_token_ids("chat", {"messages": [{"role": "user", "content": text}]}, 4.0)

    h1, h2 = block_hashes(ids(p1), 16), block_hashes(ids(p2), 16)
    shared = 0
    while shared < min(len(h1), len(h2)) and h1[shared] == h2[shared]:
        shared += 1
    # 3 template tokens + 3 x 64 shared text tokens: 12 full 16-token blocks are shared
    assert shared == (3 + 3 * t) // 16


def test_select_keeps_conversations_whole_and_the_window() -> None:
    rows = [_row(1000 * i, [0, 100 + i % 7, 1000 + i]) for i in range(200)]
    sel = select(rows, start_s=10, window_s=100, sample=0.5, seed=3)
    assert all(10_000 <= r["timestamp"] < 110_000 for r in sel)
    kept = {r["hash_ids"][1] for r in sel}
    in_window = [r for r in rows if 10_000 <= r["timestamp"] < 110_000]
    assert 0 < len(kept) < 7
    assert all(r in sel for r in in_window if r["hash_ids"][1] in kept)  # every turn of a kept conversation
    assert select(rows, start_s=10, window_s=100, sample=0.5, seed=3) == sel  # seeded
    assert len(select(rows, start_s=0, window_s=1e9)) == 200


def test_scale_compresses_time_and_caps_blocks() -> None:
    rows = [_row(600_000, [0, 1], 700, out=3), _row(660_000, list(range(40)), 40 * 512 - 5, out=2000)]
    reqs = scale(rows, start_s=600, speedup=6.0, tokens_per_block=64, max_blocks=32, output_scale=0.1, max_output=64)
    assert reqs[0].at == 0 and abs(reqs[1].at - 10.0) < 1e-9
    assert reqs[0].prompt_tokens == round(700 * 64 / 512) and reqs[0].output_tokens == 1
    assert len(reqs[1].hash_ids) == 32 and reqs[1].prompt_tokens == 32 * 64 and reqs[1].output_tokens == 64
    body = orjson.loads(request_body(reqs[0], 64))
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 1
    assert len(body["messages"][0]["content"]) == reqs[0].prompt_tokens * 4


def test_ideal_hit_rate() -> None:
    r = [TraceRequest(0.0, (0, 1), 128, 1), TraceRequest(1.0, (0, 1, 2), 192, 1), TraceRequest(2.0, (0, 5), 128, 1)]
    # second: 2 blocks of 128 tokens; third: block 0 = 64 of 128
    assert abs(ideal_hit_rate(r, 64) - (128 + 64) / (128 + 192 + 128)) < 1e-9


def test_header_accuracy() -> None:
    def res(exp: int, got: int) -> Result:
        r = Result(scheduled=0.0, sent=0.0, status=200, first_token_at=0.1, done_at=0.2)
        r.extra.update(expected_cached=exp, cached_tokens=got)
        return r

    a = header_accuracy([res(0, 0), res(320, 320), res(320, 304), res(384, 320), res(0, 640)])
    assert a is not None and a["n"] == 5
    assert a["within_engine_block"] == 3 / 5 and a["within_index_block"] == 4 / 5 and a["under"] == 1 / 5
    assert header_accuracy([Result(scheduled=0.0)]) is None


def test_recorder_reads_usage_cached_tokens_from_a_caching_mock() -> None:
    with running_mock(MockConfig(dialect="vllm", prefix_cache_tokens=8192, output_tokens=64)) as m:
        req = TraceRequest(0.0, (0, 1, 2), 3 * 64, 4)

        async def go() -> list[Result]:
            c = make_client(m.url, "1")
            out = []
            try:
                for _ in range(2):
                    r = Result(scheduled=0.0)
                    await c.request("POST", "/v1/chat/completions", request_body(req, 64), PrefixRecorder(r), timeout_s=10)
                    out.append(r)
            finally:
                await c.aclose()
            return out

        first, second = asyncio.run(asyncio.wait_for(go(), 30))
    assert first.ok and second.ok and second.tokens == 4
    assert first.extra["cached_tokens"] == 0 and first.extra["usage_prompt_tokens"] == 3 * 64 + 3
    # the whole prompt but its last token, in full 16-token blocks: 195 tokens -> 192
    assert second.extra["cached_tokens"] == 192 and second.extra["cached_reported"] is True


def _conversations(turns: int, convs: int, gap_s: float) -> list[TraceRequest]:
    """`convs` conversations of `turns` turns, each turn 4 blocks longer than the last."""
    out = []
    for t in range(turns):
        for c in range(convs):
            ids = (0, *range(1000 * (c + 1), 1000 * (c + 1) + 4 * (t + 1)))
            out.append(TraceRequest((t * convs + c) * gap_s, ids, 64 * len(ids), 8))
    return out


def test_the_model_of_the_bench_sees_what_each_rule_reuses() -> None:
    from narwhal_bench.prefix_model import RULES, simulate

    reqs = _conversations(turns=5, convs=8, gap_s=0.05)
    got = {rule: simulate(reqs, rule, engines=4, cache_tokens=1 << 20) for rule in RULES}
    # with room for everything, a rule that follows the cache finds every earlier turn
    # there: the reuse ceiling; the cache-blind rule finds only what landed by chance
    ceiling = ideal_hit_rate(reqs, 64)
    assert got["oracle"]["hit_rate"] == got["cost"]["hit_rate"] > got["blind"]["hit_rate"]
    assert abs(got["oracle"]["hit_rate"] - ceiling) < 0.02
    assert got["cost"]["same_engine"] == 1.0
    for r in got.values():
        assert 0.0 <= r["hit_rate"] <= 1.0 and r["p50"] <= r["p90"] <= r["p99"] and 0.0 <= r["goodput"] <= 1.0
    # a cache too small for one conversation reuses only block 0 at best
    tiny = simulate(reqs, "cost", engines=4, cache_tokens=64)
    assert tiny["hit_rate"] < got["cost"]["hit_rate"]
