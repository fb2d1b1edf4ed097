"""What a leader hands on of the tenants' buckets (issue 22 item 3, with `ha`), sans-IO.

With `ha` one authority holds every tenant's counters. A take-over would otherwise start
every bucket full: each tenant could spend a second `requests_per_s` burst and a second
minute of `tokens_per_min` at once. So the leader writes the levels of the buckets that
are not full to etcd after each lease renewal (authority/ha.py; one small put per
`renew_interval_ms`, none while every bucket is full), and a new leader restores them
before its first admission, filled for the time since they were written.

What a take-over keeps and loses (docs/operations.md#tenants-and-a-take-over):
  * kept: each tenant's two bucket levels, as of the old leader's last renewal (at most one
    `renew_interval_ms` stale, on the generous side only by what was spent since);
  * lost: the tenants' requests in flight (`max_in_flight`, R17): the old leader's streams
    run on and end there, so a tenant may hold up to its limit again on the new leader until
    they end; the engines' own load count (authority/load.py) still keeps those slots taken;
  * lost: the fair queues' virtual times (the queues are refused at the fence, L12).

Invariants
  * The encoding is bounded: at most MAX_CARRIED tenants (configured ones first, then the
    most recently seen), levels only (no key, no identity).
  * Restoring never grants more than a full bucket nor less than -capacity, whatever the
    bytes hold (limits may have changed between the two leaders' configurations), and
    bytes that do not parse restore nothing (every bucket stays as it is).
"""

from __future__ import annotations

import json
import math
from typing import Any

from .quota import Bucket, Quotas

__all__ = ["MAX_CARRIED", "levels", "export", "encode", "restore"]

MAX_CARRIED = 1024  # tenants whose buckets a leader hands on (≈ 50 bytes each)
MAX_BYTES = 256 * 1024  # what a restore reads at most


def _level(b: Bucket | None, now: float) -> float | None:
    if b is None:
        return None
    level = b.level_at(now)
    return None if level >= b.capacity else round(level, 3)  # a full bucket is the default: not carried


def levels(q: Quotas, now: float) -> dict[str, list[float | None]]:
    """Every tenant with a bucket that is not full: name -> [requests level, tokens level]."""
    names = [n for n in q.configured if n in q.books]
    names += [n for n in reversed(q.books) if n not in q.configured]  # most recently seen first
    out: dict[str, list[float | None]] = {}
    for n in names:
        if len(out) >= MAX_CARRIED:
            break
        b = q.books[n]
        pair = [_level(b.requests, now), _level(b.tokens, now)]
        if pair != [None, None]:
            out[n] = pair
    return out


def export(q: Quotas, now: float, wall: float) -> bytes:
    """The bytes a leader puts to etcd: the levels at `now` (the clock of the quotas),
    stamped with wall time `wall` so that another process can fill them for the gap."""
    return encode(levels(q, now), wall)


def encode(carried: dict[str, list[float | None]], wall: float) -> bytes:
    """`levels`' answer as `export` writes it (for a caller that has them already)."""
    return json.dumps({"v": 1, "at": round(wall, 3), "tenants": carried}, separators=(",", ":"), sort_keys=True).encode()


def _number(x: Any) -> float | None:
    return float(x) if isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) else None


def _set(b: Bucket | None, level: Any, now: float, gap_s: float) -> None:
    if b is None:
        return
    v = _number(level)
    b.level = b.capacity if v is None else max(-b.capacity, min(b.capacity, v))
    b.at = now - gap_s  # the next fill adds what the gap refilled


def restore(q: Quotas, data: bytes, now: float, wall: float) -> int:
    """Apply a leader's `export`: each carried tenant's buckets at their level, filled
    for the wall time since; every other tenant's buckets full (the old leader had them
    full). Answers how many tenants were carried, -1 when the bytes do not parse."""
    try:
        obj = json.loads(data[:MAX_BYTES]) if len(data) <= MAX_BYTES else None
    except ValueError:
        obj = None
    if not isinstance(obj, dict) or obj.get("v") != 1 or not isinstance(obj.get("tenants"), dict):
        return -1
    at = _number(obj.get("at"))
    gap_s = 0.0 if at is None else max(0.0, wall - at)
    carried = obj["tenants"]
    for name, b in q.books.items():  # this router's own books from an earlier term
        if name not in carried:
            _set(b.requests, None, now, 0.0)
            _set(b.tokens, None, now, 0.0)
    n = 0
    for name, pair in list(carried.items())[:MAX_CARRIED]:
        if not isinstance(name, str) or not isinstance(pair, list) or len(pair) != 2:
            continue
        b = q.book(name, now)
        _set(b.requests, pair[0], now, gap_s)
        _set(b.tokens, pair[1], now, gap_s)
        n += 1
    return n
