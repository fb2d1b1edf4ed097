"""An engine's own KV-cache events (vLLM `--kv-events-config` with the zmq publisher;
engines[].kv_events: tcp://host:port), feeding that engine's prefix index exactly
(admission.prediction.prefix_cache events or auto; core/prefix.py).

Wire (vLLM's kv_events_subscriber example): a ZMQ PUB; each message is multipart
[topic, sequence (8-byte big-endian), payload]; the payload is msgpack of a KVEventBatch
encoded array-like: [ts, events, data_parallel_rank?], each event an array whose first
item is its tag:
  ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id?, medium?, lora_name?]
  ["BlockRemoved", block_hashes, medium?]
  ["AllBlocksCleared"]
Trailing fields at their defaults may be omitted (msgspec omit_defaults), later versions
add fields at the end; vLLM since its PR 42892 sends each event as a map with the tag
under "type" (both are read).

The router keys a block by the chain of token IDs (core/prefix.py token_keys), the same
function the data plane applies to a prompt's token IDs (in the block size the events
carry: the first event of another size than engines[].kv_block_size resets the index
and tells the data planes), and keeps the engine's block
hashes only to apply removals: `_ours` maps an engine hash to our key, bounded with the
index. A stored block whose parent the router never saw (it subscribed late, or lost
messages: a sequence gap) cannot be keyed and is skipped: the index under-estimates,
never over-estimates. Malformed payloads are counted and dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ..core.prefix import PrefixIndex, token_keys

__all__ = ["EventFeed", "subscribe"]

log = logging.getLogger("narwhal")

MAX_PAYLOAD_BYTES = 16 << 20  # one event batch at most


class EventFeed:
    """Apply an engine's event batches to its index (sans-IO: `apply(payload)`)."""

    def __init__(self, name: str, index: PrefixIndex, block_size: int, on_block_size: Any = None) -> None:
        self.name = name
        self.index = index
        self.block_size = block_size
        # the engine's own block size wins over engines[].kv_block_size (vLLM on CPU
        # defaults to 128, on GPU to 16): told once, before its first block is applied
        self.on_block_size = on_block_size
        self._ours: dict[Any, int] = {}  # the engine's block hash -> our key
        self._theirs: dict[int, Any] = {}  # and back, to forget what the index evicts
        self.batches = 0
        self.malformed = 0
        self.skipped = 0  # stored blocks whose parent is unknown
        self.last_seq: int | None = None
        self.gaps = 0

    def apply_message(self, frames: list[bytes]) -> None:
        if len(frames) >= 3:
            seq = int.from_bytes(frames[-2][:8], "big") if len(frames[-2]) == 8 else None
            if seq is not None and self.last_seq is not None and seq != self.last_seq + 1:
                self.gaps += 1
            if seq is not None:
                self.last_seq = seq
        if frames and len(frames[-1]) <= MAX_PAYLOAD_BYTES:
            self.apply(frames[-1])
        else:
            self.malformed += 1

    def apply(self, payload: bytes) -> None:
        import msgpack

        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False)
            events = batch[1]
            for ev in events:
                self._event(ev)
            self.batches += 1
        except (ValueError, TypeError, IndexError, KeyError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            self.malformed += 1

    def _forget(self, evicted: list[int]) -> None:
        for k in evicted:
            h = self._theirs.pop(k, None)
            if h is not None:
                self._ours.pop(h, None)

    def _event(self, ev: Any) -> None:
        if isinstance(ev, dict):  # vLLM after its PR 42892: a map, the tag under "type"
            tag = ev.get("type")
            if tag == "BlockStored":
                ev = [tag, ev["block_hashes"], ev.get("parent_block_hash"), ev["token_ids"], ev.get("block_size", self.block_size)]
            elif tag == "BlockRemoved":
                ev = [tag, ev["block_hashes"]]
            else:
                ev = [tag]
        tag = ev[0]
        if tag == "BlockStored":
            hashes, parent, tokens = ev[1], ev[2], ev[3]
            size = ev[4] if len(ev) > 4 else self.block_size
            if size != self.block_size:
                if type(size) is not int or not 1 <= size <= 4096:
                    self.malformed += 1
                    return
                log.info("engine %s: its KV events use blocks of %d tokens (engines[].kv_block_size said %d): keyed so from now on", self.name, size, self.block_size)
                self.block_size = size
                self.index.clear()  # keys of the other block size can never match again
                self._ours.clear()
                self._theirs.clear()
                if self.on_block_size is not None:
                    self.on_block_size(size)
            if parent is None:
                pk = None
            else:
                pk = self._ours.get(_h(parent))
                if pk is None:
                    self.skipped += len(hashes)
                    return
            keys = token_keys(tokens, size, parent=pk)
            for h, k in zip(hashes, keys, strict=False):
                self._ours[_h(h)] = k
                self._theirs[k] = _h(h)
            self._forget(self.index.insert(keys))
        elif tag == "BlockRemoved":
            gone = [self._ours.pop(_h(h), None) for h in ev[1]]
            keys = [k for k in gone if k is not None]
            for k in keys:
                self._theirs.pop(k, None)
            self.index.remove(keys)
        elif tag == "AllBlocksCleared":
            self.index.clear()
            self._ours.clear()
            self._theirs.clear()
        else:
            self.malformed += 1

    def snapshot(self) -> dict[str, int]:
        return {"batches": self.batches, "malformed": self.malformed, "skipped_blocks": self.skipped, "sequence_gaps": self.gaps}


def _h(h: Any) -> Any:
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h


async def subscribe(feed: EventFeed, endpoint: str) -> None:
    """Follow `endpoint` until cancelled, reconnecting (ZMQ does) if the engine restarts."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.RCVHWM, 10000)  # a burst larger than this is dropped by ZMQ (a gap)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 1024)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    log.info("engine %s: following its KV events at %s", feed.name, endpoint)
    try:
        while True:
            frames = await sock.recv_multipart()
            feed.apply_message(frames)
    except asyncio.CancelledError:
        raise
    finally:
        with contextlib.suppress(Exception):
            sock.close(0)
