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
import functools
from collections.abc import Awaitable, Callable

from narwhal_generated import errors as E

from ..core import refusals as answers
from ..core.accounting import Entry as BooksEntry
from ..core.lease import Grant, Order, Outcome
from ..core.placement import Placement, place
from ..core.preempt import resume
from ..core.prefix import APPROX_BLOCK_BYTES
from ..core.quota import DEFAULT
from ..core.reroute import fallbacks, moved
from ..core.tickets import Dispatch, Enqueued, Refuse, Ticket, Work
from .authority import Authority

__all__ = ["LocalDoor", "LocalEntry", "LocalLease", "QUEUED"]

QUEUED = object()  # a *_now call's answer: queued; await `wait()` for the grant


class LocalLease:
    __slots__ = ("a", "t", "order", "first", "prompt_tokens", "projected_ttft_ms", "expected_cached", "closed", "output_tokens", "tell")

    def __init__(self, a: Authority, first: Dispatch | Enqueued, order: Order) -> None:
        self.a = a
        self.t: Ticket = first.ticket
        # fair preemption (core/preempt.py): how this request's data plane is told to cut
        # its leg: in process, a fact keyed by the ticket's id (the lease's `key`); a
        # worker's session (channel.py) sends it to that worker only, keyed by its rid
        self.tell: Callable[[], None] | None = None  # None: in process (made when needed)
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

    def retry_now(self, engine: str, row: E.ErrorRow, phase: str, at: float) -> Grant | Refuse | object | None:
        """T05: the attempt on `engine` failed before response headers with a retryable
        row (or a stream migration, after them); another eligible engine (or QUEUED for a
        slot: a decode slot, or a unified engine's), or None when there is
        none to try."""
        a = self.a
        a.preempting.pop(self.t.id, None)
        if self.t.preempted == engine and self.t.holds_decode == engine:  # cut for a lighter tenant: no failure (core/preempt.py)
            grants, got = resume(a.scheduler, self.t, at)
            a.wake(grants)
            return None if got is None else QUEUED if isinstance(got, Enqueued) else Grant(got.engine, got.phase)
        a.engine_failed(engine, row)
        a.wake(a.scheduler.decode_failed(self.t, at))
        if a.leaving:  # lifecycle M29: the failed attempt's slot on a leaving engine may have been its last
            a.released()
        if phase == "decode":
            if not a.scheduler.has_retry_decoder(self.t):
                return None
            return self.decode_now()
        d = a.scheduler.retry_unified(self.t, at)
        _wake_granted(a)
        if d is None:
            return None
        return QUEUED if isinstance(d, Enqueued) else Grant(d.engine, d.phase)

    async def retry(self, engine: str, row: E.ErrorRow, phase: str, at: float) -> Grant | Refuse | None:
        g = self.retry_now(engine, row, phase, at)
        return await self.wait() if g is QUEUED else g  # type: ignore[return-value]

    # -- a gateway's fallback list (core/reroute.py) -----------------------------------------

    def fallbacks(self, n: int) -> tuple[str, ...]:
        return fallbacks(self.a.scheduler, self.t, n)

    def served(self, engine: str, at: float) -> bool:
        """The gateway served the request on `engine` after the granted one failed to
        connect (E06 for its breaker); False when the books cannot follow (unknown, or not
        a unified engine)."""
        a, old = self.a, self.t.engine
        e = a.scheduler.engines.get(engine)
        if old is None or engine == old or e is None or e.role != "unified" or self.t.holds_prefill != old:
            return False
        a.engine_failed(old, E.E06)
        a.wake(moved(a.scheduler, self.t, engine, at))
        return True

    # -- phase events --------------------------------------------------------------------

    def prefill_done(self, at: float, *, ok: bool) -> None:
        a = self.a
        a.wake(a.scheduler.prefill_done(self.t, at, ok=ok))

    @property
    def key(self) -> int:
        """What the data plane files this request under for a preemption's fact."""
        return self.t.id

    def first_token(self, at: float, movable: bool = False) -> None:
        """The first token; `movable`: its decode leg can be carried on (core/preempt.py)."""
        a = self.a
        if movable and a.scheduler.fair is not None and a.scheduler.fair.preempt:
            self.t.movable = True
            a.preempting[self.t.id] = self.tell or functools.partial(a._tell, "", ["preempt", self.t.id])
        a.wake(a.scheduler.first_token(self.t, at))

    def close(self, outcome: Outcome) -> None:
        """The request ended: learn from it, tell the breaker, free every slot."""
        if self.closed:
            return
        self.closed = True
        a, o = self.a, outcome
        a.preempting.pop(self.t.id, None)
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


def _wake_granted(a: Authority) -> None:
    """The fair reserve: waiters a placement past them let take a slot (core/fairness.py)."""
    if a.scheduler.granted:
        granted, a.scheduler.granted = a.scheduler.granted, []
        a.wake(granted)


def _on_placement(fact: Callable[[Placement, E.ErrorRow], Refuse | None]) -> Callable[[LocalEntry, E.ErrorRow], Refuse | None]:
    """An admission row's fact, the scheduler's, over the entry's placement (made once,
    when the first of them is asked; none without a parsed body)."""

    def on(self: LocalEntry, row: E.ErrorRow) -> Refuse | None:
        pl = self.pl or self.placed()
        return None if pl is None else fact(pl, row)

    return on


class LocalEntry:
    """One offered request at the authority: its books entry, what it took, and the facts
    of the refusal rows the authority knows (core/refusals.py walks them in the table's
    order; `pos` is where the last walk stopped, undecided so far)."""

    __slots__ = ("a", "books", "lease", "ended", "tenant", "charged", "now", "denied", "pos", "held", "counted",
                 "body", "order", "work", "pl")

    def __init__(self, a: Authority, books: BooksEntry, tenant: str | None, at: float, denied: Refuse | None) -> None:
        self.a = a
        self.books = books
        self.lease: LocalLease | None = None
        self.ended = False
        self.tenant = tenant  # its quota book's name (tenants configured), else None
        self.charged = 0  # prompt tokens charged to the tenant's tokens_per_min (R19)
        self.now = at
        self.denied = denied  # the data plane's R15/R16 on the request head
        self.pos = 0
        self.held = False  # R02: it holds a place of http_retention_limit
        self.counted = False  # R17: it is counted in its tenant's max_in_flight
        self.body: tuple[Refuse, ...] = ()  # the body rows that hold (the data plane's checks)
        self.order: Order | None = None
        self.work: Work | None = None
        self.pl: Placement | None = None

    def step(self, stage: int) -> Refuse | None:
        """The rows from `pos` that are known at `stage`: the first that holds refuses
        (nothing taken in this step); else what the rows passed take is taken."""
        table = answers.TABLE
        got, pos = table.walk(self, stage, self.pos, 0 if self.body or self.denied else answers.QUIET_BODY)
        if got is not None:
            return got
        table.take(self, self.pos, pos)
        self.pos = pos
        return None

    # -- facts, stage head -----------------------------------------------------------------

    def router_not_ready(self, row: E.ErrorRow) -> Refuse | None:
        reason = self.a.state.reason(self.now)
        return None if reason is None else Refuse(row, fields={"reason": reason})

    def api_key_missing(self, row: E.ErrorRow) -> Refuse | None:
        d = self.denied
        return d if d is not None and d.row is row else None

    api_key_invalid = api_key_missing

    def tenant_in_flight_full(self, row: E.ErrorRow) -> Refuse | None:
        if self.tenant is None:
            return None
        b = self.a.quotas.book(self.tenant, self.now)  # type: ignore[union-attr]
        limit = b.limits.max_in_flight
        if limit is None or b.in_flight < limit:
            return None
        return Refuse(row, fields={"tenant": self.tenant, "limit": limit, "retry_after": answers.retry_after_seconds(row)})

    def take_tenant_in_flight_full(self) -> None:
        if self.tenant is not None:
            self.a.quotas.count_in(self.tenant, self.now)  # type: ignore[union-attr]
            self.counted = True

    def tenant_request_rate_exceeded(self, row: E.ErrorRow) -> Refuse | None:
        if self.tenant is None:
            return None
        b = self.a.quotas.book(self.tenant, self.now)  # type: ignore[union-attr]
        wait = 0.0 if b.requests is None else b.requests.wait_s(1.0, self.now)
        if wait <= 0:
            return None
        return Refuse(row, overrun_s=wait, fields={"tenant": self.tenant, "limit": b.limits.requests_per_s,
                                                   "retry_after": answers.retry_after_seconds(row, wait)})

    def take_tenant_request_rate_exceeded(self) -> None:
        if self.tenant is not None:
            b = self.a.quotas.book(self.tenant, self.now)  # type: ignore[union-attr]
            if b.requests is not None:
                b.requests.take(1.0, self.now)

    def http_retention_full(self, row: E.ErrorRow) -> Refuse | None:
        """R02: the retention is full, unless (tenants configured) a tenant further over
        its share of it has a queued request to yield (core/fairness.py retention_victim)."""
        a = self.a
        limit = a.config.admission.http_retention_limit
        if a.held < limit or (self.tenant is not None and a.yield_retention(self.tenant, act=False, arriving=0 if self.counted else 1)):
            return None
        return Refuse(row, fields={"limit": limit})

    def take_http_retention_full(self) -> None:
        """R02's place. Full (tenants configured): the request that yields (refused R02 in
        its books) gives its place to this arrival at once, so `held` never exceeds
        admission.http_retention_limit (it was one over until the yielded request ended)."""
        a = self.a
        if a.held >= a.config.admission.http_retention_limit and self.tenant is not None:
            t = a.yield_retention(self.tenant)
            yielded = a.retained.pop(t.id, None) if t else None
            if yielded is not None and yielded.held:
                yielded.held = False
                a.held -= 1
        a.held += 1
        self.held = True

    # -- facts, stage body (the data plane's checks, passed in `admit`) --------------------

    def body_too_large(self, row: E.ErrorRow) -> Refuse | None:
        for r in self.body:
            if r.row is row:
                return r
        return None

    model_unknown = sampling_width_over_one = unsupported_non_streaming_option = body_too_large

    def body_invalid(self, row: E.ErrorRow) -> Refuse | None:
        """R04: the body's own check, or a head the data plane found invalid for this row
        (two credential fields, tenants/identity.py rule 1), passed as `denied`."""
        d = self.denied
        if d is not None and d.row.id == row.id:
            return d
        return self.body_too_large(row)

    # -- facts, stage admission ------------------------------------------------------------

    def tenant_token_rate_exceeded(self, row: E.ErrorRow) -> Refuse | None:
        if self.tenant is None:
            return None
        w = self.work or self.sized()
        if w is None:
            return None
        b = self.a.quotas.book(self.tenant, self.now)  # type: ignore[union-attr]
        wait = 0.0 if b.tokens is None else b.tokens.wait_s(w.prompt_tokens, self.now)
        if wait <= 0:
            return None
        return Refuse(row, overrun_s=wait, fields={"tenant": self.tenant, "limit": b.limits.tokens_per_min,
                                                   "retry_after": answers.retry_after_seconds(row, wait)})

    def take_tenant_token_rate_exceeded(self) -> None:
        """R19: the tenant's tokens per minute pay for the prompt."""
        w = self.work
        if w is not None and self.tenant is not None:
            b = self.a.quotas.book(self.tenant, self.now)  # type: ignore[union-attr]
            if b.tokens is not None:
                b.tokens.take(w.prompt_tokens, self.now)
            self.charged = w.prompt_tokens

    def placed(self) -> Placement | None:
        if self.pl is None:
            w = self.sized()
            if w is not None:
                self.pl = place(self.a.scheduler, w, self.now)
        return self.pl

    # the scheduler's facts (core/placement.py), over this request's placement
    prompt_alone_exceeds_budget = _on_placement(Placement.prompt_alone_exceeds_budget)
    no_eligible_engine = _on_placement(Placement.no_eligible_engine)
    projected_ttft_over_budget = _on_placement(Placement.projected_ttft_over_budget)
    tenant_queue_full = _on_placement(Placement.tenant_queue_full)
    admission_queue_full = _on_placement(Placement.admission_queue_full)
    projected_tpot_over_budget = _on_placement(Placement.projected_tpot_over_budget)

    def take_admission_queue_full(self) -> None:
        if self.pl is not None:
            self.pl.take_admission_queue_full()

    def admission_wait_expired(self, row: E.ErrorRow) -> Refuse | None:
        return None  # nothing has waited at admission: R12/R13 are decided in the wait (LocalLease)

    deadline_expired = admission_wait_expired

    # -- the seam --------------------------------------------------------------------------

    def sized(self) -> Work | None:
        """Workload sizing, once, when the first admission fact asks (from here on the
        request is sized: C02 no longer applies); None without a parsed body."""
        if self.work is None and self.order is not None:
            a, order = self.a, self.order
            a.books.sized(self.books)
            self.work = Work(
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
                only=order.only,
            )
        return self.work

    async def arrived(self) -> Refuse | None:
        return None  # decided in LocalDoor.arrive: a refused arrival never has an entry

    async def admit(self, order: Order | None, body: tuple[Refuse, ...] = ()) -> LocalLease | Refuse:
        return self.admit_now(order, body)

    def admit_now(self, order: Order | None, body: tuple[Refuse, ...] = ()) -> LocalLease | Refuse:
        """The rest of the table from where the arrival's walk stopped: the body rows that
        hold (`body`, the data plane's checks; `order` None when the body could not be
        parsed), then the admission rows over the sized request, then its place."""
        a = self.a
        self.now = now = a.clock.now()
        if (a.state.election.fenced(now) or a.state.election.standby(now)) and self.pos > answers.TABLE.index(E.R01):
            # R01's fact, read again: the router lost (or handed on) its authority while
            # the body arrived. The arrival's walk passed R01, so it stands above every
            # row still undecided: in the table's order it decides first.
            return Refuse(E.R01, fields={"reason": a.state.reason(now) or "fenced"})
        self.order, self.body = order, body
        got = self.step(answers.ADMISSION)
        if got is None and self.placed() is None:  # pragma: no cover - no body: a body row holds
            raise AssertionError("admitted without a parsed body")
        try:
            if got is not None:
                return got
            d = self.pl.commit()  # type: ignore[union-attr]
        finally:
            if a.scheduler.evicted:  # R11 with tenants: a queued request yielded its place
                a.settle_evicted()
            _wake_granted(a)
        assert order is not None
        self.lease = LocalLease(a, d, order)
        if self.held:  # its place may be handed on while it waits (take_http_retention_full)
            a.retained[d.ticket.id] = self
        return self.lease

    def end(self, cls: str) -> None:
        if self.ended:
            return
        self.ended = True
        a = self.a
        if self.lease is not None and not self.lease.closed:
            self.lease.close(Outcome(at=a.clock.now()))
        if self.held:
            a.held -= 1
            if self.lease is not None:
                a.retained.pop(self.lease.t.id, None)
        a.books.end(self.books, cls)
        if self.counted:  # its output charged as counted; nothing produced: the prompt refunded
            out = self.lease.output_tokens if self.lease is not None else None
            a.quotas.end(self.tenant, a.clock.now(), charged_prompt=self.charged, output_tokens=out)  # type: ignore[union-attr]
        elif self.charged and self.tenant is not None:  # charged, never counted in flight (an order that puts R19 above R17)
            b = a.quotas.book(self.tenant, a.clock.now())  # type: ignore[union-attr]
            if b.tokens is not None:
                b.tokens.refund(self.charged)


class LocalDoor:
    """The data plane's door to this authority, in the same process."""

    __slots__ = ("a",)

    def __init__(self, a: Authority) -> None:
        self.a = a

    async def arrive(self, at: float, denied: Refuse | None = None, tenant: str | None = None) -> LocalEntry | Refuse:
        """C01 (offered), then the head-stage rows in the table's order (R01, the data
        plane's `denied` R15/R16, the tenant's R17/R18, R02), before the body is read."""
        return self.arrive_now(at, denied, tenant)

    def arrive_now(self, at: float, denied: Refuse | None = None, tenant: str | None = None) -> LocalEntry | Refuse:
        a = self.a
        q = a.quotas
        books = a.books.offer(q.label(tenant) if q is not None else None)
        # tenants configured: its quota book (R17-R19); without auth the tenant default
        e = LocalEntry(a, books, (tenant or DEFAULT) if q is not None and denied is None else None, at, denied)
        got = e.step(answers.HEAD)
        if got is not None:  # refused at arrival: nothing taken, the books closed here
            a.books.end(books, got.row.counter)
            return got
        return e
