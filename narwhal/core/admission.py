"""Admission and placement: the phase slots, and the scheduler's refusal rows, sans-IO.

Rules
  * `admit` walks the admission-stage rows of the refusal table (R08 prompt alone over
    budget, R09 no eligible engine, R10 projected TTFT over budget, R20 the tenant's
    queue, R11 queue full, R14 projected TPOT) in the table's order over the request's
    placement (core/placement.py, which computes their facts), then places it:
    dispatched at once when its engine has a free slot, else queued on that engine.
  * R12/R13 are temporal: `expiry(ticket, now)` walks the wait-stage rows for a waiting
    ticket, in the table's order (R12 first when both have expired, as it orders them).
  * `admission: open` skips R08 and R10 and places on the least-loaded engine.
  * Phase slots (admission.phase_concurrency) are per engine per phase. A unified engine
    request holds a prefill slot until its first token and a decode slot until it ends;
    a P/D request holds a prefill slot on the prefill engine, then a decode slot on a
    decode engine, waiting FIFO for the decode slot after prefill.
  * P/D backpressure (both modes): a request starts its prefill only while the P/D
    requests past admission and not yet on a decode slot (prefilling, prefilled, or in
    the decode queue) number fewer than the free decode slots plus a reserve (a quarter
    of each decode engine's slots, at least one). Past that it waits in its phase-1
    queue, bounded by R11 and R12, so no prefill is spent on a request that would then
    expire waiting for a decode slot; the reserve keeps a prefilled request ready for
    every decode slot that frees.
  * Fair reserve (tenants configured; core/fairness.py FairReserve, R02/R11 fairness,
    issue 40 item 6): the heaviest tenant on an engine (its recent dispatches per weight)
    may not take its last k free phase-1 slots while another tenant is active; a request
    that may not queues, and a grant pass serves the best eligible tenant by start tag.
    None (no tenants): nothing counted, work-conserving as before. With it, fair
    preemption (core/preempt.py `check`) after every grant pass and every request queued.
  * Queue limit: admission.queue_limit counts requests waiting for their first phase.
    Requests waiting for a decode slot after prefill are already admitted; they are
    counted (queue depth gauge) but never refused for it.
Theory of operation: the HTTP shell holds one `Ticket` per admitted request, awaits a
grant when queued, and reports phase ends (`first_token`, `prefill_done`, `finish`).
Every call that frees a slot returns the `Dispatch` grants it made possible; the shell
wakes those waiters. Nothing here blocks, sleeps or reads a clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from collections.abc import Set as AbstractSet
from typing import Any

from narwhal_generated import errors as E

from . import refusals as answers
from .fairness import FairReserve, Weights
from .fleet import PHASE1_ROLES, EngineState
from .placement import Placement, place, retry_place
from .prediction import Margin, OutputLengthLearner
from .preempt import Preempt, check
from .prefix import PrefixIndex
from .refusals import ADMISSION, WAIT
from .tickets import Dispatch, Enqueued, Refuse, Ticket, Work

__all__ = ["Scheduler"]


class _Waiting:
    """A waiting ticket's wait-stage facts (R12, R13)."""

    __slots__ = ("t", "now", "waited")

    def __init__(self, t: Ticket, now: float, waited: float) -> None:
        self.t, self.now, self.waited = t, now, waited

    def admission_wait_expired(self, row: E.ErrorRow) -> Refuse | None:
        return Refuse(row) if self.t.waiting and self.waited >= self.t.work.max_wait_s else None

    def deadline_expired(self, row: E.ErrorRow) -> Refuse | None:
        w = self.t.work
        return Refuse(row) if w.deadline_s is not None and self.now - w.arrival >= w.deadline_s else None


class Scheduler:
    def __init__(
        self,
        engines: Iterable[EngineState],
        *,
        mode: str = "predictive",
        queue_limit: int = 256,
        maintenance_waves: set[str] | None = None,
        margin: Margin | None = None,
        output_lengths: OutputLengthLearner | None = None,
        tpot_budget_ms: float | None = None,
        prefix: dict[str, PrefixIndex] | None = None,
        weights: Weights | None = None,
        tenant_queue_limit: Callable[[str | None], int | None] | None = None,
        fair_reserve: float | None = None,
        fair_preempt: bool = False,
    ) -> None:
        self.engines: dict[str, EngineState] = {e.name: e for e in engines}
        # phase-1 engines' prefix caches as the router knows them (core/prefix.py); empty:
        # prefill is projected at full prompt length
        self.prefix: dict[str, PrefixIndex] = prefix or {}
        self.mode = mode
        self.queue_limit = queue_limit
        self.maintenance_waves = maintenance_waves if maintenance_waves is not None else set()
        self.margin = margin or Margin()
        self.output_lengths = output_lengths or OutputLengthLearner()
        self.tpot_budget_ms = tpot_budget_ms  # R14: the decode-side check, off when None
        # tenants' weights (core/fairness.py; tenants.NAME.weight): every engine's phase-1
        # queue serves them so, and the projection counts the work a newcomer of a tenant
        # waits behind in that order
        self.weights: Weights = weights or (lambda tenant: 1.0)
        self.tenant_queue_limit = tenant_queue_limit  # R20: tenants.NAME.queue_limit, None: no such limits
        # the fair reserve (admission.fair_reserve, tenants configured): None, no count kept
        self.fair = FairReserve(self.weights, fair_reserve, fair_preempt) if fair_reserve is not None else None
        self.preempts: list[Preempt] = []  # decisions of core/preempt.py: the caller tells the data planes
        self.granted: list[Dispatch] = []  # grants a placement made to waiters (the fair reserve): the caller wakes them
        self.evicted: list[tuple[Ticket, Refuse]] = []  # R11: queued tickets that yielded to a tenant under its share
        self.decode_queue: deque[Ticket] = deque()
        self.queued = 0  # phase-1 waiters over all engines
        self.pd_pending = 0  # P/D tickets past prefill dispatch and not on a decode slot
        self._next_id = 0
        self._phase1: list[EngineState] = []
        self._decoders: list[EngineState] = []
        self._prefillers: list[EngineState] = []
        self._roles()

    # -- membership (spec/tables/lifecycle.yaml) ----------------------------------------

    def _roles(self) -> None:
        for e in self.engines.values():
            e.queue.weights = self.weights
        self._phase1 = [e for e in self.engines.values() if e.role in PHASE1_ROLES]
        self._decoders = [e for e in self.engines.values() if e.role == "decode"]
        self._prefillers = [e for e in self._phase1 if e.role == "prefill"]

    def add(self, e: EngineState, index: PrefixIndex | None = None) -> None:
        """A new engine (lifecycle joining: not placeable until M01)."""
        if e.name in self.engines:
            raise ValueError(f"engine {e.name!r} is already in the scheduler")
        self.engines[e.name] = e
        if index is not None:
            self.prefix[e.name] = index
        self._roles()

    def remove(self, name: str) -> EngineState:
        """Release an engine (M04, M29): it must hold nothing (no slot, no queue), so no
        ticket names it any more but in `excluded` sets, where a name is harmless."""
        e = self.engines[name]
        if not e.holds_nothing():
            raise ValueError(f"engine {name!r} still holds requests")
        if self.fair is not None and self.fair.held(name):  # pragma: no cover - its slots are all free
            raise AssertionError(f"engine {name!r}: the fair reserve counts slots it does not hold")
        if self.fair is not None:
            self.fair.forget(name)
        del self.engines[name]
        self.prefix.pop(name, None)
        self._roles()
        return e

    # -- views -----------------------------------------------------------------------

    def eligible(self, e: EngineState) -> bool:
        return e.eligible(self.maintenance_waves)

    def decode_room(self) -> bool:
        """P/D backpressure: may another request start its prefill? (module rules)"""
        room = 0
        for d in self._decoders:
            if self.eligible(d):
                room += max(0, d.decode_slots - d.decode_in_use - d.external) + max(1, d.decode_slots // 4)
        return self.pd_pending < room

    def _phase1_free(self, e: EngineState) -> bool:
        return e.phase1_free() and (e.role != "prefill" or self.decode_room())

    def may_take(self, e: EngineState, tenant: str | None, now: float) -> bool:
        """The fair reserve lets `tenant` take a free phase-1 slot of `e` (module rules)."""
        return self.fair is None or self.fair.may_take(e, tenant, now)

    def _let_go(self, t: Ticket) -> None:
        if self.fair is not None:  # the fair reserve's count follows the slots it held
            self.fair.settle(t)

    def _decode_candidates(self, exclude: AbstractSet[str]) -> list[EngineState]:
        return [d for d in self._decoders if d.name not in exclude and self.eligible(d)]

    def _decode_start_ms(self, n: float, decoders: list[EngineState]) -> tuple[float, float]:
        """(KV transfer + decode first token on the best decode engine plus its slot wait,
        the same without the wait). The wait is load, not the prompt: it belongs to R10's
        projection (with Retry-After), never to R08's "the prompt alone"."""
        best = alone = None
        for d in decoders:
            wait = 0.0
            if not d.decode_free():
                # one decode slot frees, on average, every (expected decode time / slots)
                out = self.output_lengths.predict("any", n, None)
                wait = (len(self.decode_queue) + 1) * out * d.decode.predict_ms(d.decode_in_use) / d.decode_slots
            s = d.decode_start_ms(n)
            if best is None or s + wait < best:
                best = s + wait
            if alone is None or s < alone:
                alone = s
        return best or 0.0, alone or 0.0

    @staticmethod
    def _slot_wait_ms(e: EngineState, out_len: float) -> float:
        """A unified engine with every slot taken: until a slot frees for a new request,
        each request ahead (in flight or queued) decodes about out_len tokens at the
        engine's TPOT, `decode_slots` at a time (their prefills are in the backlog)."""
        return (len(e.queue) + 1) * out_len * e.decode.predict_ms(float(e.decode_in_use + e.external)) / e.decode_slots

    def _mean_depth(self) -> float:
        """Requests prefilling or queued per placement-eligible phase-1 engine."""
        k = depth = 0
        for e in self._phase1:
            if self.eligible(e):
                k += 1
                depth += len(e.inflight_prefill) + len(e.queue)
        return depth / k if k else 0.0

    def project(self, n: float, now: float) -> list[tuple[float, float, EngineState]]:
        """(projected TTFT ms, solo TTFT ms, engine) for every eligible phase-1 engine."""
        decoders = self._decode_candidates(set())
        start, alone = self._decode_start_ms(n, decoders) if decoders else (0.0, 0.0)
        out = []
        for e in self._phase1:
            if not self.eligible(e):
                continue
            if e.role == "prefill" and not decoders:
                continue
            pf = e.prefill.predict_ms(n)
            extra, solo_extra = (start, alone) if e.role == "prefill" else (0.0, 0.0)
            if e.role == "unified" and e.decode_in_use + e.external >= e.decode_slots:
                extra = self._slot_wait_ms(e, self.output_lengths.predict("any", n, None))
            out.append((e.backlog_ms(now) + pf + extra, pf + solo_extra, e))
        return out

    # -- admission -------------------------------------------------------------------

    def place(self, work: Work, now: float) -> Placement:
        """The best engine for `work` and the admission rows' facts over it
        (core/placement.py); nothing taken until `Placement.commit`."""
        return place(self, work, now)

    def admit(self, work: Work, now: float) -> Dispatch | Enqueued | Refuse:
        """The admission-stage rows (R08-R11, R14, R20) in the refusal table's order over
        the request's placement, then its place (R19 is the door's: authority/door.py
        walks the whole table, this the scheduler's rows alone)."""
        pl = place(self, work, now)
        refused = answers.TABLE.first_at(ADMISSION, pl)
        if refused is not None:
            return refused
        pl.take_admission_queue_full()
        return pl.commit()

    def _enqueue(self, t: Ticket, engine: EngineState, now: float, first: bool = False) -> Enqueued:
        """Queue `t` on `engine` (`first`: first among its tenant's, core/preempt.py)."""
        t.state = "queued"
        t.engine = engine.name
        t.enqueued_at = now
        (engine.queue.push_front if first else engine.queue.append)(t)
        engine.queued_work_ms += t.pred_prefill_ms
        self.queued += 1
        check(self, engine, now)  # fair preemption (core/preempt.py): a lighter tenant waits
        return Enqueued(t, engine.name)

    def reserve(self, engine: str, work: Work, now: float) -> Dispatch | Enqueued:
        """A phase-1 slot on one named engine for the router's own traffic (profiling an
        engine whose engines[].max_concurrency is set, so that it never overlaps client
        requests past that limit): no refusal row applies; it waits FIFO with client
        requests and is ended with `finish` like them."""
        e = self.engines[engine]
        t = Ticket(self._next_id, work)
        self._next_id += 1
        t.pred_prefill_ms = e.prefill.predict_ms(work.prompt_tokens)
        if self._phase1_free(e) and not e.queue and self.may_take(e, work.tenant, now):
            return self._dispatch1(t, e, now)
        return self._enqueue(t, e, now)

    def _dispatch1(self, t: Ticket, e: EngineState, now: float) -> Dispatch:
        if t.enqueued_at is not None:
            t.waited += now - t.enqueued_at
            t.enqueued_at = None
        t.engine = e.name
        t.state = "unified" if e.role == "unified" else "prefill"
        e.prefill_in_use += 1
        t.holds_prefill = e.name
        if self.fair is not None:
            self.fair.took(t, e.name, now)
        if e.role == "unified":
            e.decode_moved(now, 1)
            t.holds_decode = e.name
        elif not t.pd_pending:
            t.pd_pending = True
            self.pd_pending += 1
        t.prefill_dispatched_at = now
        if t.work.prefix:
            idx = self.prefix.get(e.name)
            if idx is not None and not idx.token:  # the engine holds the prompt's blocks once it has prefilled
                idx.insert(t.work.prefix)
        e.busy_until = max(e.busy_until, now) + t.pred_prefill_ms / 1000.0
        e.inflight_prefill[t.id] = t.pred_prefill_ms
        # no back-reference from the ticket: a Dispatch<->Ticket cycle per request left
        # four objects each for the cyclic collector (stalls of 30-100 ms at 10,000/s)
        return Dispatch(t, e.name, t.state)

    # -- expiry (R12, R13) ---------------------------------------------------------------

    @staticmethod
    def waited_s(t: Ticket, now: float) -> float:
        """The admission wait so far: every queue the ticket sat in (phase 1 and the
        decode-slot queue), the current one included (R12's clock)."""
        return t.waited + (now - t.enqueued_at if t.enqueued_at is not None else 0.0)

    def expiry(self, t: Ticket, now: float) -> E.ErrorRow | None:
        """The first wait-stage row (R12, R13) that has expired for `t` at `now`, in the
        refusal table's order."""
        got = answers.TABLE.first_at(WAIT, _Waiting(t, now, self.waited_s(t, now)))
        return None if got is None else got.row

    def time_left(self, t: Ticket, now: float) -> float:
        """Seconds until the first of R12/R13 can expire for a waiting ticket."""
        waited = self.waited_s(t, now)
        left = t.work.max_wait_s - waited
        if t.work.deadline_s is not None:
            left = min(left, t.work.deadline_s - (now - t.work.arrival))
        return max(0.0, left)

    # -- phase events ----------------------------------------------------------------

    def _prefill_measured(self, t: Ticket, e: EngineState, now: float, ok: bool) -> None:
        pred = e.inflight_prefill.pop(t.id, None)
        if pred is None:
            return
        start = max(t.prefill_dispatched_at or now, e.last_prefill_done)
        # departure identity for an FCFS engine: svc = finish - max(dispatch, previous finish)
        svc_ms = (now - start) * 1000.0
        e.last_prefill_done = now
        e.busy_until = now + sum(e.inflight_prefill.values()) / 1000.0
        if ok and svc_ms > 0:
            if (t.work.prefix or t.work.token_prefix) and e.name in self.prefix:
                t.prefill_sample = (e.name, svc_ms)  # learned at close, on the uncached tokens (learn)
            else:
                e.prefill.observe(t.work.prompt_tokens, svc_ms)

    def first_token(self, t: Ticket, now: float) -> list[Dispatch]:
        """The client's first token arrived (unified engine, or decode after P/D)."""
        if t.projected_ttft_ms is not None:
            self.margin.observe(t.depth, (now - t.work.arrival) * 1000.0, t.projected_ttft_ms)
            t.projected_ttft_ms = None
        if t.holds_decode is not None:  # TPOT is measured from here: its batch too
            d = self.engines[t.holds_decode]
            t.decode_mark = (d, d.decode_area_at(now), now)
        if t.state == "unified" and t.holds_prefill is not None:
            e = self.engines[t.holds_prefill]
            self._prefill_measured(t, e, now, True)
            e.prefill_in_use -= 1
            t.holds_prefill = None
            return self._grant_phase1(e, now)
        if t.state == "decode" and t.decode_dispatched_at is not None and t.holds_decode is not None:
            d = self.engines[t.holds_decode]
            d.start_model.update([1.0, t.work.prompt_tokens / 1000.0], (now - t.decode_dispatched_at) * 1000.0)
        return []

    def prefill_done(self, t: Ticket, now: float, *, ok: bool) -> list[Dispatch]:
        """The prefill leg of a P/D request ended (ok: the engine answered)."""
        if t.holds_prefill is None:
            return []
        e = self.engines[t.holds_prefill]
        self._prefill_measured(t, e, now, ok)
        e.prefill_in_use -= 1
        t.holds_prefill = None
        self._let_go(t)
        return self._grant_phase1(e, now)

    def want_decode(self, t: Ticket, now: float) -> Dispatch | Enqueued | Refuse:
        """P/D phase 2: a decode slot on an eligible decode engine (not one in t.excluded)."""
        cands = self._decode_candidates(t.excluded)
        if not cands:
            return Refuse(E.R09, fields={"phase": "decode"})
        free = [d for d in cands if d.decode_free()]
        if free and not self.decode_queue:
            d = min(free, key=lambda x: x.decode_in_use / x.decode_slots)
            return self._dispatch_decode(t, d, now)
        t.state = "decode_queued"
        t.enqueued_at = now
        self.decode_queue.append(t)
        return Enqueued(t, None)

    def _dispatch_decode(self, t: Ticket, d: EngineState, now: float) -> Dispatch:
        if t.enqueued_at is not None:
            t.waited += now - t.enqueued_at
            t.enqueued_at = None
        d.decode_moved(now, 1)
        t.holds_decode = d.name
        if t.pd_pending:
            t.pd_pending = False
            self.pd_pending -= 1
        t.decode_engine = d.name
        t.state = "decode"
        t.decode_dispatched_at = now
        return Dispatch(t, d.name, "decode")

    def decode_failed(self, t: Ticket, now: float) -> list[Dispatch]:
        """A decode attempt failed before response headers: free its slot and exclude the
        engine from the retry (T05: once, on another eligible decode engine)."""
        grants: list[Dispatch] = []
        freed: list[EngineState] = []
        if t.holds_prefill is not None:  # a unified engine that failed before its first token
            e = self.engines[t.holds_prefill]
            e.inflight_prefill.pop(t.id, None)
            e.busy_until = min(e.busy_until, now + sum(e.inflight_prefill.values()) / 1000.0)
            e.prefill_in_use -= 1
            t.holds_prefill = None
            t.exclude(e.name)
            freed.append(e)
        if t.holds_decode is not None:
            d = self.engines[t.holds_decode]
            t.exclude(d.name)
            d.decode_moved(now, -1)
            t.holds_decode = None
            if d.role == "decode":  # back to waiting for a decode slot (T05's retry)
                t.pd_pending = True
                self.pd_pending += 1
            grants += self._grant_decode(now)
            if d.role == "unified" and d not in freed:
                freed.append(d)
        self._let_go(t)
        for e in freed:
            grants += self._grant_phase1(e, now)
        return grants + self._grant_prefill(now)

    def has_retry_decoder(self, t: Ticket) -> bool:
        return bool(self._decode_candidates(t.excluded))

    def retry_unified(self, t: Ticket, now: float) -> Dispatch | Enqueued | None:
        """T05 (and a stream migration's continuation) on a unified fleet: another eligible
        unified engine, at once or queued (core/placement.py retry_place); None: none."""
        return retry_place(self, t, now)

    def finish(self, t: Ticket, now: float) -> list[Dispatch]:
        """The request ended (any way): free everything it holds, leave every queue."""
        grants: list[Dispatch] = []
        if t.state == "queued" and t.engine is not None:
            e = self.engines[t.engine]
            try:
                e.queue.remove(t)
                e.queued_work_ms = max(0.0, e.queued_work_ms - t.pred_prefill_ms)
                self.queued -= 1
            except ValueError:
                pass
        elif t.state == "decode_queued":
            try:
                self.decode_queue.remove(t)
            except ValueError:
                pass
        if t.holds_prefill is not None:
            e = self.engines[t.holds_prefill]
            e.inflight_prefill.pop(t.id, None)
            e.busy_until = min(e.busy_until, now + sum(e.inflight_prefill.values()) / 1000.0)
            e.prefill_in_use -= 1
            t.holds_prefill = None
            self._let_go(t)
            grants += self._grant_phase1(e, now)
        if t.pd_pending:
            t.pd_pending = False
            self.pd_pending -= 1
        if t.holds_decode is not None:
            d = self.engines[t.holds_decode]
            d.decode_moved(now, -1)
            t.holds_decode = None
            self._let_go(t)
            grants += self._grant_decode(now)
            if d.role == "unified":
                grants += self._grant_phase1(d, now)
        if self.pd_pending or self.decode_queue or any(e.queue for e in self._prefillers):
            grants += self._grant_prefill(now)
        t.state = "done"
        return grants

    # -- grants --------------------------------------------------------------------------

    def _grant_phase1(self, e: EngineState, now: float) -> list[Dispatch]:
        grants = []
        fair = self.fair if self.fair is not None and self.fair.fraction > 0 else None
        while e.queue and self._phase1_free(e) and self.eligible(e):
            if fair is None:
                t = e.queue.popleft()
            else:  # the best tenant by start tag that the fair reserve lets take the slot
                t = e.queue.pop_eligible(lambda u: fair.may_take(e, u, now))  # noqa: B023 - used in this turn
                if t is None:
                    break
            e.queued_work_ms = max(0.0, e.queued_work_ms - t.pred_prefill_ms)
            self.queued -= 1
            grants.append(self._dispatch1(t, e, now))
        if fair is not None and e.queue:
            check(self, e, now)  # fair preemption (core/preempt.py): a lighter tenant still waits
        return grants

    def _grant_prefill(self, now: float) -> list[Dispatch]:
        """Decode room may have opened (P/D backpressure): the prefill engines' queues."""
        grants: list[Dispatch] = []
        for e in self._prefillers:
            if e.queue:
                grants += self._grant_phase1(e, now)
        return grants

    def _grant_decode(self, now: float) -> list[Dispatch]:
        grants = []
        i = 0
        while i < len(self.decode_queue):
            t = self.decode_queue[i]
            free = [d for d in self._decode_candidates(t.excluded) if d.decode_free()]
            if not free:
                i += 1
                if all(not d.decode_free() for d in self._decoders):
                    break
                continue
            del self.decode_queue[i]
            d = min(free, key=lambda x: x.decode_in_use / x.decode_slots)
            grants.append(self._dispatch_decode(t, d, now))
        return grants

    def reconcile(self, now: float) -> tuple[list[Dispatch], list[tuple[Ticket, Refuse]]]:
        """After eligibility changed: move waiters off ineligible engines (R09 when no
        engine is left for them) and grant whatever capacity is free."""
        grants: list[Dispatch] = []
        refused: list[tuple[Ticket, Refuse]] = []
        for e in self._phase1:
            if self.eligible(e) or not e.queue:
                continue
            moving = list(e.queue)
            e.queue.clear()
            e.queued_work_ms = 0.0
            self.queued -= len(moving)
            for t in moving:
                cands = self.project(t.work.prompt_tokens, now)
                if not cands:
                    t.state = "done"
                    refused.append((t, Refuse(E.R09, fields={"phase": "prefill"})))
                    continue
                _, _, tgt = min(cands, key=lambda c: c[0])
                t.engine = tgt.name
                t.pred_prefill_ms = tgt.prefill.predict_ms(t.work.prompt_tokens)
                tgt.queue.append(t)
                tgt.queued_work_ms += t.pred_prefill_ms
                self.queued += 1
        if self.decode_queue and not self._decode_candidates(set()):
            for t in list(self.decode_queue):
                t.state = "done"
                refused.append((t, Refuse(E.R09, fields={"phase": "decode"})))
            self.decode_queue.clear()
        for e in self._phase1:
            grants += self._grant_phase1(e, now)
        grants += self._grant_decode(now)
        return grants, refused

    def learn(self, t: Ticket, cached_tokens: int | None) -> None:
        """The request ended; the engine reported `cached_tokens` of its prompt cached
        (None: not reported). The prefill sample is learned on the uncached tokens, and
        the prefix index follows the engine's capacity (core/prefix.py)."""
        w = t.work
        sample, t.prefill_sample = t.prefill_sample, None
        idx = self.prefix.get(t.engine) if t.engine is not None else None
        if cached_tokens is None and idx is not None and idx.reports:
            cached_tokens = 0  # an engine that reports cached tokens leaves a zero out (vLLM)
        cached = float(cached_tokens) if cached_tokens is not None else t.expected_cached
        if sample is not None:
            self.engines[sample[0]].prefill.observe(max(1.0, w.prompt_tokens - cached), sample[1])
        if cached_tokens is not None and idx is not None:
            idx.reports = True
        # an index fed by events is the engine's own word: only an approximate one follows reports
        if cached_tokens is not None and w.prefix and w.block_tokens > 0 and idx is not None and not idx.token:
            idx.trusted = True
            idx.correct(round(t.expected_cached / w.block_tokens), int(cached_tokens // w.block_tokens))

    def refuse_waiting(self, refusal: Refuse) -> list[tuple[Ticket, Refuse]]:
        """Every ticket waiting in a queue (phase 1 or a decode slot) leaves it with
        `refusal` (a router that lost its authority grants nothing more: L14 note)."""
        refused: list[tuple[Ticket, Refuse]] = []
        for e in self._phase1:
            for t in e.queue:
                t.state = "done"
                refused.append((t, refusal))
            e.queue.clear()
            e.queued_work_ms = 0.0
        self.queued = 0
        for t in self.decode_queue:
            t.state = "done"
            if t.pd_pending:
                t.pd_pending = False
                self.pd_pending -= 1
            refused.append((t, refusal))
        self.decode_queue.clear()
        return refused

    def snapshot(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "queued": self.queued,
            "queue_limit": self.queue_limit,
            "decode_queued": len(self.decode_queue),
            "margin": self.margin.snapshot(),
            "output_length": self.output_lengths.snapshot(),
        }
