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
    or a JWT claim) gets `default`'s, and the books keep at most MAX_TENANTS of them, so a
    stream of invented tenant names costs nothing.
  * No eviction gives anyone a fresh budget (issue 40 item 5: a tenant that spent its
    tokens_per_min was served on a full bucket after 4,200 other tenants arrived):
      - configured tenants' books and `default`'s are never evicted;
      - another tenant's book goes only when it is idle (nothing in flight) and every
        bucket of it is full again: a new book starts full, so nothing is given;
      - eviction looks past books it cannot evict (at most EVICT_SCAN of them per new
        tenant, each moved to the recent end), never stopping at the first;
      - when none of those can go, the new tenant shares one overflow book (default's
        limits, one budget for all of them) until its requests there have ended.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from itertools import islice

from narwhal_generated import errors as E

__all__ = ["Limits", "Bucket", "TenantBook", "Quotas", "MAX_TENANTS", "DEFAULT", "OVERFLOW"]

MAX_TENANTS = 4096  # books of tenants not configured kept at once (module invariants)
EVICT_SCAN = 32  # books looked at per new tenant when the books are full
OVERFLOW = "(overflow)"  # the shared book's name (not a valid tenant name: tenants.NAME has no parentheses)
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

    def spare(self, now: float) -> bool:
        """Nothing in flight and every bucket full: forgetting it gives nothing away."""
        return self.in_flight == 0 and all(b is None or b.level_at(now) >= b.capacity for b in (self.requests, self.tokens))


class Quotas:
    """The tenants' books and the checks of rows R17-R20 (the caller names the row)."""

    def __init__(self, limits: dict[str, Limits]) -> None:
        self.limits = dict(limits)
        self.default = self.limits.get(DEFAULT, Limits())
        self.books: OrderedDict[str, TenantBook] = OrderedDict()
        self.configured = frozenset(n for n in self.limits if n != DEFAULT)
        self.others = 0  # books in self.books of tenants neither configured nor default
        self.overflow: TenantBook | None = None  # the shared book (module invariants)
        self.in_overflow: dict[str, int] = {}  # tenant -> its requests in flight there

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
        if b is not None:
            self.books.move_to_end(tenant)
            return b
        if tenant in self.in_overflow:  # until its requests there end: one book per tenant at a time
            return self._overflow(now)
        pinned = tenant in self.configured or tenant == DEFAULT
        if not pinned:
            if self.others >= MAX_TENANTS and not self._evict(now):
                return self._overflow(now)
            self.others += 1
        b = self.books[tenant] = TenantBook(tenant, self.limits_of(tenant), now)
        return b

    def _evict(self, now: float) -> bool:
        """Forget one spare book of a tenant not configured, looking at EVICT_SCAN of
        them from the least recently seen; those that cannot go move to the recent end."""
        looked: list[str] = []
        for name, b in islice(self.books.items(), EVICT_SCAN + len(self.configured) + 1):
            if name in self.configured or name == DEFAULT:
                continue
            if b.spare(now):
                del self.books[name]
                self.others -= 1
                for n in looked:
                    self.books.move_to_end(n)
                return True
            looked.append(name)
            if len(looked) >= EVICT_SCAN:
                break
        for n in looked:
            self.books.move_to_end(n)
        return False

    def _overflow(self, now: float) -> TenantBook:
        if self.overflow is None:
            self.overflow = TenantBook(OVERFLOW, self.default, now)
        return self.overflow

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
        self.count_in(tenant, now)
        return None

    def count_in(self, tenant: str, now: float) -> None:
        """R17's take: the request is in flight in its tenant's book (end it with `end`)."""
        b = self.book(tenant, now)
        b.in_flight += 1
        if b is self.overflow:
            self.in_overflow[tenant] = self.in_overflow.get(tenant, 0) + 1

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
        n = self.in_overflow.get(tenant)
        if n is not None:  # its request was counted in the overflow book
            b = self.overflow
            if n <= 1:
                del self.in_overflow[tenant]
            else:
                self.in_overflow[tenant] = n - 1
        else:
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
