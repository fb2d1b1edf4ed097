"""Workload sizing: how many prompt tokens a request carries.

Prompt tokens come from an exact counter when one is configured (serving.tokenizer),
else from an estimate that learns its bytes-per-token ratio from the prompt_tokens the
engines report (an EWMA over requests, docs/contract.md "Sizing"). Token-ID prompts are exact.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["PromptSizer"]


class PromptSizer:
    __slots__ = ("bytes_per_token", "alpha", "samples", "count_tokens")

    def __init__(self, *, bytes_per_token: float = 4.0, alpha: float = 0.05, count_tokens: Callable[[str], int] | None = None) -> None:
        self.bytes_per_token = bytes_per_token
        self.alpha = alpha
        self.samples = 0
        self.count_tokens = count_tokens

    def size(self, prompt_bytes: int, exact: int | None = None, text: str | None = None) -> int:
        if exact is not None:
            return exact
        if self.count_tokens is not None and text is not None:
            return self.count_tokens(text)
        return max(1, round(prompt_bytes / self.bytes_per_token))

    def learn(self, prompt_bytes: int, reported_prompt_tokens: int) -> None:
        """One engine-reported prompt length for a prompt of `prompt_bytes` bytes."""
        if prompt_bytes <= 0 or reported_prompt_tokens <= 0:
            return
        ratio = prompt_bytes / reported_prompt_tokens
        self.samples += 1
        a = max(self.alpha, 1.0 / self.samples)  # plain mean while samples are few
        self.bytes_per_token += a * (ratio - self.bytes_per_token)

    def snapshot(self) -> dict[str, object]:
        return {
            "method": "tokenizer" if self.count_tokens else "estimate",
            "bytes_per_token": round(self.bytes_per_token, 4),
            "samples": self.samples,
        }
