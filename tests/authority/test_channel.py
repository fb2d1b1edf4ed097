"""authority/channel.py without sockets: frames in, frames out, through the same door a
one-process router calls."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from narwhal import ipc
from narwhal.authority.channel import WorkerSession
from narwhal.authority.control import ControlPlane
from narwhal.authority.service import LocalControls
from narwhal.config import parse_config
from narwhal.upstream.engines import EngineSpec


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
