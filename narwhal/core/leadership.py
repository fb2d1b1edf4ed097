"""Leader election state of one router (spec/tables/leadership.yaml), sans-IO.

`on(event, now, ...)` applies the row TRANSITIONS[(state, event)] (a missing pair is a
bug: KeyError) and returns it; the caller (narwhal/authority/ha.py) carries out its
`action`. Nothing here talks to etcd, sleeps or reads a clock.

The fencing guarantee, as arithmetic (L14):
  * A renewal (or the grant) sent at `sent_at` and confirmed with TTL `ttl_s` proves the
    lease alive until at least `sent_at + ttl_s`: etcd restarts the TTL when it receives
    the request, which is after it was sent.
  * `fence_at = sent_at + ttl_s - margin_s`; from `fence_at` on, `fenced(now)` is True
    even before the `deadline` event is applied (a late timer admits nothing), so this
    router's authority ends before etcd can give the key to another candidate.
  * A renewal confirmed after fencing does not unfence (L23): only a new campaign does.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from narwhal_generated import leadership as L

__all__ = ["Leadership", "STATES", "EVENTS", "ROUTER_STATE"]

STATES = L.STATES
EVENTS = L.EVENTS
# the router state (router_states.yaml) each election state stands for; None: active, or
# (paused) whatever the operator set: standby, or maintenance of the router's wave
ROUTER_STATE: dict[str, str | None] = {"leader": None, "candidate": "standby", "paused": None, "fenced": "fenced"}
HISTORY = 64  # state changes remembered for /v1/engines


class Leadership:
    __slots__ = ("state", "margin_s", "token", "lease", "fence_at", "taking_over", "history", "changes")

    def __init__(self, *, margin_s: float) -> None:
        self.state = "candidate"
        self.margin_s = margin_s
        self.token: int | None = None  # the fencing token: the revision that made this router leader
        self.lease: int | None = None  # the etcd lease this router holds (or last held)
        self.fence_at: float | None = None  # leader: fenced from this instant unless renewed
        self.taking_over = False  # leader, not yet admitting (L01 take_over in progress)
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.changes = 0

    def on(self, event: str, now: float, *, token: int | None = None, lease: int | None = None,
           sent_at: float | None = None, ttl_s: float | None = None) -> L.Transition:
        row = L.TRANSITIONS[(self.state, event)]
        if event == "won" and row.next == "leader":
            assert sent_at is not None and ttl_s is not None and token is not None
            self.token = token
            self.lease = lease
            self.fence_at = sent_at + ttl_s - self.margin_s
            self.taking_over = True
        elif event == "renewed" and row.action == "extend":
            assert sent_at is not None and ttl_s is not None
            at = sent_at + ttl_s - self.margin_s
            self.fence_at = at if self.fence_at is None else max(self.fence_at, at)
        if row.next != "leader":
            self.fence_at = None
            self.taking_over = False
        if row.next != self.state:
            self.changes += 1
            self.history.append({"at": round(now, 3), "from": self.state, "to": row.next, "event": event, "row": row.id, "token": self.token})
        self.state = row.next
        return row

    def took_over(self) -> None:
        """L01's take-over is done: the leader admits from now on."""
        self.taking_over = False

    # -- what the router state reads ------------------------------------------------------

    def fenced(self, now: float) -> bool:
        if self.state == "fenced":
            return True
        return self.state == "leader" and self.fence_at is not None and now >= self.fence_at

    def standby(self, now: float) -> bool:
        """A candidate (another router leads) or a leader still taking over. Paused is
        not: the operator's own state (standby, maintenance) names the reason."""
        return self.state == "candidate" or (self.state == "leader" and self.taking_over)

    def admitting(self, now: float) -> bool:
        return self.state == "leader" and not self.taking_over and not self.fenced(now)

    def snapshot(self, now: float) -> dict[str, Any]:
        return {
            "state": self.state,
            "router_state": "fenced" if self.fenced(now) else ("standby" if self.standby(now) else ("operator" if self.state == "paused" else "active")),
            "fencing_token": self.token,
            "lease": self.lease,
            "fence_in_ms": None if self.fence_at is None else round((self.fence_at - now) * 1000.0, 1),
            "taking_over": self.taking_over,
            "history": list(self.history),
        }
