"""KV cache events on the wire, as vLLM publishes them (--kv-events-config).

Rules
  * Transport: a ZMQ PUB socket the engine binds at start; each message is multipart
    [topic (b"" unless configured), seq (8-byte big-endian, from 0, +1 per message),
    payload]. No replay socket.
  * Payload: msgpack of a KVEventBatch, which vLLM encodes with msgspec as a positional
    array [ts (float, unix seconds), events (list), data_parallel_rank (int; a real
    engine sends 0)]. A subscriber must also accept [ts, events] (omit_defaults drops a
    None rank).
  * Events, format "array" (vLLM up to its PR 42892; msgspec array_like + tag: the tag,
    the class name, first, then the fields in order; trailing fields that equal their
    defaults are left out, so a subscriber must accept shorter and longer arrays):
        ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
         lora_id, medium, lora_name]
        ["BlockRemoved", block_hashes, medium]
        ["AllBlocksCleared"]
  * Events, format "map" (newer vLLM: tagged maps, the tag under "type"):
        {"type": "BlockStored", "block_hashes", "parent_block_hash", "token_ids",
         "block_size", "lora_id", "medium", "lora_name", "extra_keys", "group_idx",
         "kv_cache_spec_kind"}
        {"type": "BlockRemoved", "block_hashes", "medium", "group_idx"}
        {"type": "AllBlocksCleared"}
  * Values: block hashes are unsigned 64-bit ints (cache.block_hash), medium "GPU",
    lora_id and lora_name None, group_idx 0, kv_cache_spec_kind "full_attention".
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]

from .cache import AllBlocksCleared, BlockRemoved, BlockStored, CacheEvent

__all__ = ["FORMATS", "MEDIUM", "encode_event", "encode_batch", "decode_batch", "KvEventPublisher"]

FORMATS = ("array", "map")
MEDIUM = "GPU"


def encode_event(ev: CacheEvent, fmt: str = "array") -> list[Any] | dict[str, Any]:
    """One event as vLLM's msgspec encoder lays it out (before msgpack)."""
    if isinstance(ev, BlockStored):
        if fmt == "array":
            return ["BlockStored", list(ev.block_hashes), ev.parent_block_hash, list(ev.token_ids), ev.block_size, None, MEDIUM, None]
        return {
            "type": "BlockStored", "block_hashes": list(ev.block_hashes), "parent_block_hash": ev.parent_block_hash,
            "token_ids": list(ev.token_ids), "block_size": ev.block_size, "lora_id": None, "medium": MEDIUM,
            "lora_name": None, "extra_keys": [None] * len(ev.block_hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention",
        }  # fmt: skip
    if isinstance(ev, BlockRemoved):
        if fmt == "array":
            return ["BlockRemoved", list(ev.block_hashes), MEDIUM]
        return {"type": "BlockRemoved", "block_hashes": list(ev.block_hashes), "medium": MEDIUM, "group_idx": 0}
    assert isinstance(ev, AllBlocksCleared)
    return ["AllBlocksCleared"] if fmt == "array" else {"type": "AllBlocksCleared"}


def encode_batch(events: Sequence[CacheEvent], *, fmt: str = "array", ts: float | None = None, data_parallel_rank: int | None = 0) -> bytes:
    """The msgpack payload of one KVEventBatch."""
    batch: list[Any] = [time.time() if ts is None else ts, [encode_event(e, fmt) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    out: bytes = msgpack.packb(batch, use_bin_type=True)
    return out


def _field(ev: list[Any], i: int) -> Any:
    return ev[i] if len(ev) > i else None


def decode_batch(payload: bytes) -> tuple[float, list[CacheEvent], int | None]:
    """A KVEventBatch payload in either format: (ts, events, data_parallel_rank).
    What a subscriber does (tests use it); unknown event tags are skipped."""
    obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(obj, list) or len(obj) < 2 or not isinstance(obj[1], list):
        raise ValueError("not a KVEventBatch")
    out: list[CacheEvent] = []
    hashes: Any
    toks: Any
    size: Any
    for raw in obj[1]:
        if isinstance(raw, dict):
            tag = raw.get("type")
            hashes, parent, toks, size = raw.get("block_hashes"), raw.get("parent_block_hash"), raw.get("token_ids"), raw.get("block_size")
        elif isinstance(raw, list) and raw:
            tag = raw[0]
            hashes, parent, toks, size = _field(raw, 1), _field(raw, 2), _field(raw, 3), _field(raw, 4)
        else:
            raise ValueError(f"not an event: {raw!r}")
        if tag == "BlockStored":
            out.append(BlockStored(tuple(hashes), parent, tuple(toks), int(size)))
        elif tag == "BlockRemoved":
            out.append(BlockRemoved(tuple(hashes)))
        elif tag == "AllBlocksCleared":
            out.append(AllBlocksCleared())
    return float(obj[0]), out, obj[2] if len(obj) > 2 else None


class KvEventPublisher:
    """The engine's PUB socket: bound at construction, one message per batch."""

    def __init__(self, endpoint: str, *, topic: str = "", fmt: str = "array") -> None:
        import zmq

        if fmt not in FORMATS:
            raise ValueError(f"kv events format must be one of {FORMATS}, not {fmt!r}")
        self.fmt = fmt
        self.topic = topic.encode()
        self.seq = 0
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 100_000)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(linger=0)
            raise OSError(f"kv events: cannot bind {endpoint}: {e}") from e
        # tcp://HOST:* binds a free port: LAST_ENDPOINT names the real one
        self.endpoint: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: Sequence[CacheEvent]) -> None:
        """Send one batch (nothing for no events). A PUB socket never blocks: a slow
        subscriber loses messages past the high-water mark, as with vLLM."""
        if not events or self._sock.closed:
            return
        payload = encode_batch(events, fmt=self.fmt)
        self._sock.send_multipart((self.topic, self.seq.to_bytes(8, "big"), payload), copy=True)
        self.seq += 1

    def close(self) -> None:
        if not self._sock.closed:
            self._sock.close(linger=0)
