"""The mock engine's timing model and load state.

Rules
  * Prefill of a prompt of n tokens takes T(n) = a + b*n + c*n^2 ms, and prefills are
    served FCFS ONE AT A TIME per engine: a request's prefill starts when every earlier
    request's prefill has finished (the router's predictor models an FCFS prefill
    server; a mock that overlapped prefills would make it look wrong).
  * Each decode step takes tpot = d0 + d1*B ms, B = sequences decoding on this engine at
    that step (continuous batching).
  * A decode-role engine given KV by a prefill engine skips the prefill: it only waits
    the transfer time t0 + t1*n ms, concurrently with other requests.
  * `time_scale` multiplies every modelled time; `noise_sigma` > 0 multiplies each one by
    a lognormal factor exp(N(0, sigma)) from a seeded generator (deterministic per seed).
  * Prompt size: token-ID prompts count exactly; text counts ceil(utf8 bytes /
    bytes_per_token), plus 3 tokens per chat message. This is usage.prompt_tokens.
  * Cancellation frees the engine: a waiting or running prefill leaves the queue, a
    decoding sequence leaves the batch (both in `finally` blocks of the callers).
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass
from typing import Any

__all__ = ["Timing", "EngineLoad", "prompt_size", "CHAT_MESSAGE_TOKENS"]

CHAT_MESSAGE_TOKENS = 3  # chat-template overhead per message


@dataclass(frozen=True, slots=True)
class Timing:
    """Model parameters in milliseconds (before time_scale)."""

    prefill_base_ms: float = 4.0
    prefill_per_token_ms: float = 0.02
    prefill_quadratic_ms: float = 0.000002
    tpot_base_ms: float = 8.0
    tpot_per_seq_ms: float = 0.05
    transfer_base_ms: float = 1.0
    transfer_per_token_ms: float = 0.0005
    time_scale: float = 1.0
    noise_sigma: float = 0.0
    seed: int = 0

    def prefill_ms(self, n: int) -> float:
        """T(n), unscaled and noise-free."""
        return self.prefill_base_ms + self.prefill_per_token_ms * n + self.prefill_quadratic_ms * n * n

    def tpot_ms(self, batch: int) -> float:
        return self.tpot_base_ms + self.tpot_per_seq_ms * batch

    def transfer_ms(self, n: int) -> float:
        return self.transfer_base_ms + self.transfer_per_token_ms * n


class EngineLoad:
    """One engine's live state: the FCFS prefill server and the decode batch.

    Counters are plain ints touched only from the engine's event loop.
    """

    __slots__ = ("timing", "_rng", "_prefill_lock", "prefill_queue", "decoding", "prefills_done")

    def __init__(self, timing: Timing) -> None:
        self.timing = timing
        self._rng = random.Random(timing.seed)
        # asyncio.Lock is FIFO-fair: a new arrival queues behind existing waiters, and a
        # cancelled waiter leaves the queue. That is exactly the FCFS server we need.
        self._prefill_lock = asyncio.Lock()
        self.prefill_queue = 0  # waiting + in service
        self.decoding = 0  # B: sequences in the decode batch
        self.prefills_done = 0

    def _noise(self) -> float:
        s = self.timing.noise_sigma
        return self._rng.lognormvariate(0.0, s) if s > 0 else 1.0

    def scaled(self, ms: float) -> float:
        """Seconds for a modelled time: time_scale and noise applied."""
        return ms * self.timing.time_scale * self._noise() / 1000.0

    def tpot_s(self, override_ms: float | None = None) -> float:
        """Seconds for the next decode step at the current batch size."""
        if override_ms is not None:
            return override_ms / 1000.0
        return self.scaled(self.timing.tpot_ms(self.decoding))

    async def prefill(self, n: int, override_ms: float | None = None) -> None:
        """Wait for the prefill server (FCFS), then occupy it for T(n)."""
        self.prefill_queue += 1
        try:
            async with self._prefill_lock:
                seconds = override_ms / 1000.0 if override_ms is not None else self.scaled(self.timing.prefill_ms(n))
                if seconds > 0:
                    await asyncio.sleep(seconds)
                self.prefills_done += 1
        finally:
            self.prefill_queue -= 1

    async def transfer(self, n: int, override_ms: float | None = None) -> None:
        """A decode engine's KV transfer wait (not serialised)."""
        seconds = override_ms / 1000.0 if override_ms is not None else self.scaled(self.timing.transfer_ms(n))
        if seconds > 0:
            await asyncio.sleep(seconds)


def _text_bytes(route: str, body: dict[str, Any]) -> tuple[int, int]:
    """(UTF-8 bytes of the prompt text, chat messages)."""
    if route == "chat":
        msgs = body.get("messages") or []
        total = 0
        for m in msgs:
            if not isinstance(m, dict):
                continue
            c = m.get("content")
            if isinstance(c, str):
                total += len(c.encode())
            elif isinstance(c, list):
                total += sum(len(p["text"].encode()) for p in c if isinstance(p, dict) and isinstance(p.get("text"), str))
            for tc in m.get("tool_calls") or ():
                fn = tc.get("function") if isinstance(tc, dict) else None
                if isinstance(fn, dict):
                    total += len(str(fn.get("name") or "").encode()) + len(str(fn.get("arguments") or "").encode())
        return total, len(msgs)
    p = body.get("prompt")
    if isinstance(p, str):
        return len(p.encode()), 0
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        return len("\n".join(p).encode()), 0
    return 0, 0


def prompt_size(route: str, body: dict[str, Any], bytes_per_token: float) -> tuple[int, list[int] | None]:
    """(prompt tokens, the prompt's token IDs when the prompt was given as IDs)."""
    if route == "completions":
        p = body.get("prompt")
        if isinstance(p, list) and p and all(type(x) is int for x in p):
            return len(p), list(p)
        if isinstance(p, list) and p and all(isinstance(x, list) for x in p):
            ids = [x for sub in p for x in sub if type(x) is int]
            return len(ids), ids
    nbytes, messages = _text_bytes(route, body)
    n = math.ceil(nbytes / bytes_per_token) + CHAT_MESSAGE_TOKENS * messages
    return max(n, 1), None
