"""authority/kvevents.py: vLLM KV-event batches (msgpack, array-like, tagged) applied to
an engine's prefix index, keyed like the data plane keys a prompt's token IDs."""

from __future__ import annotations

import msgpack
import pytest

from narwhal.authority.kvevents import EventFeed
from narwhal.core.prefix import PrefixIndex, token_keys

B = 16
PROMPT = list(range(1000, 1000 + 5 * B + 7))  # 5 full blocks and a partial one


def batch(*events: list) -> bytes:
    return msgpack.packb([1733.5, list(events)])


def stored(hashes: list[int], parent: int | None, tokens: list[int], *, tail: bool = True) -> list:
    ev = ["BlockStored", hashes, parent, tokens, B]
    return [*ev, None, None] if tail else ev  # lora_id, medium: omitted at their defaults (omit_defaults)


def feed() -> EventFeed:
    return EventFeed("u0", PrefixIndex(1000, token=True, block_tokens=B), B)


def test_stored_blocks_match_the_prompts_token_keys() -> None:
    f = feed()
    f.apply(batch(stored([11, 12, 13], None, PROMPT[: 3 * B])))
    keys = token_keys(PROMPT, B)
    assert f.index.match(keys) == 3
    # the next batch continues the chain from its parent's engine hash
    f.apply(batch(stored([14, 15], 13, PROMPT[3 * B: 5 * B], tail=False)))
    assert f.index.match(keys) == 5
    assert f.batches == 2 and f.malformed == 0


def test_removed_and_cleared() -> None:
    f = feed()
    f.apply(batch(stored([11, 12, 13, 14, 15], None, PROMPT[: 5 * B])))
    f.apply(batch(["BlockRemoved", [15, 14], None]))
    assert f.index.match(token_keys(PROMPT, B)) == 3
    f.apply(batch(["AllBlocksCleared"]))
    assert len(f.index) == 0 and f.index.match(token_keys(PROMPT, B)) == 0


def test_a_block_whose_parent_was_never_seen_is_skipped_not_guessed() -> None:
    f = feed()
    f.apply(batch(stored([14, 15], 13, PROMPT[3 * B: 5 * B])))
    assert len(f.index) == 0 and f.skipped == 2


def test_bytes_hashes_are_keys_too() -> None:
    f = feed()
    f.apply(batch(stored([b"\x01" * 32, b"\x02" * 32], None, PROMPT[: 2 * B])))
    f.apply(batch(["BlockRemoved", [b"\x02" * 32]]))
    assert f.index.match(token_keys(PROMPT, B)) == 1


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"not": "a batch"}), msgpack.packb([1.0, [["Bogus", 1]]]), msgpack.packb([1.0])])
def test_malformed_payloads_are_counted_and_dropped(payload: bytes) -> None:
    f = feed()
    f.apply(payload)
    assert f.malformed == 1 and len(f.index) == 0


def test_the_engines_own_block_size_wins_and_is_told() -> None:
    told: list[int] = []
    f = EventFeed("u0", PrefixIndex(1000, token=True, block_tokens=B), B, on_block_size=told.append)
    f.apply(batch(stored([1], None, PROMPT[:B])))
    f.apply(batch(["BlockStored", [2, 3], None, PROMPT[:64], 32, None, None]))  # vLLM on CPU: 128
    assert told == [32] and f.block_size == 32
    assert f.index.match(token_keys(PROMPT, 32)) == 2 and len(f.index) == 2  # the 16-token keys are gone


def test_sequence_gaps_are_counted() -> None:
    f = feed()
    for seq in (1, 2, 4):
        f.apply_message([b"", seq.to_bytes(8, "big"), batch(["AllBlocksCleared"])])
    assert f.gaps == 1 and f.batches == 3


def test_the_index_evicting_forgets_the_engine_hashes_too() -> None:
    f = EventFeed("u0", PrefixIndex(3, token=True, block_tokens=B), B)
    f.apply(batch(stored([11, 12, 13, 14, 15], None, PROMPT[: 5 * B])))
    assert len(f.index) == 3 and len(f._ours) == 3


def test_the_map_layout_of_later_vllm_and_longer_arrays() -> None:
    f = feed()
    f.apply(msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None, "token_ids": PROMPT[: 2 * B],
                                  "block_size": B, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None], "group_idx": 0}], 0]))
    f.apply(msgpack.packb([1.0, [["BlockStored", [13], 12, PROMPT[2 * B: 3 * B], B, None, "GPU", None]], 0]))
    assert f.index.match(token_keys(PROMPT, B)) == 3
    f.apply(msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [13], "medium": "GPU"}]]))
    assert f.index.match(token_keys(PROMPT, B)) == 2 and f.malformed == 0
