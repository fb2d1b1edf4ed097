"""The mock engines' prefix cache model, tokenizer and KV event encoding (sans-IO)."""

from __future__ import annotations

import hashlib
import math
import struct
import zlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from narwhal.mock.cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheEvent,
    PrefixCache,
    block_hash,
    block_hashes,
)
from narwhal.mock.kv_events import decode_batch, encode_batch
from narwhal.mock.tokens import (
    EMPTY_PROMPT_ID,
    IM_START_ID,
    NEWLINE_ID,
    ROLE_IDS,
    VOCAB_SIZE,
    piece_id,
    prompt_size,
    prompt_token_ids,
    role_id,
)

# --- the cache model, table-driven -------------------------------------------------------


def H(bs: int, *tokens: int) -> int:
    """The hash of the last full block of `tokens` (its whole prefix chained in)."""
    return block_hashes(list(tokens), bs)[-1]


def stored(bs: int, prefix: tuple[int, ...], new: tuple[int, ...]) -> BlockStored:
    """The BlockStored event for blocks `new` added after the cached `prefix`."""
    full = prefix + new
    hs = block_hashes(list(full), bs)[len(prefix) // bs :]
    return BlockStored(tuple(hs), H(bs, *prefix) if prefix else None, new, bs)


def removed(bs: int, *prefix: int) -> BlockRemoved:
    return BlockRemoved((H(bs, *prefix),))


R = tuple(range(1, 13))  # 1..12

# (name, block_size, capacity_tokens, [(op, argument, expected)])
#   op insert: expected events; op lookup: expected cached tokens; op len: blocks;
#   op order: the cached blocks least recent first, each named by its token prefix
CASES: list[tuple[str, int, int, list[tuple[str, Any, Any]]]] = [
    ("hit on a shared prefix", 4, 64, [
        ("insert", R[:8], [stored(4, (), R[:8])]),
        ("lookup", R[:8] + (99,), 8),
        ("lookup", R[:6] + (0, 0), 4),  # the second block differs
        ("lookup", (0,) + R[1:8], 0),  # the first block differs: nothing
        ("lookup", R[:3], 0),  # shorter than a block
    ]),
    ("partial blocks are never cached", 4, 64, [
        ("insert", R[:6], [stored(4, (), R[:4])]),
        ("len", None, 1),
        ("lookup", R[:8], 4),
        ("insert", R[:8], [stored(4, R[:4], R[4:8])]),  # the block completes: stored now
        ("lookup", R[:8], 8),
    ]),
    ("identity is chained: the same block after another prefix is a miss", 4, 64, [
        ("insert", R[:8], [stored(4, (), R[:8])]),
        ("lookup", (9, 9, 9, 9) + R[4:8], 0),
        ("lookup", R[4:8], 0),
    ]),
    ("a full hit stores nothing and touches its blocks", 2, 64, [
        ("insert", (1, 2, 3, 4), [stored(2, (), (1, 2, 3, 4))]),
        ("insert", (5, 6), [stored(2, (), (5, 6))]),
        ("order", None, [(1, 2, 3, 4), (1, 2), (5, 6)]),
        ("insert", (1, 2, 3, 4, 7), []),
        ("order", None, [(5, 6), (1, 2, 3, 4), (1, 2)]),
    ]),
    ("LRU evicts leaves before their parents", 2, 6, [
        ("insert", (1, 2, 3, 4, 5, 6), [stored(2, (), (1, 2, 3, 4, 5, 6))]),
        ("order", None, [(1, 2, 3, 4, 5, 6), (1, 2, 3, 4), (1, 2)]),
        # a branch off the first block: the other branch's leaf goes first
        ("insert", (1, 2, 7, 8), [removed(2, 1, 2, 3, 4, 5, 6), stored(2, (1, 2), (7, 8))]),
        ("lookup", (1, 2, 3, 4, 5, 6), 4),
        ("lookup", (1, 2, 7, 8), 4),
        ("order", None, [(1, 2, 3, 4), (1, 2, 7, 8), (1, 2)]),
        ("insert", (9, 10), [removed(2, 1, 2, 3, 4), stored(2, (), (9, 10))]),
        ("insert", (11, 12), [removed(2, 1, 2, 7, 8), stored(2, (), (11, 12))]),
        ("insert", (13, 14), [removed(2, 1, 2), stored(2, (), (13, 14))]),  # the parent last
    ]),
    ("least recent request first, its leaf first", 2, 8, [
        ("insert", (1, 2, 3, 4), [stored(2, (), (1, 2, 3, 4))]),
        ("insert", (5, 6, 7, 8), [stored(2, (), (5, 6, 7, 8))]),
        ("insert", (9, 10, 11, 12), [removed(2, 1, 2, 3, 4), removed(2, 1, 2), stored(2, (), (9, 10, 11, 12))]),
        ("lookup", (5, 6, 7, 8), 4),
        ("lookup", (1, 2, 3, 4), 0),
    ]),
    ("capacity bound: a prompt longer than the cache keeps its first blocks", 2, 6, [
        ("insert", R[:10], [stored(2, (), R[:6])]),
        ("len", None, 3),
        ("lookup", R[:10], 6),
        ("insert", (20, 21, 22, 23), [removed(2, *R[:6]), removed(2, *R[:4]), stored(2, (), (20, 21, 22, 23))]),
        ("len", None, 3),
    ]),
    ("capacity is whole blocks", 4, 10, [
        ("insert", R[:12], [stored(4, (), R[:8])]),
        ("len", None, 2),
    ]),
    ("a cache smaller than a block keeps nothing", 4, 3, [
        ("insert", R[:8], []),
        ("lookup", R[:8], 0),
        ("len", None, 0),
    ]),
    ("clear", 2, 64, [
        ("insert", (1, 2, 3, 4), [stored(2, (), (1, 2, 3, 4))]),
        ("clear", None, [AllBlocksCleared()]),
        ("len", None, 0),
        ("lookup", (1, 2, 3, 4), 0),
        ("insert", (1, 2), [stored(2, (), (1, 2))]),
    ]),
]  # fmt: skip


@pytest.mark.parametrize(("block_size", "capacity", "ops"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_prefix_cache(block_size: int, capacity: int, ops: list[tuple[str, Any, Any]]) -> None:
    cache = PrefixCache(capacity, block_size)
    for i, (op, arg, want) in enumerate(ops):
        if op == "insert":
            got: Any = cache.insert(list(arg))
        elif op == "lookup":
            got = cache.lookup(list(arg))
        elif op == "len":
            got = len(cache)
        elif op == "clear":
            got = cache.clear()
        else:
            got = cache.blocks()
            want = [H(block_size, *p) for p in want]
        assert got == want, f"step {i}: {op} {arg}"
        assert len(cache) <= cache.capacity_blocks


def test_block_hash_rule() -> None:
    """The rule a router reproduces: blake2b-64 over the parent and the tokens, big-endian."""
    def ref(parent: int | None, toks: list[int]) -> int:
        data = (parent or 0).to_bytes(8, "big") + b"".join((t % (1 << 64)).to_bytes(8, "big") for t in toks)
        return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")

    h0 = block_hash(None, [1, 2, 3])
    assert h0 == ref(None, [1, 2, 3]) and 0 <= h0 < 1 << 64
    assert block_hash(h0, [4, 5, 6]) == ref(h0, [4, 5, 6])
    assert block_hashes([1, 2, 3, 4, 5, 6, 7], 3) == [h0, block_hash(h0, [4, 5, 6])]
    assert block_hash(None, [-1]) == ref(None, [(1 << 64) - 1])  # any int is hashable


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 3), min_size=0, max_size=12), min_size=1, max_size=25), st.integers(0, 24))
def test_cache_invariants(prompts: list[list[int]], capacity: int) -> None:
    """Whatever the traffic: within capacity, prefix-closed (no block outlives its parent),
    every lookup after an insert finds what fitted, and the events replay to the same set."""
    bs = 2
    cache = PrefixCache(capacity, bs)
    mirror: set[int] = set()
    parent_of: dict[int, int | None] = {}
    for p in prompts:
        events = cache.insert(p)
        for e in events:
            if isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= mirror
                mirror -= set(e.block_hashes)
            else:
                assert isinstance(e, BlockStored) and (e.parent_block_hash is None or e.parent_block_hash in mirror)
                assert len(e.token_ids) == bs * len(e.block_hashes)
                hs = block_hashes(list(e.token_ids), bs) if e.parent_block_hash is None else None
                if hs is not None:
                    assert list(e.block_hashes) == hs
                prev = e.parent_block_hash
                for h in e.block_hashes:
                    parent_of[h] = prev
                    prev = h
                mirror |= set(e.block_hashes)
        assert set(cache.blocks()) == mirror and len(cache) <= cache.capacity_blocks
        for h in mirror:
            assert parent_of[h] is None or parent_of[h] in mirror
        fits = min(len(p) // bs, cache.capacity_blocks) * bs
        assert cache.lookup(p) == fits


# --- tokenization ------------------------------------------------------------------------


def chat(*msgs: tuple[str, str]) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in msgs]}


T = (IM_START_ID, ROLE_IDS["user"], NEWLINE_ID)
A = (IM_START_ID, ROLE_IDS["assistant"], NEWLINE_ID)

# (name, route, body, bytes_per_token, expected IDs)
TOKEN_CASES: list[tuple[str, str, dict[str, Any], float, list[int]]] = [
    ("completions: 4-byte pieces", "completions", {"prompt": "abcdefghij"}, 4.0, [piece_id(b"abcd"), piece_id(b"efgh"), piece_id(b"ij")]),
    ("completions: list of strings joined by newlines", "completions", {"prompt": ["ab", "cd"]}, 4.0, [piece_id(b"ab\nc"), piece_id(b"d")]),
    ("completions: token IDs as given", "completions", {"prompt": [7, 8, 9]}, 4.0, [7, 8, 9]),
    ("completions: lists of token IDs flattened", "completions", {"prompt": [[7, 8], [9]]}, 4.0, [7, 8, 9]),
    ("completions: empty", "completions", {"prompt": ""}, 4.0, [EMPTY_PROMPT_ID]),
    ("chat: the template, then the text", "chat", chat(("user", "abcdefgh")), 4.0, [*T, piece_id(b"abcd"), piece_id(b"efgh")]),
    # a piece straddling two messages belongs to the first and hashes only its bytes; the
    # second message's share goes into its own first piece
    ("chat: straddling piece", "chat", chat(("user", "abcdef"), ("assistant", "ghijkl")), 4.0,
     [*T, piece_id(b"abcd"), piece_id(b"ef"), *A, piece_id(b"ghijkl")]),
    ("chat: a message without a piece of its own", "chat", chat(("user", "abcdef"), ("assistant", "gh"), ("user", "ijkl")), 4.0,
     [*T, piece_id(b"abcd"), piece_id(b"ef"), *A, *T, piece_id(b"ghijkl")]),
    ("chat: bytes_per_token 2.5", "chat", chat(("user", "abcdefg")), 2.5, [*T, piece_id(b"ab"), piece_id(b"cde"), piece_id(b"fg")]),
    ("chat: content parts and tool calls", "chat",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "image_url"}, {"type": "text", "text": "cd"}]},
                   {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]}, 4.0,
     [*T, piece_id(b"abcd"), *A, piece_id(b"f{}")]),
    ("chat: other roles", "chat", chat(("system", ""), ("narwhal", "")), 4.0,
     [IM_START_ID, ROLE_IDS["system"], NEWLINE_ID, IM_START_ID, role_id("narwhal"), NEWLINE_ID]),
]  # fmt: skip


@pytest.mark.parametrize(("route", "body", "bpt", "want"), [c[1:] for c in TOKEN_CASES], ids=[c[0] for c in TOKEN_CASES])
def test_prompt_token_ids(route: str, body: dict[str, Any], bpt: float, want: list[int]) -> None:
    assert prompt_token_ids(route, body, bpt) == want
    assert prompt_size(route, body, bpt)[0] == len(want)


def test_token_id_rules() -> None:
    assert piece_id(b"abcd") == 256 + zlib.crc32(b"abcd") % 32000
    assert role_id("narwhal") == role_id("narwhal") and role_id("narwhal") not in ROLE_IDS.values()
    ids = prompt_token_ids("chat", chat(("user", "é" * 500)), 3.0)
    assert all(0 <= i < VOCAB_SIZE for i in ids)


_text = st.text(alphabet=st.sampled_from("ab é\n{}"), max_size=30)
_msg = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool", "x"]), "content": _text})


@settings(max_examples=150, deadline=None)
@given(st.lists(_msg, min_size=1, max_size=6), st.lists(_msg, min_size=0, max_size=4), st.sampled_from([1.0, 2.5, 3.0, 4.0, 0.7]))
def test_tokens_count_exactly_and_conversations_share_prefixes(first: list[dict[str, Any]], more: list[dict[str, Any]], bpt: float) -> None:
    """len(IDs) == usage.prompt_tokens (the existing count, unchanged), and a conversation
    that goes on starts with the earlier turn's IDs: every full block is shared."""
    a, b = {"messages": first}, {"messages": first + more}
    ida, idb = prompt_token_ids("chat", a, bpt), prompt_token_ids("chat", b, bpt)
    nbytes = sum(len(m["content"].encode()) for m in first)
    assert len(ida) == prompt_size("chat", a, bpt)[0] == max(1, math.ceil(nbytes / bpt) + 3 * len(first))
    assert len(idb) == prompt_size("chat", b, bpt)[0]
    if bpt < 1.0:  # tokens.py: the prefix rule holds for bpt >= 1 (the last ID may differ)
        assert idb[: len(ida) - 1] == ida[:-1]
        return
    assert idb[: len(ida)] == ida
    cache = PrefixCache(1 << 20, 4)
    cache.insert(ida)
    assert cache.lookup(idb) >= len(ida) // 4 * 4


def test_tokens_of_a_shared_text_prefix() -> None:
    """Completions with a common start share the IDs of the whole pieces before they differ."""
    x = prompt_token_ids("completions", {"prompt": "The narwhal is a whale. " * 4 + "It lives in the Arctic."}, 4.0)
    y = prompt_token_ids("completions", {"prompt": "The narwhal is a whale. " * 4 + "Its tusk is a tooth."}, 4.0)
    assert x[:24] == y[:24] and x[25:] != y[25:]


# --- KV event encoding -------------------------------------------------------------------


def test_kv_event_batch_layout() -> None:
    """vLLM's msgspec layout: the batch [ts, events, dp_rank]; events positional, tag first
    ("array") or tagged maps ("map")."""
    h1, h2 = block_hash(None, [1, 2]), block_hash(block_hash(None, [1, 2]), [3, 4])
    events: list[CacheEvent] = [BlockRemoved((h2,)), BlockStored((h1, h2), None, (1, 2, 3, 4), 2), AllBlocksCleared()]
    assert msgpack.unpackb(encode_batch(events, ts=1.5)) == [1.5, [
        ["BlockRemoved", [h2], "GPU"],
        ["BlockStored", [h1, h2], None, [1, 2, 3, 4], 2, None, "GPU", None],
        ["AllBlocksCleared"],
    ], 0]  # fmt: skip
    assert msgpack.unpackb(encode_batch(events, ts=1.5, fmt="map", data_parallel_rank=None)) == [1.5, [
        {"type": "BlockRemoved", "block_hashes": [h2], "medium": "GPU", "group_idx": 0},
        {"type": "BlockStored", "block_hashes": [h1, h2], "parent_block_hash": None, "token_ids": [1, 2, 3, 4], "block_size": 2,
         "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None], "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {"type": "AllBlocksCleared"},
    ]]  # fmt: skip
    for fmt in ("array", "map"):
        assert decode_batch(encode_batch(events, ts=2.0, fmt=fmt)) == (2.0, events, 0)
    # shorter (older vLLM: no lora_name, no medium) and longer arrays decode too
    old = msgpack.packb([3.0, [["BlockStored", [h1], None, [1, 2], 2, None], ["BlockRemoved", [h1]], ["BlockStored", [h1], None, [1, 2], 2, None, "GPU", None, [None], 0]]])
    assert decode_batch(old) == (3.0, [BlockStored((h1,), None, (1, 2), 2), BlockRemoved((h1,)), BlockStored((h1,), None, (1, 2), 2)], None)
    assert struct.unpack(">d", encode_batch([], ts=0.25)[2:10]) == (0.25,)  # ts is a float64, as msgspec writes it
