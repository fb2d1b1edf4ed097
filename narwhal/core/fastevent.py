"""The compiled relay step (issue 25): `event`, or None where `pip install` built no C.

`event(data, client_ids, limit)` answers for one common engine read of a started stream
-- one whole HTTP/1.1 chunk holding one whole event whose every choice carries token
IDs -- with the client's bytes framed as one chunk and the IDs it counted, or declines
(None). Its contract, and the invariant that makes an answer equal to core/relay.py's,
are in narwhal/core/_fastevent.c; core/relay.py stays the reference and takes every read
the step declines (tests/core/test_fastevent.py checks each answer against it).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["event"]

event: Callable[[bytes, bool, int], tuple[bytes, int] | None] | None
try:
    from ._fastevent import event
except ImportError:  # no C compiler at install: every read goes through core/relay.py
    event = None
