"""What each tenant may use (issue 22 item 2; `tenants:` in the configuration), sans-IO.

One `TenantBook` per tenant the router has seen: its requests in flight, its queued
count lives in the queues themselves (core/fairness.py), and two token buckets:

  * `requests_per_s`: a bucket of one second's requests (at least 1), one taken per
    arrival (row R18);
  * `tokens_per_min`: a bucket of one minute's tokens; the prompt is charged at admission
    (R19 when the bucket cannot pay for it), the output as it is counted (at the
    request's end: the engine's token IDs), and a request refused or failed after its
    charge is refunded what it did not use (its prompt when it produced nothing).
  * `max_in_flight`: requests offered and not yet ended (R17).

Refusals carry the wait until the bucket can pay (Retry-After, as R10's: max(1, round(s)))
computed from the bucket, never a constant.

Invariants
  * Every bucket is bounded: at most its capacity, never below -capacity (a request's
    output may overdraw it once, so a tenant over its budget waits it out).
  * Only configured tenants (and `default`) have limits; any other tenant name (from a key
    or a JWT claim) gets `default`'s, and the books keep at most MAX_TENANTS of them (the
    least recently seen goes), so a stream of invented tenant names costs nothing.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

from narwhal_generated import errors as E

__all__ = ["Limits", "Bucket", "TenantBook", "Quotas", "MAX_TENANTS", "DEFAULT"]

MAX_TENANTS = 4096  # tenant books kept at once (least recently seen first out)
DEFAULT = "default"  # the entry of tenants: that applies to a tenant without its own


@dataclass(frozen=True, slots=True)
class Limits:
    weight: float = 1.0
    max_in_flight: int | None = None
    queue_limit: int | None = None
    requests_per_s: float | None = None
    tokens_per_min: int | None = None
    ttft_budget_ms: float | None = None


class Bucket:
    __slots__ = ("rate", "capacity", "level", "at")

    def __init__(self, rate_per_s: float, capacity: float, now: float) -> None:
        self.rate, self.capacity = rate_per_s, capacity
        self.level = capacity  # a tenant starts with a full bucket
        self.at = now

    def level_at(self, now: float) -> float:
        """The level at `now` (filled since it was last touched), without touching it."""
        return min(self.capacity, self.level + (now - self.at) * self.rate) if now > self.at else self.level

    def _fill(self, now: float) -> None:
        if now > self.at:
            self.level = self.level_at(now)
            self.at = now

    def wait_s(self, n: float, now: float) -> float:
        """0 when `n` can be taken now, else the seconds until it can."""
        self._fill(now)
        need = min(n, self.capacity) - self.level  # more than a full bucket: a full one will do
        return 0.0 if need <= 0 else need / self.rate

    def take(self, n: float, now: float) -> None:
        self._fill(now)
        self.level = max(-self.capacity, self.level - n)

    def refund(self, n: float) -> None:
        self.level = min(self.capacity, self.level + n)


def retry_after(wait_s: float) -> int:
    return max(1, math.ceil(wait_s))


class TenantBook:
    __slots__ = ("name", "limits", "in_flight", "requests", "tokens")

    def __init__(self, name: str, limits: Limits, now: float) -> None:
        self.name = name
        self.limits = limits
        self.in_flight = 0
        self.requests = Bucket(limits.requests_per_s, max(1.0, limits.requests_per_s), now) if limits.requests_per_s else None
        self.tokens = Bucket(limits.tokens_per_min / 60.0, float(limits.tokens_per_min), now) if limits.tokens_per_min else None


class Quotas:
    """The tenants' books and the checks of rows R17-R20 (the caller names the row)."""

    def __init__(self, limits: dict[str, Limits]) -> None:
        self.limits = dict(limits)
        self.default = self.limits.get(DEFAULT, Limits())
        self.books: OrderedDict[str, TenantBook] = OrderedDict()
        self.configured = frozenset(n for n in self.limits if n != DEFAULT)

    def limits_of(self, tenant: str | None) -> Limits:
        if tenant is None:
            return self.default
        return self.limits.get(tenant, self.default)

    def label(self, tenant: str | None) -> str:
        """The tenant's label on /metrics and in the books: a configured tenant's name,
        else `default` (no identity) or `other` (a tenant of a key not configured)."""
        if tenant is None:
            return DEFAULT
        return tenant if tenant in self.configured else "other"

    def weight(self, tenant: str | None) -> float:
        return self.limits_of(tenant).weight

    def book(self, tenant: str, now: float) -> TenantBook:
        b = self.books.get(tenant)
        if b is None:
            b = self.books[tenant] = TenantBook(tenant, self.limits_of(tenant), now)
            while len(self.books) > MAX_TENANTS:
                old, ob = next(iter(self.books.items()))
                if ob.in_flight:  # still holding requests: keep it (bounded by those)
                    break
                del self.books[old]
        else:
            self.books.move_to_end(tenant)
        return b

    # -- the rows ------------------------------------------------------------------------

    def arrive(self, tenant: str, now: float) -> tuple[E.ErrorRow, float] | None:
        """At arrival: (R17, 0) over max_in_flight, (R18, wait) over requests_per_s,
        else None and the request is counted in flight (end it with `end`)."""
        b = self.book(tenant, now)
        lim = b.limits
        if lim.max_in_flight is not None and b.in_flight >= lim.max_in_flight:
            return (E.R17, 0.0)
        if b.requests is not None:
            w = b.requests.wait_s(1.0, now)
            if w > 0:
                return (E.R18, w)
            b.requests.take(1.0, now)
        b.in_flight += 1
        return None

    def charge_prompt(self, tenant: str, prompt_tokens: int, now: float) -> float:
        """At admission: 0 and the prompt charged, else the wait (R19)."""
        b = self.book(tenant, now)
        if b.tokens is None:
            return 0.0
        w = b.tokens.wait_s(prompt_tokens, now)
        if w > 0:
            return w
        b.tokens.take(prompt_tokens, now)
        return 0.0

    def end(self, tenant: str, now: float, *, charged_prompt: int = 0, output_tokens: int | None = None) -> None:
        """The request ended: out of flight; its output charged as counted; a request
        that produced nothing is refunded the prompt it was charged."""
        b = self.books.get(tenant)
        if b is None:
            return
        b.in_flight = max(0, b.in_flight - 1)
        if b.tokens is not None:
            if output_tokens:
                b.tokens.take(output_tokens, now)
            elif charged_prompt:
                b.tokens.refund(charged_prompt)

    def snapshot(self) -> dict[str, dict[str, float | int | None]]:
        return {n: {"in_flight": b.in_flight, "weight": b.limits.weight,
                    "requests_level": None if b.requests is None else round(b.requests.level, 3),
                    "tokens_level": None if b.tokens is None else round(b.tokens.level, 1)} for n, b in self.books.items()}
