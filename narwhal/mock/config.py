"""One simulated engine's configuration (`MockConfig`): its dialect, role, model, timing,
prefix cache, KV events and output, checked when made."""

from __future__ import annotations

from dataclasses import dataclass, field

from .cache import DEFAULT_BLOCK_SIZE
from .kv_events import FORMATS as KV_EVENT_FORMATS
from .timing import Timing

__all__ = ["MockConfig", "DIALECTS", "ROLES"]

DIALECTS = ("vllm", "sglang", "openai")
ROLES = ("unified", "prefill", "decode")


@dataclass(frozen=True, slots=True)
class MockConfig:
    """One simulated engine. `name` defaults to f"{role}-{port}"."""

    dialect: str = "vllm"
    role: str = "unified"
    model: str = "narwhal-demo"
    name: str | None = None
    port: int | None = None  # set by serve_mock/running_mock; names the engine
    host: str = "127.0.0.1"  # advertised as kv_transfer_params.remote_host
    timing: Timing = field(default_factory=Timing)
    bytes_per_token: float = 4.0
    output_tokens: int = 16  # natural output length when a request does not say
    stream_interval: int = 1  # the server's interval; vLLM requests may only raise it
    max_model_len: int | None = None  # prompt + max_tokens above it -> 400 (None: no limit)
    quirks: frozenset[str] = frozenset()  # e.g. {"tgi_repeat_ids"} for every request
    record_limit: int = 1000
    block_size: int = DEFAULT_BLOCK_SIZE  # prefix cache block, in tokens
    prefix_cache_tokens: int = 0  # prefix cache capacity in tokens (0: no cache)
    kv_events: str | None = None  # vllm: ZMQ PUB endpoint to bind, e.g. tcp://127.0.0.1:5557 (port * = any)
    kv_events_topic: str = ""
    kv_events_format: str = "array"  # array (vLLM's positional events) | map (newer vLLM)
    # content answers as a function of the whole token sequence (scenarios.sequence_script):
    # a continuation from prompt + output IDs equals the uninterrupted answer (issue 24)
    sequence_output: bool = False
    sequence_eos_every: int = 64  # mean answer length of a sequence answer without max_tokens (0: no EOS)

    def __post_init__(self) -> None:
        if self.dialect not in DIALECTS:
            raise ValueError(f"dialect must be one of {DIALECTS}, not {self.dialect!r}")
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, not {self.role!r}")
        if self.stream_interval < 1 or self.output_tokens < 0 or self.bytes_per_token <= 0:
            raise ValueError("stream_interval >= 1, output_tokens >= 0, bytes_per_token > 0")
        if self.sequence_eos_every < 0:
            raise ValueError("sequence_eos_every >= 0")
        if self.block_size < 1 or self.prefix_cache_tokens < 0:
            raise ValueError("block_size >= 1, prefix_cache_tokens >= 0")
        if self.kv_events is not None:
            if self.dialect != "vllm":
                raise ValueError("kv_events: only the vllm dialect publishes KV events")
            if self.prefix_cache_tokens <= 0:
                raise ValueError("kv_events needs the prefix cache (prefix_cache_tokens > 0)")
        if self.kv_events_format not in KV_EVENT_FORMATS:
            raise ValueError(f"kv_events_format must be one of {KV_EVENT_FORMATS}, not {self.kv_events_format!r}")

    def engine_name(self, port: int | None = None) -> str:
        return self.name or f"{self.role}-{self.port if self.port is not None else port}"
