"""authority/channel.py without sockets: frames in, frames out, through the same door a
one-process router calls."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import pytest

from narwhal import ipc
from narwhal.authority.channel import WorkerSession
from narwhal.authority.control import ControlPlane
from narwhal.authority.service import LocalControls
from narwhal.config import parse_config
from narwhal.core.clock import ManualClock
from narwhal.upstream.engines import EngineSpec
from narwhal_generated import errors as E


class _Transport:
    def __init__(self) -> None:
        self.out = bytearray()

    def write(self, data: bytes) -> None:
        self.out += data

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def _decode_all(buf: bytes) -> list[Any]:
    out, pos = [], 0
    while pos < len(buf):
        n = int.from_bytes(buf[pos:pos + 4], "big")
        out.append(ipc.decode(buf[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out


def _admit(rid: int, at: float) -> ipc.Admit:
    return ipc.Admit(rid, "chat", 40, None, 4, 60000.0, at, None, [], [])


def _replay(reads: list[list[Any]]) -> list[Any]:
    """One engine with one slot; each list of messages arrives in one read (no loop turn
    between reads); the frames the session sent back."""
    async def main() -> list[Any]:
        cfg = parse_config({"admission": {"mode": "open", "phase_concurrency": {"prefill": 1, "decode": 1}, "prediction": {"profile_on_start": False}}})
        control = ControlPlane(cfg, [EngineSpec("u0", "http://127.0.0.1:9", "unified", "vllm", None, None)])
        s = WorkerSession(0, LocalControls(control), on_up=lambda *a: None, on_penalise=lambda *a: None, on_lost=lambda *a: None)
        t = _Transport()
        s.channel.connection_made(t)  # type: ignore[arg-type]
        for read in reads:
            s.channel.data_received(b"".join(ipc.encode(m) for m in read))
        for _ in range(5):
            await asyncio.sleep(0)
        await control.client.aclose()
        return _decode_all(bytes(t.out))

    return asyncio.run(main())


def _close(rid: int, at: float) -> list[Any]:
    return [ipc.Close(rid, at, "u0", None, None, None, None, 4, "length", None, None), ipc.End(rid, "completed")]


def _now() -> float:
    """The worker's reading of the system-wide monotonic clock (ipc.py), as the authority's
    own clock reads it: a fixed number would be stale health on a machine booted less than
    monitoring.stale_after_ms before it (R01 monitoring_degraded)."""
    return time.monotonic()


def test_a_grant_freed_in_the_next_read_reaches_the_queued_request() -> None:
    """Regression: the waiter of a queued request was registered a loop turn after its
    Admit; a Close freeing the slot before that turn granted nobody, and the request
    hung holding the slot (issue 13 benchmark, 2 workers)."""
    now = _now()
    got = _replay([[ipc.Arrive(1, now), ipc.Arrive(2, now), _admit(1, now), _admit(2, now)], _close(1, now)])
    admitted = {m.rid: m for m in got if isinstance(m, ipc.Admitted)}
    assert admitted[1].engine == "u0" and admitted[2].engine is None  # 2 queued behind 1
    assert any(isinstance(m, ipc.Granted) and m.rid == 2 for m in got), got


def test_a_grant_freed_in_the_same_read_reaches_the_queued_request() -> None:
    now = _now()
    got = _replay([[ipc.Arrive(1, now), ipc.Arrive(2, now), _admit(1, now)], [_admit(2, now), *_close(1, now)]])
    assert any(isinstance(m, ipc.Granted) and m.rid == 2 for m in got), got


def test_the_door_scores_a_decode_close_at_the_mean_batch_it_ran_at() -> None:
    """docs/prediction.md section 8 (B_k), tests/core/test_decode_batch.py: a request that decoded
    alone for 0.95 s while three others joined only for its last 0.05 s; its TPOT is what
    the profile projects at the mean batch 1.15, so its residual is zero. The batch at its
    close (4) would have scored it at half the TPOT it projects there."""
    async def main() -> tuple[float, float]:
        cfg = parse_config({"admission": {"mode": "open", "phase_concurrency": {"prefill": 8, "decode": 8}, "prediction": {"profile_on_start": False}}})
        t0 = _now()
        clock = ManualClock(t0)  # the authority's: each dispatch at its request's arrival
        control = ControlPlane(cfg, [EngineSpec("u0", "http://127.0.0.1:9", "unified", "vllm", None, None)], clock=clock)
        s = WorkerSession(0, LocalControls(control), on_up=lambda *a: None, on_penalise=lambda *a: None, on_lost=lambda *a: None)
        s.channel.connection_made(_Transport())  # type: ignore[arg-type]
        e = control.engines["u0"]
        e.decode.lin.theta = [4.0, 3.0]  # TPOT 4 + 3 B ms (the conformance fleet's)

        def send(*ms: object) -> None:
            s.channel.data_received(b"".join(ipc.encode(m) for m in ms))  # type: ignore[arg-type]

        def admit(rid: int, at: float) -> None:
            clock.t = at
            send(ipc.Arrive(rid, at), ipc.Admit(rid, "chat", 40, None, 4, 60000.0, at, None, [], []), ipc.FirstToken(rid, at, False))

        admit(1, t0)
        for rid in (2, 3, 4):
            admit(rid, t0 + 0.95)
        tpot_ms = e.decode.predict_ms(1.15)
        send(ipc.Close(1, t0 + 1.0, "u0", None, None, tpot_ms / 1000.0, "u0", 4, "length", None, None), ipc.End(1, "completed"))
        for _ in range(5):
            await asyncio.sleep(0)
        await control.client.aclose()
        return e.decode.drift.mu, math.log(tpot_ms / e.decode.predict_ms(4))

    mu, old = asyncio.run(main())
    assert mu == pytest.approx(0.0, abs=1e-9)
    assert old < -0.3  # what the batch at the close made of the same measurement


def test_a_preemption_is_told_to_the_worker_holding_the_request_by_its_rid() -> None:
    """Fair preemption across processes (core/preempt.py): a request's FirstToken says
    its leg can be carried on; when a lighter tenant's request waits for its slot, the
    session tells its own worker ["preempt", rid]; the worker's cut comes back as a Retry
    that frees the slot for the waiter (Granted) and queues the preempted request again
    (no NoRetry: not a failure)."""
    async def main() -> list[Any]:
        cfg = parse_config({"admission": {"mode": "open", "phase_concurrency": {"prefill": 2, "decode": 2}, "prediction": {"profile_on_start": False}},
                            "upstream": {"migration": {"max_attempts": 1}}, "tenants": {"quiet": {"weight": 1}, "noisy": {"weight": 1}}})
        control = ControlPlane(cfg, [EngineSpec("u0", "http://127.0.0.1:9", "unified", "vllm", None, None)])
        s = WorkerSession(0, LocalControls(control), on_up=lambda *a: None, on_penalise=lambda *a: None, on_lost=lambda *a: None)
        t = _Transport()
        s.channel.connection_made(t)  # type: ignore[arg-type]
        now = _now()

        def send(*ms: Any) -> None:
            s.channel.data_received(b"".join(ipc.encode(m) for m in ms))

        def admit(rid: int, tenant: str) -> list[Any]:
            return [ipc.Arrive(rid, now, None, tenant), ipc.Admit(rid, "chat", 40, None, 4, 60000.0, now, None, [], [], tenant)]

        for rid, tenant in ((1, "quiet"), (2, "noisy"), (3, "noisy"), (4, "noisy")):  # noisy heaviest lately, quiet active
            send(*admit(rid, tenant), ipc.FirstToken(rid, now, False), *_close(rid, now))
        send(*admit(10, "noisy"), ipc.FirstToken(10, now, True), *admit(11, "quiet"), *admit(12, "quiet"))
        for _ in range(3):
            await asyncio.sleep(0)
        send(ipc.Retry(10, "u0", E.E06, "unified", now))
        for _ in range(5):
            await asyncio.sleep(0)
        await control.client.aclose()
        return _decode_all(bytes(t.out))

    got = asyncio.run(main())
    assert [m for m in got if isinstance(m, ipc.Facts) and m.facts[:1] == ["preempt"]] == [ipc.Facts("", ["preempt", 10])]
    assert any(isinstance(m, ipc.Granted) and m.rid == 12 for m in got), got
    assert not any(isinstance(m, ipc.NoRetry | ipc.Refused) and m.rid == 10 for m in got), got
