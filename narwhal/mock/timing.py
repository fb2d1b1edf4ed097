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
    bytes_per_token), plus 3 tokens per chat message. This is usage.prompt_tokens
    (tokens.py, which also gives the prompt's token IDs).
  * With a prefix cache, a prefill of n tokens of which c are cached takes T(n - c):
    c is looked up when the prefill starts, after the FCFS wait.
  * Cancellation frees the engine: a waiting or running prefill leaves the queue, a
    decoding sequence leaves the batch (both in `finally` blocks of the callers).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

from .tokens import CHAT_MESSAGE_TOKENS, prompt_size

__all__ = ["Timing", "EngineLoad", "prompt_size", "CHAT_MESSAGE_TOKENS"]


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

    async def prefill(self, n: int, override_ms: float | None = None, cached: Callable[[], int] | None = None) -> int:
        """Wait for the prefill server (FCFS), then occupy it for T(n - c): c = cached(),
        asked when this prefill starts (the prefix cache's hit, 0 without one). Returns c."""
        self.prefill_queue += 1
        try:
            async with self._prefill_lock:
                c = min(n, cached()) if cached is not None else 0
                seconds = override_ms / 1000.0 if override_ms is not None else self.scaled(self.timing.prefill_ms(n - c))
                if seconds > 0:
                    await asyncio.sleep(seconds)
                self.prefills_done += 1
                return c
        finally:
            self.prefill_queue -= 1

    async def transfer(self, n: int, override_ms: float | None = None) -> None:
        """A decode engine's KV transfer wait (not serialised)."""
        seconds = override_ms / 1000.0 if override_ms is not None else self.scaled(self.timing.transfer_ms(n))
        if seconds > 0:
            await asyncio.sleep(seconds)
