"""The split's per-request work without the event loop's wake-ups and system calls
(issue 13; `narwhal bench split` measures the rest): one request cycle through the
authority's side of the channel (`WorkerSession` fed the worker's frames, its answers
encoded into a transport that keeps nothing), the worker's frames encoded and its
answers decoded, and the same cycle through the in-process door.

A cycle is what a streamed request on a unified engine sends: Arrive, Admit, then
FirstToken + Close + End (one write: they leave in the same loop turn); the authority
answers Arrived and Admitted. extra_info["requests_per_round"] = 1.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import MISSING, fields
from typing import Any

import pytest

from narwhal import ipc
from narwhal.authority.channel import WorkerSession
from narwhal.authority.control import ControlPlane
from narwhal.authority.service import LocalControls
from narwhal.config import parse_config
from narwhal.core.lease import Order, Outcome
from narwhal.upstream.engines import config_engines


class _Sink:
    """A transport that keeps nothing (the authority's writes)."""

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass

    def abort(self) -> None:
        pass


def _controls(mode: str, engines: int = 4) -> LocalControls:
    cfg = parse_config({
        "admission": {"mode": mode, "http_retention_limit": 1_000_000, "queue_limit": 1_000_000, "phase_concurrency": {"prefill": 100_000, "decode": 100_000}},
        "monitoring": {"stale_after_ms": 1_000_000_000},
        "engines": [{"name": f"u{i}", "url": f"http://127.0.0.1:{9 + i}", "role": "unified", "dialect": "vllm"} for i in range(engines)],
    })
    return LocalControls(ControlPlane(cfg, config_engines(cfg)))


def _msg(cls: type[Any], **kw: Any) -> Any:
    """A message with the given fields; any other field of this version of ipc.py (a
    field added since) empty: [] for the prefix lists, else None."""
    return cls(**{f.name: kw.get(f.name, [] if "prefix" in f.name else (None if f.default is MISSING else f.default)) for f in fields(cls)})


def _frames(rid: int, at: float) -> tuple[bytes, bytes, bytes]:
    return (
        ipc.encode(ipc.Arrive(rid, at)),
        ipc.encode(_msg(ipc.Admit, rid=rid, route="chat", prompt_bytes=256, max_tokens=16, budget_ms=2000.0, arrival=at)),
        ipc.encode(ipc.FirstToken(rid, at))
        + ipc.encode(_msg(ipc.Close, rid=rid, at=at, ok_engine="u0", tpot_s=0.010, tpot_engine="u0", output_tokens=16, finish_reason="length", reported_prompt_tokens=64))
        + ipc.encode(ipc.End(rid, "completed")),
    )


@pytest.fixture
def loop() -> Any:
    lp = asyncio.new_event_loop()
    asyncio.set_event_loop(lp)
    yield lp
    asyncio.set_event_loop(None)
    lp.close()


@pytest.mark.parametrize("mode", ["open", "predictive"])
def test_authority_side_one_request_cycle(benchmark: Any, loop: Any, mode: str) -> None:
    """Decode the worker's frames, decide (door.py, the scheduler, the books), learn at
    close, encode the answers: the authority's Python work per request."""
    controls = _controls(mode)
    s = WorkerSession(0, controls, on_up=lambda *a: None, on_penalise=lambda *a: None, on_lost=lambda *a: None)
    s.channel.connection_made(_Sink())  # type: ignore[arg-type]
    rid = iter(range(1, 1 << 62))
    recv = s.channel.data_received
    flush = s.channel._flush

    def cycle() -> None:
        a, b, c = _frames(next(rid), time.monotonic())
        recv(a)
        flush()
        recv(b)
        flush()
        recv(c)

    async def run() -> None:  # the channel schedules its writes on the running loop
        benchmark(cycle)

    loop.run_until_complete(run())
    assert controls.control.books.open == 0 and controls.control.books.double_ends == 0
    benchmark.extra_info["requests_per_round"] = 1


def test_worker_side_frames_one_request_cycle(benchmark: Any) -> None:
    """The worker's share of the channel's work: encode its five messages, decode the
    authority's two answers (without the futures and tasks of worker/remote.py)."""
    arrived = ipc.encode(ipc.Arrived(1, None))[4:]
    admitted = ipc.encode(_msg(ipc.Admitted, rid=1, prompt_tokens=64, projected_ttft_ms=23.2, engine="u0", phase="unified"))[4:]

    def cycle() -> None:
        at = time.monotonic()
        _frames(1, at)
        ipc.decode(arrived)
        ipc.decode(admitted)

    benchmark(cycle)
    benchmark.extra_info["requests_per_round"] = 1


@pytest.mark.parametrize("mode", ["open", "predictive"])
def test_in_process_door_one_request_cycle(benchmark: Any, mode: str) -> None:
    """The same cycle through the in-process door (serving.workers 1): arrive, admit,
    first token, close with a full outcome, end."""
    controls = _controls(mode)
    door = controls.door

    def cycle() -> None:
        at = time.monotonic()
        entry = door.arrive_now(at)
        lease = entry.admit_now(Order("chat", 256, None, 16, 2000.0, at, None))  # type: ignore[union-attr]
        lease.first_token(time.monotonic())  # type: ignore[union-attr]
        lease.close(Outcome(at=time.monotonic(), ok_engine="u0", tpot_s=0.010, tpot_engine="u0", output_tokens=16, finish_reason="length",  # type: ignore[union-attr]
                            reported_prompt_tokens=64))
        entry.end("completed")  # type: ignore[union-attr]

    benchmark(cycle)
    assert controls.control.books.open == 0
    benchmark.extra_info["requests_per_round"] = 1
