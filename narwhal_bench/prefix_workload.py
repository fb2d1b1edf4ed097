"""`narwhal bench prefix`'s workload (pure): the Mooncake conversation trace, the sample
of conversations replayed, their requests scaled onto the bench's time and token sizes,
each prompt's text (one fixed text per trace block, so that a shared block is a shared
prefix) and the best hit rate any placement could reach. The rules: prefix.py's
docstring; also prefix_model.py's workload."""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

__all__ = ["TraceRequest", "load_mooncake", "select", "scale", "block_text", "prompt_content", "request_body", "ideal_hit_rate", "DEFAULT_TRACE", "MODEL"]

DEFAULT_TRACE = Path("/work/shared/data/traces/mooncake_conversation.jsonl")
TRACE_BLOCK_TOKENS = 512  # the trace's hash_ids block
BYTES_PER_TOKEN = 4  # the mock's sizing of text (narwhal/mock/tokens.py)
MOCK_BLOCK = 16  # the mocks' KV block (vLLM's default)
APPROX_BLOCK_TOKENS = 64  # Narwhal's approximate index block (256 bytes at 4 bytes a token)
MODEL = "narwhal-demo"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    at: float  # seconds from the start of the replay
    hash_ids: tuple[int, ...]  # the blocks kept (at most max_blocks)
    prompt_tokens: int  # text tokens of the user message (the mock adds 3 template tokens)
    output_tokens: int
    trace_ts_ms: int = 0


def load_mooncake(path: str | Path = DEFAULT_TRACE) -> list[dict[str, Any]]:
    """The trace's rows, by timestamp (stable)."""
    with open(path, "rb") as f:
        rows = [orjson.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])
    return rows


def _keep_conversation(key: int, sample: float, seed: int) -> bool:
    return random.Random(f"{seed}:{key}").random() < sample


def select(rows: Sequence[dict[str, Any]], *, start_s: float, window_s: float, sample: float = 1.0, seed: int = 1) -> list[dict[str, Any]]:
    """The rows of [start_s, start_s + window_s), conversations (hash_ids[1]) sampled with
    probability `sample` by a seeded coin; a one-block request is its own conversation."""
    out = []
    lo, hi = start_s * 1000.0, (start_s + window_s) * 1000.0
    for i, r in enumerate(rows):
        t = r["timestamp"]
        if t < lo or t >= hi:
            continue
        h = r["hash_ids"]
        key = h[1] if len(h) > 1 else -1 - i
        if sample >= 1.0 or _keep_conversation(key, sample, seed):
            out.append(r)
    return out


def scale(rows: Sequence[dict[str, Any]], *, start_s: float, speedup: float, tokens_per_block: int, max_blocks: int, output_scale: float, max_output: int) -> list[TraceRequest]:
    """Selected rows as requests: time compressed by `speedup`, sizes scaled (module rules)."""
    out = []
    for r in rows:
        h = tuple(r["hash_ids"][:max_blocks])
        n = round(r["input_length"] * tokens_per_block / TRACE_BLOCK_TOKENS)
        n = max(1, min(n, len(h) * tokens_per_block))
        o = max(1, min(max_output, round(r["output_length"] * output_scale)))
        out.append(TraceRequest((r["timestamp"] / 1000.0 - start_s) / speedup, h, n, o, int(r["timestamp"])))
    return out


_WORDS = (
    "amber", "basalt", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kelp", "lagoon",
    "meadow", "nectar", "obsidian", "pebble", "quartz", "reef", "sierra", "tundra", "umber", "valley", "willow", "xenon",
    "yarrow", "zephyr", "narwhal", "orca", "plankton", "current", "tide", "krill",
)


def block_text(hash_id: int, tokens_per_block: int) -> str:
    """The text of one trace block: tokens_per_block x 4 ASCII bytes, a function of the
    hash ID alone (it starts with "<ID>", so different IDs differ in their first bytes)."""
    size = tokens_per_block * BYTES_PER_TOKEN
    parts = [f"<{hash_id}>"]
    n = len(parts[0])
    k = 0
    while n < size:
        d = hashlib.blake2b(f"{hash_id}:{k}".encode(), digest_size=16).digest()
        for b in d:
            w = " " + _WORDS[b % len(_WORDS)]
            parts.append(w)
            n += len(w)
        k += 1
    return "".join(parts)[:size]


def prompt_content(hash_ids: Sequence[int], prompt_tokens: int, tokens_per_block: int) -> str:
    """The user message: the blocks' texts concatenated, cut at prompt_tokens x 4 bytes."""
    need = prompt_tokens * BYTES_PER_TOKEN
    blocks = min(len(hash_ids), math.ceil(need / (tokens_per_block * BYTES_PER_TOKEN)))
    return "".join(block_text(h, tokens_per_block) for h in hash_ids[:blocks])[:need]


def request_body(req: TraceRequest, tokens_per_block: int, model: str = MODEL) -> bytes:
    return orjson.dumps({
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": req.output_tokens,
        "messages": [{"role": "user", "content": prompt_content(req.hash_ids, req.prompt_tokens, tokens_per_block)}],
    })


def ideal_hit_rate(reqs: Sequence[TraceRequest], tokens_per_block: int) -> float:
    """Token hit rate of one unbounded cache that holds every prompt's full trace blocks
    (the most any router could get from this replay, at trace-block granularity)."""
    seen: set[tuple[int, ...]] = set()
    hit = tot = 0
    for r in sorted(reqs, key=lambda x: x.at):
        full = r.prompt_tokens // tokens_per_block
        k = 0
        while k < full and r.hash_ids[: k + 1] in seen:
            k += 1
        hit += min(k * tokens_per_block, r.prompt_tokens - 1)
        tot += r.prompt_tokens
        for i in range(full):
            seen.add(r.hash_ids[: i + 1])
    return hit / tot if tot else 0.0
