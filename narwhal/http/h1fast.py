"""What the app finds in an HTTP stream's scope extensions (HTTP/1.1 and HTTP/2):

  * DIRECT (HTTP/1.1 only): the stream's `h1.cycle.H1Direct`, its answer's head, chunks
    and end written straight to the client's transport (narwhal/http/h1/cycle.py);
  * CLOSE: the stream's `CloseHook`, which tells the app that its stream closed without a
    task waiting on receive() (1.4 KiB per open stream).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["DIRECT", "CLOSE", "DIRECT_BUFFER", "CloseHook", "PreparedHead"]


DIRECT = "narwhal.h1_direct"  # the scope extension holding a stream's H1Direct
CLOSE = "narwhal.close"  # the scope extension holding a stream's CloseHook
DIRECT_BUFFER = 64 * 1024  # bytes waiting in the transport past which H1Direct declines

# a head H1Direct.prepare built: (status, the second it was built in, the app's headers, the bytes)
PreparedHead = tuple[int, int, list[tuple[bytes, bytes]], bytes]


class CloseHook:
    """The app learns that its stream closed (the client went away, or the connection
    closed): `closed` once it has, and `cb` is called then if set."""

    __slots__ = ("closed", "cb")

    def __init__(self) -> None:
        self.closed = False
        self.cb: Callable[[], object] | None = None

    def fire(self) -> None:
        if not self.closed:
            self.closed = True
            cb, self.cb = self.cb, None
            if cb is not None:
                cb()
