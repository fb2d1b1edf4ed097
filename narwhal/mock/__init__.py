"""Simulated OpenAI-compatible engines ("mock engines") for tests, conformance, benchmarks
and demos: vllm, sglang and openai wire dialects, prefill/decode/unified roles, a timing
model (FCFS prefill, batch-dependent decode) and fault injection selected per request
by the request body (`"mock": {...}` or a `[[mock {...}]]` directive in the prompt).

    with running_mock(MockConfig(dialect="vllm")) as m:
        httpx.post(m.url + "/v1/chat/completions", json={...})
        m.requests()  # what the engine received

Per-request options (all optional; unknown keys ignored, bad values -> 400):

    scenario      content | reasoning | tool_calls | function_call | refusal | empty
    tokens        natural output length (default: the engine's output_tokens, 16)
    logprobs      true: include logprobs (also on when the request asks for them)
    usage         true/false: force or suppress the final usage chunk
    fault         missing_token_ids | bool_token_ids | negative_token_ids | string_token_ids |
                  audio | annotations | custom_tool | tool_call_no_id | tool_call_no_name |
                  malformed_json | wrong_type | error_event | error_before | reject | drop |
                  stall | stall_before | no_finish_reason
    fault_after   output token index where a mid-stream fault happens (default 1)
    fault_engines engine names the fault applies on (default: all)
    prefill_ms, tpot_ms, stall_ms   wall-clock overrides (not multiplied by time_scale)
    quirks        ["tgi_repeat_ids"] (openai dialect: TGI's repeated tool-call id "0");
                  ["interrupts"] as an engine quirk (MockConfig.quirks): a request that
                  arrives cuts every answer streaming at that moment short, as
                  llama-cpp-python's server does by default

Engines that cache (MockConfig.prefix_cache_tokens > 0, block_size; cache.py): prompts
are tokenized deterministically (tokens.py: a shared text prefix gives shared token IDs,
and a conversation's next turn starts with the previous turn's IDs), a prefill is
charged T(uncached tokens), usage reports prompt_tokens_details.cached_tokens, and a
vllm engine with `kv_events="tcp://127.0.0.1:PORT"` publishes vLLM's KV events over
ZMQ (kv_events.py). /mock/stats has prompt_tokens, cached_tokens, prefill_ms and
prefix_cache {blocks, capacity, kv_events endpoint}.

Rules
  * `running_mock`/`running_fleet` bind their sockets (port 0) before yielding, so a
    client can connect at once; they serve from one background thread with its own
    event loop and stop within a bounded time on exit (open streams are cut).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import socket
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any

from .app import MockEngine, create_mock_app
from .cache import PrefixCache
from .config import DIALECTS, ROLES, MockConfig
from .kv_events import decode_batch
from .scenarios import EOS_ID, FAULTS, SCENARIOS, VOCAB, Behaviour, content_piece
from .timing import Timing
from .tokens import prompt_token_ids

__all__ = [
    "MockConfig",
    "Timing",
    "MockEngine",
    "RunningMock",
    "create_mock_app",
    "serve_mock",
    "running_mock",
    "running_fleet",
    "serve_apps",
    "serve_in_thread",
    "Behaviour",
    "DIALECTS",
    "ROLES",
    "SCENARIOS",
    "FAULTS",
    "VOCAB",
    "EOS_ID",
    "expected_content",
    "expected_token_ids",
    "PrefixCache",
    "prompt_token_ids",
    "decode_batch",
]

_STOP_TIMEOUT_S = 10.0


def expected_content(tokens: int) -> str:
    """The text of a plain content answer of `tokens` tokens ending on EOS (finish stop)."""
    return "".join(content_piece(i).text for i in range(max(0, tokens - 1)))


def expected_token_ids(tokens: int, *, stop: bool = True) -> list[int]:
    """The IDs of a plain content answer: `tokens` IDs, the last one EOS when `stop`."""
    if not stop:
        return [content_piece(i).token_id for i in range(tokens)]
    return [content_piece(i).token_id for i in range(max(0, tokens - 1))] + ([EOS_ID] if tokens else [])


def _hypercorn_config(bind: str, *, graceful_timeout: float) -> Any:
    from hypercorn.config import Config

    hc = Config()
    hc.bind = [bind]
    hc.accesslog = None
    hc.errorlog = logging.getLogger("narwhal.mock.server")  # not hypercorn's stderr default
    hc.graceful_timeout = graceful_timeout
    hc.backlog = 2048
    hc.keep_alive_max_requests = 1 << 30  # benchmarks reuse connections for a long time
    hc.keep_alive_timeout = 30
    return hc


def _bind_str(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def serve_mock(
    config: MockConfig,
    host: str,
    port: int,
    shutdown_trigger: Callable[[], Awaitable[Any]] | None = None,
    *,
    graceful_timeout: float = 2.0,
    on_app: Callable[[MockEngine], None] | None = None,
) -> None:
    """Serve one mock engine with hypercorn until shutdown_trigger resolves (default:
    SIGINT/SIGTERM, main thread only). on_app sees the engine before it serves."""
    from hypercorn.asyncio import serve

    cfg = dataclasses.replace(config, port=port, host=config.host if config.host != "127.0.0.1" else host)
    app = create_mock_app(cfg)
    if on_app is not None:
        on_app(app)
    hc = _hypercorn_config(_bind_str(host, port), graceful_timeout=graceful_timeout)
    try:
        await serve(app, hc, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
    finally:
        app.close()


@dataclasses.dataclass(frozen=True)
class RunningMock:
    """A mock engine serving from a background thread."""

    config: MockConfig
    host: str
    port: int
    app: MockEngine

    @property
    def url(self) -> str:
        h = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{h}:{self.port}"

    @property
    def name(self) -> str:
        return self.app.name

    def requests(self) -> list[dict[str, Any]]:
        """Recorded completion requests, oldest first: {route, path, x_request_id, body}."""
        return self.app.recorded()

    def clear_requests(self) -> None:
        self.app.records.clear()

    def stats(self) -> dict[str, Any]:
        return self.app.stats()


def _listening_socket(host: str) -> socket.socket:
    fam = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(fam, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.bind((host, 0))
    s.listen(2048)  # connections queue from now on, before hypercorn starts accepting
    return s


async def serve_apps(apps: Sequence[Any], socks: Sequence[socket.socket], stop: asyncio.Event, *, graceful_timeout: float = 0.5) -> None:
    """Serve each ASGI app on its listening socket (hypercorn takes the fd) until `stop`."""
    from hypercorn.asyncio import serve

    tasks = []
    for app, s in zip(apps, socks, strict=True):
        hc = _hypercorn_config(f"fd://{s.detach()}", graceful_timeout=graceful_timeout)
        tasks.append(asyncio.create_task(serve(app, hc, shutdown_trigger=stop.wait)))
    results = await asyncio.gather(*tasks, return_exceptions=True)
    errors = [r for r in results if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    if errors:
        raise errors[0]


@contextlib.contextmanager
def serve_in_thread(make_apps: Callable[[], Sequence[Any]], socks: Sequence[socket.socket], *, name: str = "narwhal-mock-fleet") -> Iterator[None]:
    """Serve apps on listening sockets from one background thread with its own event loop.

    make_apps runs inside that loop (for apps holding loop-bound objects). The sockets
    listen already, so clients can connect as soon as this yields; on exit serving stops
    within a bounded time (open streams are cut). A serving failure raises RuntimeError."""
    loop = asyncio.new_event_loop()
    stop: asyncio.Event | None = None
    started = threading.Event()
    failure: list[BaseException] = []

    async def main() -> None:
        nonlocal stop
        stop = asyncio.Event()
        apps = make_apps()
        started.set()
        await serve_apps(apps, socks, stop)

    def run() -> None:
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(main())
        except BaseException as e:  # reported to the caller
            failure.append(e)
        finally:
            with contextlib.suppress(Exception):
                _cancel_all(loop)
            loop.close()
            started.set()

    t = threading.Thread(target=run, name=name, daemon=True)
    t.start()
    started.wait(_STOP_TIMEOUT_S)
    try:
        yield
    finally:
        if stop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(stop.set)
        t.join(_STOP_TIMEOUT_S)
        for s in socks:
            with contextlib.suppress(OSError):
                s.close()
    if t.is_alive():  # pragma: no cover
        raise RuntimeError("mock engines did not stop within the timeout")
    if failure:
        raise RuntimeError(f"mock engine failed: {failure[0]!r}") from failure[0]


@contextlib.contextmanager
def running_fleet(configs: Sequence[MockConfig], host: str = "127.0.0.1") -> Iterator[list[RunningMock]]:
    """Run several mock engines on free ports in one background event loop."""
    socks = [_listening_socket(host) for _ in configs]
    mocks = []
    for c, s in zip(configs, socks, strict=True):
        port = s.getsockname()[1]
        cfg = dataclasses.replace(c, port=port, host=c.host if c.host != "127.0.0.1" else host)
        mocks.append(RunningMock(cfg, host, port, create_mock_app(cfg)))
    with serve_in_thread(lambda: [m.app for m in mocks], socks):
        yield mocks


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.wait(pending, timeout=2.0))
    loop.run_until_complete(loop.shutdown_asyncgens())


@contextlib.contextmanager
def running_mock(config: MockConfig, host: str = "127.0.0.1") -> Iterator[RunningMock]:
    """Run one mock engine on a free port in a background thread; stops on exit."""
    with running_fleet([config], host) as (m,):
        yield m
