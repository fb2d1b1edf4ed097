"""One request's placement, and the admission rows' facts over it, sans-IO.

`place(scheduler, work, now)` makes one pass over the phase-1 engines (the hot path of
every admission: ~64 engines must cost well under 20 us), computing per eligible engine
its solo TTFT (R08), its projected TTFT (R10) and the placement key; the `Placement` it
returns answers the admission-stage predicates of the refusal table (R08, R09, R10, R20,
R11, R14), each looking only (core/refusals.py walks them in the table's order), and
`commit()` takes the place once no row refused: dispatched at once when its engine has a
free slot, else queued on it (R11 with tenants: a queued request of the tenant furthest
over its share yields its place first, `take_admission_queue_full`).

Projection (predictive mode), for each eligible phase-1 engine e:
    TTFT(e) = backlog_e + prefill_e(n) [+ start_d(n) + decode wait, when e is a prefill
    engine: the KV transfer and the decode engine's first token]
R08 if min_e (prefill_e(n) [+ start_d(n)]) * m(0) > budget; R10 if the chosen engine's
TTFT * m(depth_e) > budget, with Retry-After max(1, round(overrun s)). R14 (decode side,
admission.prediction.tpot_budget_ms): the projected TPOT of the batch the request will
join on its decode engine exceeds that budget.
"""

from __future__ import annotations

from typing import Any

from narwhal_generated import errors as E

from . import refusals as answers
from .fleet import EngineState
from .prediction import DEPTH_BUCKET_OF
from .prefix import PrefixIndex
from .tickets import Dispatch, Enqueued, Refuse, Ticket, Work

# core/admission.py's Scheduler, whose slots and queues a placement reads and commits to
# (it imports this module: naming its class here would close an import circle)
Scheduler = Any

__all__ = ["Placement", "place", "expected_cached", "project_tpot", "retry_place", "retry_rank"]

_BUCKET = DEPTH_BUCKET_OF  # queue depth -> margin bucket, for depths below _NB
_NB = len(DEPTH_BUCKET_OF)


def expected_cached(idx: PrefixIndex, work: Work, n: float) -> float:
    """The prompt tokens an engine's prefix cache is expected to hold (refusals.yaml R10
    note: prefill is projected on the tokens it is expected not to hold; at least one is
    computed). Token-keyed index: the engine computes at least the last token and reuses
    whole blocks only, so at most the whole blocks of the first n - 1 tokens."""
    if idx.token:
        bt = idx.block_tokens or 1.0
        return min((n - 1.0) // bt * bt, idx.match(work.token_prefix) * bt)
    return min(n - 1.0, idx.match(work.prefix) * work.block_tokens)


class Placement:
    """The best phase-1 engine for one request (None: no eligible engine) and the facts
    of the admission rows over it."""

    __slots__ = ("s", "work", "now", "engine", "proj", "m", "min_solo", "cached", "weight", "predictive", "_victim", "_free")

    def __init__(self, s: Scheduler, work: Work, now: float, engine: EngineState | None, proj: float, m: float,
                 min_solo: float, cached: float, weight: float) -> None:
        self.s, self.work, self.now = s, work, now
        self.engine, self.proj, self.m, self.min_solo, self.cached, self.weight = engine, proj, m, min_solo, cached, weight
        self.predictive = s.mode == "predictive"
        self._victim: Any = False  # not looked for yet
        self._free: bool | None = None

    @property
    def free(self) -> bool:
        """Its engine has a free phase-1 slot for it: no queue, or (the fair reserve on)
        one this request may take (looked at once: nothing changes the engine until
        `commit`)."""
        f = self._free
        if f is None:
            e = self.engine
            s = self.s
            # with the fair reserve on, a queued tenant that may not take a free slot does
            # not keep it from a newcomer who may (every grant pass leaves no queued ticket
            # that may take a free slot: core/fairness.py FairReserve; R02/R11 fairness,
            # issue 40 item 6); off, the queue goes first as before
            f = self._free = e is not None and s._phase1_free(e) and (
                not e.queue if s.fair is None or s.fair.fraction <= 0 else s.fair.may_take(e, self.work.tenant, self.now))
        return f

    # -- facts (spec/tables/refusals.yaml, stage admission) ------------------------------

    def tenant_token_rate_exceeded(self, row: E.ErrorRow) -> Refuse | None:
        return None  # R19 is the door's (the tenant's books); the scheduler charges nothing

    def prompt_alone_exceeds_budget(self, row: E.ErrorRow) -> Refuse | None:
        """R08: the prompt alone, on its best engine, with the depth-0 margin (false with
        no eligible engine: R09 decides then)."""
        if not self.predictive or self.engine is None:
            return None
        solo_m = self.min_solo * self.s.margin.factors[0]
        if solo_m <= self.work.budget_ms:
            return None
        return Refuse(row, fields={"projected_ms": round(solo_m), "budget_ms": round(self.work.budget_ms)})

    def no_eligible_engine(self, row: E.ErrorRow) -> Refuse | None:
        """R09."""
        if self.engine is not None:
            return None
        s = self.s
        phase = "decode" if any(e.role == "prefill" and s.eligible(e) for e in s._phase1) else "prefill"
        return Refuse(row, fields={"phase": phase})

    def projected_ttft_over_budget(self, row: E.ErrorRow) -> Refuse | None:
        """R10: on the chosen engine, times its margin."""
        p, budget = self.proj * self.m, self.work.budget_ms
        if not self.predictive or self.engine is None or p <= budget:
            return None
        over = (p - budget) / 1000.0
        return Refuse(row, overrun_s=over, fields={"projected_ms": round(p), "budget_ms": round(budget),
                                                   "retry_after": answers.retry_after_seconds(row, over)})

    def tenant_queue_full(self, row: E.ErrorRow) -> Refuse | None:
        """R20: a request that would queue, its tenant at tenants.NAME.queue_limit."""
        s, tenant = self.s, self.work.tenant
        if self.engine is None or s.tenant_queue_limit is None or self.free:
            return None
        tl = s.tenant_queue_limit(tenant)
        if tl is None or sum(e.queue.queued(tenant) for e in s._phase1) < tl:
            return None
        return Refuse(row, fields={"tenant": tenant or "default", "limit": tl})

    def admission_queue_full(self, row: E.ErrorRow) -> Refuse | None:
        """R11: a request that would queue, the queue at admission.queue_limit, and no
        tenant over its share to yield a place to it."""
        s = self.s
        if self.engine is None or self.free or s.queued < s.queue_limit or self.victim() is not None:
            return None
        return Refuse(row, fields={"limit": s.queue_limit})

    def take_admission_queue_full(self) -> None:
        """The place R11 let it have: a queued request of the tenant furthest over its
        share yields it (refused R11, `Scheduler.evicted`)."""
        s = self.s
        if self.engine is None or self.free or s.queued < s.queue_limit:
            return
        v = self.victim()
        if v is not None:
            e, t = v
            e.queue.remove(t)
            e.queued_work_ms = max(0.0, e.queued_work_ms - t.pred_prefill_ms)
            s.queued -= 1
            t.state = "done"
            s.evicted.append((t, Refuse(E.R11, fields={"limit": s.queue_limit})))

    def projected_tpot_over_budget(self, row: E.ErrorRow) -> Refuse | None:
        """R14: the projected TPOT where the request will decode exceeds the TPOT budget."""
        s, budget = self.s, self.s.tpot_budget_ms
        if not self.predictive or budget is None or self.engine is None:
            return None
        proj = project_tpot(s, self.engine)
        if proj is None or proj[0] <= budget:
            return None
        tp, b, d = proj
        a, slope = d.decode.lin.theta
        b_ok = (budget / d.decode.drift.correction - a) / slope if slope > 0 else 0.0
        excess = max(1.0, b - max(0.0, b_ok))
        out = s.output_lengths.predict(self.work.route, self.work.prompt_tokens, self.work.max_tokens)
        # sequences finish at about b / (output length x TPOT): the excess drains in
        over_s = excess * out * tp / max(b, 1.0) / 1000.0
        return Refuse(row, overrun_s=over_s, fields={"projected_ms": round(tp, 1), "budget_ms": budget,
                                                     "retry_after": answers.retry_after_seconds(row, over_s)})

    def admission_wait_expired(self, row: E.ErrorRow) -> Refuse | None:
        return None  # nothing has waited at admission (R12 is decided in the wait)

    deadline_expired = admission_wait_expired  # R13 likewise

    # -- the place -----------------------------------------------------------------------

    def victim(self) -> tuple[EngineState, Ticket] | None:
        """R11 with tenants (refusals.yaml R11 note): when the arriving tenant would hold
        less of the full queue per weight than the tenant furthest over its share, that
        tenant's newest queued request (engine, ticket); looked for once."""
        if self._victim is False:
            self._victim = _victim(self.s, self.work.tenant, self.weight)
        return self._victim  # type: ignore[no-any-return]

    def commit(self) -> Dispatch | Enqueued:
        """The request's ticket, dispatched or queued on the chosen engine."""
        s, engine, work = self.s, self.engine, self.work
        assert engine is not None
        free = self.free
        t = Ticket(s._next_id, work)
        s._next_id += 1
        t.projected_ttft_ms = self.proj
        t.depth = engine.depth()
        t.expected_cached = self.cached
        t.pred_prefill_ms = engine.prefill.predict_ms(work.prompt_tokens - self.cached)
        if s.fair is not None:  # the fair reserve keeps slots for the tenants active lately
            s.fair.seen(work.tenant, self.now)
        got: Dispatch | Enqueued = s._dispatch1(t, engine, self.now) if free else s._enqueue(t, engine, self.now)
        if free and engine.queue and s.fair is not None:
            # a newcomer took a slot past waiters that may not (the fair reserve): its use
            # may make one of them no longer the heaviest, with a slot still free; the grant
            # pass keeps core/fairness.py's invariant, its grants woken by the caller
            s.granted += s._grant_phase1(engine, self.now)
        return got


def project_tpot(s: Scheduler, engine: EngineState) -> tuple[float, float, EngineState] | None:
    """(projected TPOT ms, batch it assumes, decode engine) for a request placed with
    `engine` as its first phase: the batch it will join when it reaches decode
    on the best eligible decode engine."""
    if engine.role == "unified":
        nb = float(engine.joining_batch())
        return engine.decode.predict_ms(nb), nb, engine
    decoders = s._decode_candidates(set())
    if not decoders:
        return None
    coming = len(s.decode_queue) + s.queued + sum(len(e.inflight_prefill) for e in s._phase1 if e.role == "prefill")
    share = coming / len(decoders)
    best: tuple[float, float, EngineState] | None = None
    for d in decoders:
        b = d.decode_in_use + share + 1
        tp = d.decode.predict_ms(b)
        if best is None or tp < best[0]:
            best = (tp, b, d)
    return best


def retry_rank(s: Scheduler, e: EngineState, work: Work, n: float) -> tuple[float, int, float]:
    """Where a request goes when its engine failed it (T05; a gateway's fallbacks too,
    core/reroute.py), smallest first: the projected prefill counting what `e`'s prefix
    cache is expected to hold of the prompt, within 10 ms a tie broken by the fewest
    requests on it; the exact projection last (what the ticket's prediction takes)."""
    idx = s.prefix.get(e.name) if (work.prefix or work.token_prefix) else None
    cached = expected_cached(idx, work, n) if idx is not None and idx.trusted else 0.0
    ms = e.prefill.predict_ms(n - cached)
    return (round(ms, -1), e.prefill_in_use + e.decode_in_use + e.external, ms)


def retry_place(s: Scheduler, t: Ticket, now: float) -> Dispatch | Enqueued | None:
    """T05 (and a stream migration's continuation, spec/tables/migration.yaml) on a
    unified fleet: another eligible unified engine with a free slot this request may take
    (the fair reserve counts a retry like any request), at once — the one whose projected
    prefill is least, counting what its prefix cache is expected to hold of the prompt
    (as R10 projects); on a tie the one with the fewest requests on it, so the streams of
    one failed engine spread over the others. No free slot: it waits in the queue of the
    eligible engine with the least queued work (a slot frees at every first token;
    R12/R13 still bound the wait, the time it waited before counted). None: no other
    eligible unified engine at all."""
    best: tuple[tuple[float, int, float], EngineState] | None = None
    n = float(t.work.prompt_tokens)
    for e in s._phase1:
        if e.role == "unified" and e.name not in t.excluded and s.eligible(e) and e.phase1_free() and s.may_take(e, t.work.tenant, now):
            key = retry_rank(s, e, t.work, n)
            if best is None or key < best[0]:
                best = (key, e)
    if best is None:
        cands = [e for e in s._phase1 if e.role == "unified" and e.name not in t.excluded and s.eligible(e)]
        if not cands:
            return None
        e = min(cands, key=lambda c: (c.queued_work_ms, len(c.queue)))
        t.pred_prefill_ms = e.prefill.predict_ms(n)
        return s._enqueue(t, e, now)  # type: ignore[no-any-return]
    t.pred_prefill_ms = best[0][2]
    d: Dispatch = s._dispatch1(t, best[1], now)
    if best[1].queue and s.fair is not None:  # past waiters, as Placement.commit: the invariant kept
        s.granted += s._grant_phase1(best[1], now)
    return d


def _victim(s: Scheduler, tenant: str | None, weight: float) -> tuple[EngineState, Ticket] | None:
    load: dict[str | None, int] = {}
    newest: dict[str | None, tuple[float, EngineState, Ticket]] = {}
    for e in s._phase1:
        for t in e.queue:
            u = t.work.tenant
            load[u] = load.get(u, 0) + 1
            at = t.enqueued_at or 0.0
            if t.preempted is None and (u not in newest or at >= newest[u][0]):  # (a preempted one never yields: core/preempt.py)
                newest[u] = (at, e, t)
    if not load or (len(load) == 1 and tenant in load):
        return None
    victim = max(load, key=lambda u: load[u] / s.weights(u))
    if victim == tenant or victim not in newest or (load.get(tenant, 0) + 1) / weight >= load[victim] / s.weights(victim):
        return None
    _, e, t = newest[victim]
    return e, t


def place(s: Scheduler, work: Work, now: float) -> Placement:
    """The best engine for `work` (see the module's doc). The arithmetic is
    PrefillModel.predict_ms and EngineState.backlog_ms inlined."""
    n = work.prompt_tokens
    u = n / 1000.0
    uu = u * u
    waves = s.maintenance_waves
    decoders = s._decode_candidates(set()) if s._decoders else []
    start, alone = s._decode_start_ms(n, decoders) if decoders else (0.0, 0.0)
    predictive = s.mode == "predictive"
    # With R14 on, "the best projection" has two sides: among the engines whose
    # projected TTFT fits the budget, the one with the lowest projected TPOT (for a
    # unified engine, the batch it would join), then the lower TTFT; when none fits, the
    # lowest TTFT (R10 then refuses on it). A TTFT-only ranking ties on engines whose
    # prefill is idle and piles the decode batches onto one of them.
    tpot_rank = predictive and s.tpot_budget_ms is not None
    budget = work.budget_ms
    factors = s.margin.factors
    now_ms = now * 1000.0
    engine: EngineState | None = None
    best_key: Any = None
    proj, m, min_solo, best_cached, out_len = 0.0, 1.0, float("inf"), 0.0, None
    caches = s.prefix if (work.prefix or work.token_prefix) else None
    tenant = work.tenant
    wt = s.weights(tenant) if tenant is not None else 1.0
    behind = -1.0  # 1 + mean depth: counted once, when a cache first saves something
    only = work.only  # a gateway's subset hint: this request's eligibility restricted to it
    for e in s._phase1:
        if only is not None and e.name not in only:
            continue
        if not e.healthy or e.draining or e.breaker.opened_at is not None or (e.wave is not None and e.wave in waves):
            continue
        if e.role == "prefill":
            if not decoders:
                continue
            extra, solo_extra = start, alone
        else:
            extra = solo_extra = 0.0
            if e.decode_in_use + e.external >= e.decode_slots:
                # a unified engine whose slots are all taken (engines[].max_concurrency):
                # the request waits for the decodes ahead of it, not only their prefills
                if out_len is None:
                    out_len = s.output_lengths.predict(work.route, n, work.max_tokens)
                extra = s._slot_wait_ms(e, out_len)
        th = e.prefill.lin.theta
        pf = th[0] + th[1] * u + th[2] * uu
        pf = (pf if pf > 0.0 else 0.0) * e.prefill.drift.correction
        cached = saved = 0.0
        if caches:
            cached, pf, saved = _cached_prefill(caches.get(e.name), e, work, n, pf)
        solo = pf + solo_extra  # R08: the prompt alone (no decode-slot wait)
        busy = e.busy_until * 1000.0 - now_ms
        # the work ahead of it here: the whole queue, or (tenants queued) what fair
        # queueing serves before it (core/fairness.py ahead_ms)
        qw = e.queue.ahead_ms(tenant, wt, e.queued_work_ms) if e.queue else 0.0
        p_e = (busy if busy > 0.0 else 0.0) + qw + pf + extra
        if predictive:
            if solo < min_solo:
                min_solo = solo
            d = len(e.inflight_prefill) + len(e.queue)
            m_e = factors[_BUCKET[d] if d < _NB else -1]
            # refusals.yaml R10 note (placement cost): the projected TTFT minus the
            # prefill its cached prefix saves there, once for each request expected to
            # queue behind it (`behind`, Little's law) and once for the copy it does not
            # make, times the margin. With nothing cached it is the projected TTFT alone.
            if saved > 0.0 and behind < 0.0:
                behind = 1.0 + s._mean_depth()
            key: Any = (p_e - saved * behind) * m_e
            if tpot_rank:
                key = (0, e.decode.predict_ms(e.joining_batch()) if e.role == "unified" else 0.0, key) if p_e * m_e <= budget else (1, key, 0.0)
        else:
            m_e = 1.0
            # open mode: an engine with a free slot, then the shortest queue, then the
            # least loaded (prefill, and decode for a unified engine)
            key = (not (e.phase1_free() and not e.queue), len(e.queue), e.prefill_in_use / e.prefill_slots + (e.decode_in_use / e.decode_slots if e.role == "unified" else 0.0))
        if best_key is None or key < best_key:
            best_key, engine, proj, m, best_cached = key, e, p_e, m_e, cached
    return Placement(s, work, now, engine, proj, m, min_solo, best_cached, wt)


def _cached_prefill(idx: PrefixIndex | None, e: EngineState, work: Work, n: float, pf_full: float) -> tuple[float, float, float]:
    """(tokens expected cached, prefill ms of the rest, prefill ms saved) on engine e."""
    if idx is None or not idx.trusted:
        return 0.0, pf_full, 0.0
    cached = expected_cached(idx, work, n)
    if cached <= 0.0:
        return 0.0, pf_full, 0.0
    th, corr = e.prefill.lin.theta, e.prefill.drift.correction
    u = (n - cached) / 1000.0
    pf = th[0] + th[1] * u + th[2] * u * u
    pf = (pf if pf > 0.0 else 0.0) * corr
    u = n / 1000.0
    full = (th[0] + th[1] * u + th[2] * u * u) * corr
    return cached, pf, full - pf if full > pf else 0.0
