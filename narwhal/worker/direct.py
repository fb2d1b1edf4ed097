"""serving.relay_path direct: the relay step run from the engine connection's callback.

With `asgi`, every engine read wakes the request's task, which feeds the relay and awaits
the client's send: two task switches and an ASGI send per event. With `direct`, the
request's task parks in `Upstream.direct(feed.take)` and each engine read is fed here,
inside the upstream protocol's `data_received`:

  * the relay step is the same `StreamRelay.feed` (parse, T01-T12 checks, strips, E02
    bounds, assembly): nothing is skipped, only where it runs changes;
  * a step that needs nothing but its bytes written (no failure, not the end, not the
    first token) is written with the sink's `write_now` (HTTP/1.1 under hypercorn: straight
    to the client's transport), or for a non-streaming client just assembled;
  * anything else -- a failure, the end, the first token, an engine error event, a write
    the sink declines (the client's connection has 64 KiB waiting: the ASGI path's drain
    then waits, and serving.send_stall_ms applies) -- is kept as `pending` and the task
    wakes and handles that step exactly as it handles one it fed itself.

Order is kept: after a hand-over, later reads queue on the connection until the task
arms direct delivery again. Invariant: a step is handled once, by the callback or by the
task, never both.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.relay import Step, StreamRelay

__all__ = ["DirectFeed"]


class DirectFeed:
    """One decode leg's callback-side relay. `pending`: the step (and its time) the task
    must handle before it reads on."""

    __slots__ = ("_feed", "_now", "_write", "pending")

    def __init__(self, relay: StreamRelay, now: Callable[[], float], write_now: Callable[[bytes], bool] | None) -> None:
        self._feed = relay.feed
        self._now = now
        self._write = write_now  # None: a non-streaming client (nothing is written per event)
        self.pending: tuple[Step, float] | None = None

    def take(self, data: bytes) -> bool:
        """Feed one engine read; True when it was handled whole here."""
        now = self._now()
        step = self._feed(data, now)
        if step.failure is None and not step.done and not step.first_token:
            w = self._write
            if w is None or not step.out or w(step.out):
                return True
        self.pending = (step, now)
        return False
