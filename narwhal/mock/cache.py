"""A prefix cache model, as vLLM's automatic prefix caching keeps it (sans-IO).

    cache = PrefixCache(capacity_tokens=4096, block_size=16)
    cache.lookup(ids)          # tokens a prefill of `ids` finds cached (full blocks only)
    events = cache.insert(ids) # store its full blocks: [BlockRemoved..., BlockStored]
    cache.clear()              # [AllBlocksCleared()]

Rules
  * A block is `block_size` consecutive prompt tokens starting at a multiple of
    block_size; only full blocks are cached (a partial last block never is).
  * Block identity is a chained hash: block_hash(parent, tokens) = the unsigned 64-bit
    big-endian value of blake2b(parent as 8 bytes big-endian (0 for the first block) +
    each token ID as 8 bytes big-endian two's complement, digest_size=8). Equal hashes
    mean equal token prefixes, so a lookup walks the prompt's blocks from the first and
    stops at the first miss.
  * Capacity: capacity_tokens // block_size blocks (0: the cache is off and keeps
    nothing). Eviction is LRU over whole blocks, and a parent is always more recent than
    its children (an insert touches its blocks from the last to the first, as vLLM frees
    a request's blocks in reverse order), so the least recent block is always a leaf: a
    block is only useful with its whole prefix, and never outlives it.
  * insert never evicts a block of the prompt being inserted; when the prompt has more
    new blocks than can fit, only its first ones are stored.
  * Events (vLLM's KV events, see kv_events.py): insert returns one BlockRemoved per
    evicted block, in eviction order, then one BlockStored for the blocks it added
    (parent_block_hash: the block before the first added one, None at the start);
    a full hit returns no event. clear returns [AllBlocksCleared()].
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "PrefixCache",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "CacheEvent",
    "block_hash",
    "block_hashes",
    "DEFAULT_BLOCK_SIZE",
]

DEFAULT_BLOCK_SIZE = 16
_MASK64 = (1 << 64) - 1


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """The identity of a block: its tokens chained to its parent's hash (unsigned 64-bit)."""
    data = struct.pack(f">Q{len(token_ids)}Q", 0 if parent is None else parent & _MASK64, *(t & _MASK64 for t in token_ids))
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def block_hashes(token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE) -> list[int]:
    """The chained hashes of the full blocks of token_ids, first block first."""
    out: list[int] = []
    parent: int | None = None
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[i : i + block_size])
        out.append(parent)
    return out


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks added to the cache, each the child of the one before it."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from the cache."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """Every block left the cache."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class PrefixCache:
    """Cached blocks by hash, least recently used first."""

    __slots__ = ("block_size", "capacity_blocks", "_lru")

    def __init__(self, capacity_tokens: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        if block_size < 1 or capacity_tokens < 0:
            raise ValueError("block_size >= 1 and capacity_tokens >= 0")
        self.block_size = block_size
        self.capacity_blocks = capacity_tokens // block_size
        self._lru: OrderedDict[int, None] = OrderedDict()  # first = least recently used

    def __len__(self) -> int:
        """Blocks in the cache."""
        return len(self._lru)

    def __contains__(self, h: object) -> bool:
        return h in self._lru

    @property
    def capacity_tokens(self) -> int:
        return self.capacity_blocks * self.block_size

    def blocks(self) -> list[int]:
        """The cached block hashes, least recently used (next to evict) first."""
        return list(self._lru)

    def lookup(self, token_ids: Sequence[int]) -> int:
        """Tokens of token_ids found cached: the full blocks of its longest cached prefix.
        Pure (touches nothing): the insert after the prefill does that."""
        n = 0
        parent: int | None = None
        bs = self.block_size
        for i in range(0, len(token_ids) - bs + 1, bs):
            parent = block_hash(parent, token_ids[i : i + bs])
            if parent not in self._lru:
                break
            n += bs
        return n

    def insert(self, token_ids: Sequence[int]) -> list[CacheEvent]:
        """Store the full blocks of token_ids (touching those already cached); the events."""
        if self.capacity_blocks == 0:
            return []
        hashes = block_hashes(token_ids, self.block_size)
        hit = 0
        while hit < len(hashes) and hashes[hit] in self._lru:
            hit += 1
        # a chained hash that misses cannot have cached descendants in this prompt
        new = hashes[hit:]
        free = self.capacity_blocks - len(self._lru)
        evictable = len(self._lru) - hit
        new = new[: max(0, min(len(new), free + evictable))]
        for h in hashes[:hit]:
            self._lru.move_to_end(h)  # the prompt's hits: out of the eviction's way
        events: list[CacheEvent] = []
        for _ in range(len(new) - free):
            h, _v = self._lru.popitem(last=False)
            events.append(BlockRemoved((h,)))
        stored = hashes[:hit] + new
        for h in reversed(stored):  # the last block least recent: leaves go first
            self._lru[h] = None
            self._lru.move_to_end(h)
        if new:
            bs = self.block_size
            toks = tuple(token_ids[hit * bs : (hit + len(new)) * bs])
            events.append(BlockStored(tuple(new), hashes[hit - 1] if hit else None, toks, bs))
        return events

    def clear(self) -> list[CacheEvent]:
        """Drop every block."""
        self._lru.clear()
        return [AllBlocksCleared()]
