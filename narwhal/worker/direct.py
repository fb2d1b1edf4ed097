"""serving.relay_path direct: the relay step run from the engine connection's callback.

With `asgi`, every engine read wakes the request's task, which feeds the relay and awaits
the client's send: two task switches and an ASGI send per event. With `direct`, the
request's task parks in `Upstream.direct(feed)` and each engine read is fed here,
inside the upstream protocol's `data_received`:

  * the relay step is the same `StreamRelay.feed` (parse, T01-T12 checks, strips, E02
    bounds, assembly): nothing is skipped, only where it runs changes;
  * a step that needs nothing but its bytes written (no failure, not the end) is written
    with the sink's `write_now` (HTTP/1.1: H1Direct, straight to the client's
    transport), or for a non-streaming client just assembled;
  * before the client's head is out, output that is not yet a start (events before the
    first token) is held in the task's own buffer, and the step that starts the stream
    writes the head and everything held in one write (`start_now`), as the task's
    `_start` would send them;
  * a first token, once its bytes are out, has its books kept here (`first_token`, after
    the write: they are not on the client's time to first token);
  * anything else -- a failure, the end, an engine error event, a head or a write the
    sink declines (the client's connection has 64 KiB waiting: the ASGI path's drain then
    waits, and serving.send_stall_ms applies) -- is kept as `pending` and the task wakes
    and handles that step exactly as it handles one it fed itself (its bytes not held).

With the compiled step (`serving.relay_native`, core/fastevent.py) a read that is one
whole chunk of the engine's body is first offered to `whole`, before the connection
decodes its chunk: the step checks, strips and frames the common event of a started
stream in C, its bytes go out with the client connection's `write_chunk` (the same guards
as `write_now`), and only then are its books kept (`StreamRelay.count`). Anything the
step declines, or a write the connection declines, changed nothing and takes the path
above.

Order is kept: after a hand-over, later reads queue on the connection until the task
arms direct delivery again. Invariant: a step is handled once, by the callback or by the
task, never both.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.relay import Step, StreamRelay
from .replies import ChunkWriter, Sink

__all__ = ["DirectFeed"]


class DirectFeed:
    """One decode leg's callback-side relay. `pending`: the step (and its time) the task
    must handle before it reads on. `sink`: a streaming client's (its write_now and
    start_now set), None for a non-streaming one; `held`: the task's buffer of output
    before the head; `first_token(now)`: the first token's books."""

    __slots__ = ("_relay", "_now", "_sink", "_held", "_first", "pending", "_chunks")

    def __init__(
        self, relay: StreamRelay, now: Callable[[], float], sink: Sink | None, held: list[bytes], first_token: Callable[[float], None], *, native: bool = False,
    ) -> None:
        self._relay = relay
        self._now = now
        self._sink = sink
        self._held = held
        self._first = first_token
        self.pending: tuple[Step, float] | None = None
        # the compiled step's writer (an HTTP/1.1 client's connection), or None: no `whole`
        chunks = sink.chunk_writer if sink is not None and native and relay.native else None
        self._chunks: ChunkWriter | None = chunks

    @property
    def native(self) -> bool:
        """Whole reads may be offered to `whole` (the connection reads this once per arming)."""
        return self._chunks is not None

    def whole(self, data: bytes) -> bool:
        """One engine read that is one whole chunk of the body, at a chunk boundary: True
        when the compiled step answered and its bytes are out (its books kept); False:
        nothing was done, decode and `take` it."""
        relay = self._relay
        got = relay.whole(data)
        if got is None or not self._chunks.write_chunk(got[0]):  # type: ignore[union-attr]  # native
            return False
        relay.count(self._now(), got[1])
        return True

    def take(self, data: bytes) -> bool:
        """Feed one engine read; True when it was handled whole here."""
        now = self._now()
        step = self._relay.feed(data, now)
        if step.failure is None and not step.done:
            sink = self._sink
            out = step.out
            if sink is None:  # assembled: nothing to write
                ok = True
            elif sink.headers_sent:
                ok = not out or sink.write_now(out)  # type: ignore[misc]
            elif not self._relay.started:  # not a start yet: held, as the task holds it
                if out:
                    self._held.append(out)
                ok = True
            else:
                held = self._held
                ok = sink.start_now(b"".join(held) + out if held else out)  # type: ignore[misc]
                if ok:
                    held.clear()
            if ok:
                if step.first_token:
                    self._first(now)
                return True
        self.pending = (step, now)
        return False

    # the connection's handler is the feed itself: no bound method held per open stream
    __call__ = take
