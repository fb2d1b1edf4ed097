"""`narwhal mock-engine` (also `python -m narwhal.mock`): one simulated engine.

    narwhal mock-engine --dialect vllm|sglang|openai --role prefill|decode|unified \
        --port N --model NAME [--host H] [--name NAME] [timing flags...] \
        [--prefix-cache-tokens N [--block-size 16] [--kv-events tcp://HOST:PORT]]

Timing flags default to the model in narwhal/mock/timing.py; every time is multiplied
by --time-scale.

Prefix cache (narwhal/mock/cache.py): --prefix-cache-tokens N keeps up to N tokens of
prompt KV in blocks of --block-size tokens (LRU); a prefill is charged only for its
uncached tokens and usage reports prompt_tokens_details.cached_tokens. --kv-events
(vllm dialect) binds a ZMQ PUB socket there and publishes vLLM's KV events
(BlockStored/BlockRemoved/AllBlocksCleared, narwhal/mock/kv_events.py); a port `*`
binds any free port (the engine prints the endpoint).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import signal
import sys
from typing import Any

from .app import MockEngine
from .config import DIALECTS, ROLES, MockConfig
from .scenarios import QUIRKS
from .timing import Timing

__all__ = ["add_arguments", "run", "config_from_args", "main"]

_T = Timing()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dialect", choices=DIALECTS, default="vllm", help="wire dialect (default vllm)")
    p.add_argument("--role", choices=ROLES, default="unified", help="engine role (default unified)")
    p.add_argument("--port", type=int, required=True, help="TCP port to listen on")
    p.add_argument("--model", default="narwhal-demo", help="the served model name (default narwhal-demo)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--name", help="engine name (default ROLE-PORT); faults with fault_engines match it")
    t = p.add_argument_group("timing (milliseconds, before --time-scale)")
    t.add_argument("--prefill-base-ms", type=float, default=_T.prefill_base_ms, help="a in T(n) = a + b*n + c*n^2")
    t.add_argument("--prefill-per-token-ms", type=float, default=_T.prefill_per_token_ms, help="b in T(n)")
    t.add_argument("--prefill-quadratic-ms", type=float, default=_T.prefill_quadratic_ms, help="c in T(n)")
    t.add_argument("--tpot-base-ms", type=float, default=_T.tpot_base_ms, help="d0 in tpot = d0 + d1*B")
    t.add_argument("--tpot-per-seq-ms", type=float, default=_T.tpot_per_seq_ms, help="d1 in tpot (B = sequences decoding)")
    t.add_argument("--transfer-base-ms", type=float, default=_T.transfer_base_ms, help="decode role: KV transfer base time")
    t.add_argument("--transfer-per-token-ms", type=float, default=_T.transfer_per_token_ms, help="decode role: KV transfer per prompt token")
    t.add_argument("--time-scale", type=float, default=1.0, help="multiplies every modelled time (default 1)")
    t.add_argument("--noise-sigma", type=float, default=0.0, help="lognormal noise sigma on every time (default 0)")
    t.add_argument("--seed", type=int, default=0, help="noise seed")
    o = p.add_argument_group("output")
    o.add_argument("--output-tokens", type=int, default=16, help="output length when a request does not say (default 16)")
    o.add_argument("--bytes-per-token", type=float, default=4.0, help="text prompt sizing (default 4.0)")
    o.add_argument("--stream-interval", type=int, default=1, help="server stream interval: tokens per event (default 1)")
    o.add_argument("--max-model-len", type=int, default=None, help="context window; longer requests get 400 (default none)")
    o.add_argument("--sequence-output", action="store_true", help="content answers as a function of the whole token sequence: a continuation from prompt + output token IDs equals the uninterrupted answer (stream migration tests)")
    o.add_argument("--sequence-eos-every", type=int, default=64, help="with --sequence-output: mean answer length without max_tokens (0: no EOS; default 64)")
    o.add_argument("--quirk", action="append", choices=sorted(QUIRKS), default=[], help="engine quirk for every request (repeatable)")
    c = p.add_argument_group("prefix cache")
    c.add_argument("--prefix-cache-tokens", type=int, default=0, help="prefix cache capacity in tokens (default 0: no cache)")
    c.add_argument("--block-size", type=int, default=16, help="prefix cache block size in tokens (default 16)")
    c.add_argument("--kv-events", metavar="ENDPOINT", help="vllm dialect: publish KV cache events on a ZMQ PUB socket bound here, e.g. tcp://127.0.0.1:5557")
    c.add_argument("--kv-events-topic", default="", help="the topic frame of every KV event message (default empty)")
    c.add_argument("--kv-events-format", choices=("array", "map"), default="array", help="KV event encoding: array (vLLM's positional events, default) or map (newer vLLM's named fields)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def config_from_args(args: argparse.Namespace) -> MockConfig:
    """The engine the command line describes: every field of Timing and MockConfig is the
    option of the same name, but `quirks` (from the repeatable `--quirk`) and
    `record_limit` (no option: its default)."""
    timing = Timing(**_options(Timing, args))
    return MockConfig(**_options(MockConfig, args, skip=("timing", "quirks", "record_limit")), timing=timing, quirks=frozenset(args.quirk))


def _options(cls: Any, args: argparse.Namespace, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The values of the options named as the dataclass `cls`'s fields (but `skip`)."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.name not in skip}


def _announce(app: MockEngine) -> None:
    if app.kv_events is not None:
        print(f"narwhal mock-engine {app.name}: KV events on {app.kv_events.endpoint} (topic {app.config.kv_events_topic!r}, {app.config.kv_events_format} format)", flush=True)


async def _main(cfg: MockConfig, host: str, port: int) -> None:
    from . import serve_mock

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await serve_mock(cfg, host, port, shutdown_trigger=stop.wait, on_app=_announce)


def run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
    except ValueError as e:
        print(f"narwhal mock-engine: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(
        f"narwhal mock-engine {cfg.engine_name()}: {cfg.dialect} {cfg.role} engine, model {cfg.model!r}, "
        f"on http://{args.host}:{args.port} (time scale {cfg.timing.time_scale})"
        + (f", prefix cache {cfg.prefix_cache_tokens} tokens in blocks of {cfg.block_size}" if cfg.prefix_cache_tokens else ""),
        flush=True,
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    try:
        asyncio.run(_main(cfg, args.host, args.port))
    except KeyboardInterrupt:
        pass
    except OSError as e:
        print(f"narwhal mock-engine: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m narwhal.mock", description="A simulated OpenAI-compatible LLM engine.")
    add_arguments(p)
    return run(p.parse_args(argv))
