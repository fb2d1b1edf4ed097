"""The authority's side of the seam (narwhal/core/lease.py), in process: `LocalDoor`,
and per request a `LocalEntry` (its books entry and R02 retention) and a `LocalLease`
(its ticket in the scheduler).

Every call that frees a slot wakes the waiters it granted. A lease is closed once; an
entry's `end` closes a lease still open (a data plane that lost track of it: a bug, or a
worker process that died), so every offered request ends in exactly one terminal class
and frees what it held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from narwhal_generated import errors as E

from ..core.accounting import Entry as BooksEntry
from ..core.lease import Grant, Order, Outcome
from ..core.prefix import APPROX_BLOCK_BYTES
from ..core.quota import DEFAULT
from ..core.tickets import Dispatch, Enqueued, Refuse, Ticket, Work
from .authority import Authority

__all__ = ["LocalDoor", "LocalEntry", "LocalLease", "QUEUED"]

QUEUED = object()  # a *_now call's answer: queued; await `wait()` for the grant


class LocalLease:
    __slots__ = ("a", "t", "order", "first", "prompt_tokens", "projected_ttft_ms", "expected_cached", "closed", "output_tokens")

    def __init__(self, a: Authority, first: Dispatch | Enqueued, order: Order) -> None:
        self.a = a
        self.t: Ticket = first.ticket
        self.order = order
        self.first = first
        self.prompt_tokens = first.ticket.work.prompt_tokens
        self.projected_ttft_ms = first.ticket.projected_ttft_ms
        self.expected_cached = first.ticket.expected_cached
        self.closed = False
        self.output_tokens: int | None = None  # counted (token IDs) when it closed

    # -- grants ------------------------------------------------------------------------

    def _expired(self) -> Refuse:
        """A wait ended with no grant: R12 (admission.max_wait_ms) or R13 (the deadline)."""
        a, t = self.a, self.t
        now = a.clock.now()
        row = a.scheduler.expiry(t, now) or E.R12
        limit = a.config.admission.max_wait_ms if row is E.R12 else round((t.work.deadline_s or 0) * 1000)
        return Refuse(row, fields={"waited_ms": round(a.scheduler.waited_s(t, now) * 1000), "limit": limit})

    def wait(self) -> Awaitable[Grant | Refuse]:
        """A queued lease's grant, or its refusal (R12/R13 expiry, R09 on reconcile).
        The waiter is registered now, before the caller's next await: call it in the turn
        that queued the lease (authority/channel.py starts it in a task of its own)."""
        return self._wait(self.a.register(self.t))

    async def _wait(self, f: asyncio.Future[Dispatch | Refuse]) -> Grant | Refuse:
        a = self.a
        got = await a.wait_grant(self.t, f)
        if got is None:
            return self._expired()
        if isinstance(got, Refuse):
            return got
        if a.state.election.fenced(a.clock.now()):  # granted as the lease ran out: not admitted
            return Refuse(E.R01, fields={"reason": "fenced"})
        return Grant(got.engine, got.phase)

    def granted_now(self) -> Grant | object:
        d = self.first
        return Grant(d.engine, d.phase) if isinstance(d, Dispatch) else QUEUED

    async def granted(self) -> Grant | Refuse:
        g = self.granted_now()
        return await self.wait() if g is QUEUED else g  # type: ignore[return-value]

    def decode_now(self) -> Grant | Refuse | object:
        a = self.a
        g = a.scheduler.want_decode(self.t, a.clock.now())
        if isinstance(g, Enqueued):
            return QUEUED
        if isinstance(g, Refuse):
            return g
        return Grant(g.engine, g.phase)

    async def decode_slot(self) -> Grant | Refuse:
        g = self.decode_now()
        return await self.wait() if g is QUEUED else g  # type: ignore[return-value]

    def retry_now(self, engine: str, row: str, phase: str, at: float) -> Grant | Refuse | object | None:
        """T05: the attempt on `engine` failed before response headers with a retryable
        row (or a stream migration, after them); another eligible engine (or QUEUED for a
        slot: a decode slot, or a unified engine's), or None when there is
        none to try."""
        a = self.a
        a.engine_failed(engine, row)
        a.wake(a.scheduler.decode_failed(self.t, at))
        if a.leaving:  # lifecycle M29: the failed attempt's slot on a leaving engine may have been its last
            a.released()
        if phase == "decode":
            if not a.scheduler.has_retry_decoder(self.t):
                return None
            return self.decode_now()
        d = a.scheduler.retry_unified(self.t, at)
        if d is None:
            return None
        return QUEUED if isinstance(d, Enqueued) else Grant(d.engine, d.phase)

    async def retry(self, engine: str, row: str, phase: str, at: float) -> Grant | Refuse | None:
        g = self.retry_now(engine, row, phase, at)
        return await self.wait() if g is QUEUED else g  # type: ignore[return-value]

    # -- phase events --------------------------------------------------------------------

    def prefill_done(self, at: float, *, ok: bool) -> None:
        a = self.a
        a.wake(a.scheduler.prefill_done(self.t, at, ok=ok))

    def first_token(self, at: float) -> None:
        a = self.a
        a.wake(a.scheduler.first_token(self.t, at))

    def close(self, outcome: Outcome) -> None:
        """The request ended: learn from it, tell the breaker, free every slot."""
        if self.closed:
            return
        self.closed = True
        a, o = self.a, outcome
        self.output_tokens = o.output_tokens
        if o.tpot_s is not None and o.tpot_engine is not None:
            e = a.engines[o.tpot_engine]
            # scored at the mean batch over the span the TPOT was measured (from the first
            # token), not the batch left at the close (docs/prediction.md section 8: B_k)
            e.decode.observe(e.mean_decode_batch(self.t.decode_mark, o.at), o.tpot_s * 1000.0)
        if o.output_tokens is not None:
            w = self.t.work
            a.scheduler.output_lengths.observe(w.route, w.prompt_tokens, w.max_tokens, o.output_tokens, finish_reason=o.finish_reason)
        if o.reported_prompt_tokens is not None and self.order.exact_prompt_tokens is None:
            a.sizer.learn(self.order.prompt_bytes, o.reported_prompt_tokens)
        a.scheduler.learn(self.t, o.cached_tokens)
        if o.failed_engine is not None and o.failed_row is not None:
            a.engine_failed(o.failed_engine, o.failed_row)
        elif o.ok_engine is not None:
            a.engine_ok(o.ok_engine)
        a.wake(a.scheduler.finish(self.t, o.at))
        if a.leaving:  # lifecycle M29: the last lease on a leaving engine releases it
            a.released()


class LocalEntry:
    __slots__ = ("a", "books", "lease", "ended", "tenant", "charged")

    def __init__(self, a: Authority, books: BooksEntry, tenant: str | None = None) -> None:
        self.a = a
        self.books = books
        self.lease: LocalLease | None = None
        self.ended = False
        self.tenant = tenant  # its quota book's name (tenants configured), else None
        self.charged = 0  # prompt tokens charged to the tenant's tokens_per_min (R19)

    async def arrived(self) -> Refuse | None:
        return None  # decided in LocalDoor.arrive: a refused arrival never has an entry

    async def admit(self, order: Order) -> LocalLease | Refuse:
        return self.admit_now(order)

    def admit_now(self, order: Order) -> LocalLease | Refuse:
        """Workload sizing (from here on the request is sized: C02 no longer applies),
        then R08-R11 and R14."""
        a = self.a
        a.books.sized(self.books)
        now = a.clock.now()
        if a.state.election.fenced(now) or a.state.election.standby(now):
            # the router lost (or handed on) its authority while the body arrived (R01)
            return Refuse(E.R01, fields={"reason": a.state.reason(now) or "fenced"})
        work = Work(
            route=order.route,
            prompt_tokens=a.sizer.size(order.prompt_bytes, order.exact_prompt_tokens),
            max_tokens=order.max_tokens,
            budget_ms=order.budget_ms,
            arrival=order.arrival,
            max_wait_s=a.config.admission.max_wait_ms / 1000.0,
            deadline_s=order.deadline_s,
            prefix=order.prefix if a.scheduler.prefix else (),
            token_prefix=order.token_prefix if a.scheduler.prefix else (),
            block_tokens=APPROX_BLOCK_BYTES / a.sizer.bytes_per_token,
            tenant=order.tenant,
        )
        if self.tenant is not None:  # R19: the tenant's tokens per minute pay for the prompt
            wait = a.quotas.charge_prompt(self.tenant, work.prompt_tokens, now)  # type: ignore[union-attr]
            if wait > 0:
                return Refuse(E.R19, overrun_s=wait, fields={"tenant": self.tenant, "limit": a.quotas.limits_of(self.tenant).tokens_per_min,  # type: ignore[union-attr]
                                                             "retry_after": E.retry_after_seconds(E.R19, wait)})
            self.charged = work.prompt_tokens
        d = a.scheduler.admit(work, now)
        if a.scheduler.evicted:  # R11 with tenants: a queued request yielded its place
            a.settle_evicted()
        if isinstance(d, Refuse):
            return d
        self.lease = LocalLease(a, d, order)
        return self.lease

    def end(self, cls: str) -> None:
        if self.ended:
            return
        self.ended = True
        a = self.a
        if self.lease is not None and not self.lease.closed:
            self.lease.close(Outcome(at=a.clock.now()))
        a.held -= 1
        a.books.end(self.books, cls)
        if self.tenant is not None:  # its output charged as counted; nothing produced: the prompt refunded
            out = self.lease.output_tokens if self.lease is not None else None
            a.quotas.end(self.tenant, a.clock.now(), charged_prompt=self.charged, output_tokens=out)  # type: ignore[union-attr]


class LocalDoor:
    """The data plane's door to this authority, in the same process."""

    __slots__ = ("a",)

    def __init__(self, a: Authority) -> None:
        self.a = a

    async def arrive(self, at: float, denied: Refuse | None = None, tenant: str | None = None) -> LocalEntry | Refuse:
        """C01 (offered), then R01, the data plane's `denied` (R15/R16), the tenant's
        R17/R18 and R02, before the body is read."""
        return self.arrive_now(at, denied, tenant)

    def arrive_now(self, at: float, denied: Refuse | None = None, tenant: str | None = None) -> LocalEntry | Refuse:
        a = self.a
        books = a.books.offer(a.quotas.label(tenant) if a.quotas is not None else None)
        reason = a.state.reason(at)
        if reason is not None:  # R01
            a.books.end(books, E.R01.counter)
            return Refuse(E.R01, fields={"reason": reason})
        if denied is not None:  # R15, R16: after R01, before R02 (no retention taken)
            a.books.end(books, denied.row.counter)
            return denied
        name: str | None = None
        if a.quotas is not None:  # tenants configured: R17, R18 (core/quota.py)
            name = tenant or DEFAULT
            over = a.quotas.arrive(name, at)
            if over is not None:
                row, wait = E.ROWS[over[0]], over[1]
                a.books.end(books, row.counter)
                lim = a.quotas.limits_of(name)
                limit = lim.max_in_flight if row is E.R17 else lim.requests_per_s
                return Refuse(row, overrun_s=wait if row.retry_after == "overrun" else None,
                              fields={"tenant": name, "limit": limit, "retry_after": E.retry_after_seconds(row, wait)})
        limit = a.config.admission.http_retention_limit
        if a.held >= limit and not (name is not None and a.yield_retention(name)):  # R02; with tenants, fair (core/fairness.py retention_victim)
            a.books.end(books, E.R02.counter)
            if name is not None:
                a.quotas.end(name, at)  # type: ignore[union-attr]
            return Refuse(E.R02, fields={"limit": limit})
        a.held += 1
        return LocalEntry(a, books, name)
