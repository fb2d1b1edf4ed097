"""Mock engines whose requests' headers are recorded (traceparent), for the telemetry tests."""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Iterator
from typing import Any

from narwhal.mock import MockConfig, RunningMock, Timing, create_mock_app, serve_in_thread

__all__ = ["Recorded", "recorded_fleet", "FAST"]

FAST = Timing(prefill_base_ms=1.0, prefill_per_token_ms=0.005, prefill_quadratic_ms=0.0, tpot_base_ms=1.0, tpot_per_seq_ms=0.0)


class Recorded:
    """An engine's ASGI app that keeps (path, traceparent, x-request-id) of every POST."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.seen: list[tuple[str, str | None, str | None]] = []
        self.states: dict[str, str | None] = {}  # x-request-id -> tracestate

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            h = dict(scope["headers"])
            tp, rid = h.get(b"traceparent"), h.get(b"x-request-id")
            self.seen.append((scope["path"], tp.decode() if tp else None, rid.decode() if rid else None))
            ts = h.get(b"tracestate")
            self.states[rid.decode() if rid else ""] = ts.decode() if ts else None
        await self.app(scope, receive, send)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.app, name)


def _sock() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen(256)
    return s


@contextlib.contextmanager
def recorded_fleet(roles: list[tuple[str, str]]) -> Iterator[tuple[list[RunningMock], dict[str, Recorded]]]:
    """(name, role) engines of the vllm dialect on free loopback ports, their requests' headers recorded."""
    socks = [_sock() for _ in roles]
    mocks: list[RunningMock] = []
    rec: dict[str, Recorded] = {}
    for (name, role), s in zip(roles, socks, strict=True):
        port = s.getsockname()[1]
        cfg = dataclasses.replace(MockConfig(dialect="vllm", role=role, name=name, timing=FAST), port=port)
        app = create_mock_app(cfg)
        mocks.append(RunningMock(cfg, "127.0.0.1", port, app))
        rec[name] = Recorded(app)
    with serve_in_thread(lambda: [rec[n] for n, _ in roles], socks):
        yield mocks, rec
