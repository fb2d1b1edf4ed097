"""What each engine holds in its prefix cache, as the router knows it (sans-IO).

A prompt is a chain of blocks; block i's key is a stable hash of block i's content and
block i-1's key, so equal keys mean equal prefixes (vLLM's block hashes work the same
way). Two ways to get the blocks (admission.prediction.prefix_cache):

  * approximate — the rendered prompt's bytes in APPROX_BLOCK_BYTES pieces (`text_keys`):
    what the router itself sent where. A block stands for APPROX_BLOCK_BYTES divided by
    the learned bytes per token.
  * events — the engine's own KV events (vLLM BlockStored/BlockRemoved, narwhal/authority
    /kvevents.py): blocks of the engine's block size over token IDs (`token_keys`).

`PrefixIndex` (one per engine) is an LRU set of block keys with a capacity in blocks.
Invariant (the prefix property): a key is present only with its whole chain before it.
Touching a chain touches it leaf first, root last, so eviction (least recent first)
takes leaves before their parents and `match` can binary-search the chain.

The capacity of an approximate index follows the engine's: it starts at `capacity` and
is corrected by what the engine reports (`cached_tokens` of prompt_tokens_details):
an engine that had less than the index expected evicted it, so the capacity shrinks to
what the index held then (x 0.9); an engine that had more than expected while the index
was full grows it (+ 1/8). Memory is bounded by `capacity` keys per engine and by the
fleet-wide MAX_BLOCKS.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

__all__ = ["PrefixIndex", "text_keys", "token_keys", "rendered", "APPROX_BLOCK_BYTES", "APPROX_BLOCK_TOKENS", "MAX_PROMPT_BLOCKS", "MAX_BLOCKS"]

APPROX_BLOCK_BYTES = 256  # ~64 tokens of English text
APPROX_BLOCK_TOKENS = 64  # what one approximate block is assumed to hold before the sizer has learned bytes per token
MAX_PROMPT_BLOCKS = 4096  # keys computed for one prompt at most (1 MiB of text at 256 bytes)
MAX_BLOCKS = 1 << 21  # keys held over all engines at most (~150 MiB)
_ROOT = b"narwhal-prefix"


def rendered(route: str, body: dict[str, object]) -> bytes:
    """The prompt as the approximate index sees it: chat messages in order (role, then
    the text of the content), or the completion prompt (text, or token IDs). A
    conversation's next turn renders as the previous turn's bytes plus its new messages,
    so it shares every full block of them."""
    if route == "chat":
        parts: list[bytes] = []
        for m in body.get("messages") or ():  # type: ignore[attr-defined]
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, list):
                c = "".join(p.get("text", "") for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
            parts.append(f"{m.get('role', '')}\x1f{c if isinstance(c, str) else ''}\x1e".encode())
        return b"".join(parts)
    p = body.get("prompt")
    if isinstance(p, str):
        return p.encode()
    if isinstance(p, list) and all(type(t) is int for t in p):
        return b"".join((t & 0xFFFFFFFF).to_bytes(4, "big") for t in p)
    return b""


def _chain(prev: bytes, block: bytes) -> bytes:
    return hashlib.blake2b(prev + block, digest_size=8).digest()


def text_keys(data: bytes, block_bytes: int = APPROX_BLOCK_BYTES) -> tuple[int, ...]:
    """The keys of the full blocks of `data` (a trailing partial block has none)."""
    out = []
    prev = _ROOT
    for i in range(min(len(data) // block_bytes, MAX_PROMPT_BLOCKS)):
        prev = _chain(prev, data[i * block_bytes:(i + 1) * block_bytes])
        out.append(int.from_bytes(prev, "big", signed=True))
    return tuple(out)


def token_keys(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> tuple[int, ...]:
    """The keys of the full blocks of `token_ids` (block_size tokens each), continuing
    the chain after `parent` (None: from the start)."""
    out = []
    prev = _ROOT if parent is None else parent.to_bytes(8, "big", signed=True)
    for i in range(min(len(token_ids) // block_size, MAX_PROMPT_BLOCKS)):
        block = b"".join(t.to_bytes(4, "big", signed=False) for t in token_ids[i * block_size:(i + 1) * block_size])
        prev = _chain(prev, block)
        out.append(int.from_bytes(prev, "big", signed=True))
    return tuple(out)


class PrefixIndex:
    __slots__ = ("capacity", "floor", "_keys", "adjustments", "trusted", "token", "block_tokens", "reports")

    def __init__(self, capacity: int, *, floor: int = 0, trusted: bool = True, token: bool = False, block_tokens: float | None = None) -> None:
        self.capacity = capacity  # blocks
        self.floor = floor  # the capacity never shrinks below this
        self._keys: OrderedDict[int, None] = OrderedDict()
        self.adjustments = 0  # capacity corrections from engine reports
        # projections use the index only once trusted: prefix_cache auto trusts an
        # approximate index when the engine first reports cached_tokens (it caches and
        # says so); an engine that never reports is projected at full length
        self.trusted = trusted
        # fed by the engine's KV events over token IDs (Work.token_prefix, `block_tokens`
        # tokens a block), else approximate (Work.prefix, Work.block_tokens)
        self.token = token
        self.block_tokens = block_tokens
        # the engine has reported cached_tokens at least once: from then on an answer
        # without it reports none cached (vLLM leaves a zero out)
        self.reports = False

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, keys: Sequence[int]) -> int:
        """How many leading blocks of `keys` are held (binary search: the prefix property)."""
        held = self._keys
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if keys[mid - 1] in held:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, keys: Sequence[int]) -> list[int]:
        """Hold the whole chain (the engine holds a prompt's blocks after its prefill),
        touched leaf first so the root is the most recent; returns the keys evicted."""
        held = self._keys
        for k in reversed(keys):
            if k in held:
                held.move_to_end(k)
            else:
                held[k] = None
        return self._evict()

    def _evict(self) -> list[int]:
        out = []
        held = self._keys
        while len(held) > self.capacity:
            out.append(held.popitem(last=False)[0])
        return out

    def remove(self, keys: Sequence[int]) -> None:
        for k in keys:
            self._keys.pop(k, None)

    def clear(self) -> None:
        self._keys.clear()

    def correct(self, expected_blocks: int, reported_blocks: int) -> None:
        """The engine reports `reported_blocks` cached where the index expected
        `expected_blocks`: follow its capacity (module docstring)."""
        if reported_blocks < expected_blocks:
            self.capacity = max(self.floor, min(self.capacity, int(len(self._keys) * 0.9)))
            self.adjustments += 1
            self._evict()
        elif reported_blocks > expected_blocks and len(self._keys) >= self.capacity:
            self.capacity += max(1, self.capacity // 8)
            self.adjustments += 1

    def snapshot(self) -> dict[str, int | bool | str]:
        return {"kind": "events" if self.token else "approximate", "blocks": len(self._keys), "capacity_blocks": self.capacity,
                "adjustments": self.adjustments, "trusted": self.trusted}
