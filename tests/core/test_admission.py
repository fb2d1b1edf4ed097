"""Admission and placement, sans-IO with a manual clock: rows R08-R13, phase slots, FIFO,
P/D two phases, eligibility, and the precedence property over the whole refusal table."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from narwhal.core import refusals as answers
from narwhal.core.admission import Scheduler
from narwhal.core.clock import ManualClock
from narwhal.core.fleet import EngineState
from narwhal.core.prediction import Margin
from narwhal.core.refusals import PREDICATES, REFUSALS, first_match
from narwhal.core.tickets import Dispatch, Enqueued, Refuse, Work
from narwhal_generated import errors as E


def engine(name: str, role: str = "unified", *, prefill: int = 2, decode: int = 4, b0: float = 100.0, b1: float = 1.0, b2: float = 0.0) -> EngineState:
    e = EngineState(name, f"http://{name}", role=role, dialect="vllm", prefill_slots=prefill, decode_slots=decode)
    e.prefill.lin.theta = [b0, b1 * 1000.0, b2 * 1e6]  # ms, ms/token, ms/token^2 (scaled features)
    e.start_model.theta = [5.0, 0.0]
    return e


def work(clock: ManualClock, n: int = 100, budget: float = 2000.0, wait: float = 10.0, deadline: float | None = None) -> Work:
    return Work(route="chat", prompt_tokens=n, max_tokens=16, budget_ms=budget, arrival=clock.now(), max_wait_s=wait, deadline_s=deadline)


def sched(*engines: EngineState, mode: str = "predictive", queue_limit: int = 8, m: float = 1.0) -> Scheduler:
    return Scheduler(engines, mode=mode, queue_limit=queue_limit, margin=Margin(initial=m, adaptive=False))


# -- R08 -------------------------------------------------------------------------------


def test_R08_prompt_alone_exceeds_budget_no_retry_after() -> None:
    clk = ManualClock()
    s = sched(engine("u0", b0=100, b1=1.0))
    r = s.admit(work(clk, n=3000, budget=2000), clk.now())  # 100 + 3000 = 3100 ms alone
    assert isinstance(r, Refuse) and r.row is E.R08
    assert answers.retry_after_seconds(r.row, r.overrun_s) is None


def test_R08_uses_the_margin_and_the_best_engine() -> None:
    clk = ManualClock()
    slow, fast = engine("slow", b0=100, b1=2.0), engine("fast", b0=100, b1=0.5)
    s = sched(slow, fast, m=1.2)
    # fast alone: (100 + 0.5*2000) * 1.2 = 1320 ms <= 2000: admitted on fast
    r = s.admit(work(clk, n=2000), clk.now())
    assert isinstance(r, Dispatch) and r.engine == "fast"
    # 3000 tokens: (100 + 1500) * 1.2 = 1920 fits; 3500: (100+1750)*1.2 = 2220 does not
    assert isinstance(s.admit(work(clk, n=3500), clk.now()), Refuse)


def test_R08_quadratic_term_counts() -> None:
    clk = ManualClock()
    s = sched(engine("u0", b0=10, b1=0.1, b2=0.0002))
    # 10 + 300 + 0.0002*9e6 = 2110 ms > 2000
    r = s.admit(work(clk, n=3000), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R08


def test_R08_skipped_in_open_mode() -> None:
    clk = ManualClock()
    s = sched(engine("u0", b1=10.0), mode="open")
    assert isinstance(s.admit(work(clk, n=3000), clk.now()), Dispatch)


# -- R09 -------------------------------------------------------------------------------


def test_R09_no_eligible_engine() -> None:
    clk = ManualClock()
    e = engine("u0")
    e.healthy = False
    r = sched(e).admit(work(clk), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R09 and answers.retry_after_seconds(r.row) == 1


def test_R09_each_eligibility_reason() -> None:
    clk = ManualClock()
    for setup in ("unhealthy", "draining", "wave", "breaker"):
        e = engine("u0")
        e.wave = "a"
        s = sched(e)
        if setup == "unhealthy":
            e.healthy = False
        elif setup == "draining":
            e.draining = True
        elif setup == "wave":
            s.maintenance_waves.add("a")
        else:
            for _ in range(3):
                e.breaker.failure(clk.now())
        assert e.ineligible_reasons(s.maintenance_waves), setup
        r = s.admit(work(clk), clk.now())
        assert isinstance(r, Refuse) and r.row is E.R09, setup


def test_R09_prefill_engines_without_a_decode_engine() -> None:
    clk = ManualClock()
    p, d = engine("p0", "prefill"), engine("d0", "decode")
    d.draining = True
    r = sched(p, d).admit(work(clk), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R09 and r.fields["phase"] == "decode"


def test_R08_precedes_R09_only_when_an_engine_is_eligible() -> None:
    clk = ManualClock()
    e = engine("u0", b1=10.0)
    e.healthy = False
    r = sched(e).admit(work(clk, n=5000), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R09


# -- R10 -------------------------------------------------------------------------------


def test_R10_projected_ttft_over_budget_with_retry_after() -> None:
    clk = ManualClock()
    e = engine("u0", prefill=8, decode=64, b0=100, b1=1.0)  # decode slots not the limit
    s = sched(e)
    # each 400-token request predicts 500 ms; the engine serialises prefill work
    for _ in range(3):
        assert isinstance(s.admit(work(clk, n=400), clk.now()), Dispatch)
    # ahead: 1500 ms; own 500: 2000 fits exactly
    assert isinstance(s.admit(work(clk, n=400), clk.now()), Dispatch)
    # ahead: 2000 + 500 = 2500: overrun 0.5 s -> Retry-After max(1, round(0.5)) = 1
    r = s.admit(work(clk, n=400), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R10
    assert abs((r.overrun_s or 0) - 0.5) < 1e-9
    assert answers.retry_after_seconds(r.row, r.overrun_s) == 1


def test_R10_retry_after_is_the_rounded_overrun() -> None:
    clk = ManualClock()
    e = engine("u0", prefill=16, b0=0, b1=1.0)
    s = sched(e)
    for _ in range(4):
        s.admit(work(clk, n=1000, budget=60000), clk.now())  # 4 s of work ahead
    r = s.admit(work(clk, n=1000, budget=2000), clk.now())  # 5 s projected: 3 s over
    assert isinstance(r, Refuse) and r.row is E.R10 and answers.retry_after_seconds(r.row, r.overrun_s) == 3
    # round half up: 2.5 s over -> 3
    r = s.admit(work(clk, n=1000, budget=2500), clk.now())
    assert isinstance(r, Refuse) and answers.retry_after_seconds(r.row, r.overrun_s) == 3
    # the backlog drains with time: 3.6 s later only 0.4 s is ahead, so it fits
    clk.advance(3.6)
    assert not isinstance(s.admit(work(clk, n=1000, budget=2000), clk.now()), Refuse)


def test_R10_places_on_the_best_projection() -> None:
    clk = ManualClock()
    a, b = engine("a", prefill=8, b1=1.0), engine("b", prefill=8, b1=1.0)
    s = sched(a, b)
    first = s.admit(work(clk, n=800), clk.now())
    second = s.admit(work(clk, n=800), clk.now())
    assert isinstance(first, Dispatch) and isinstance(second, Dispatch) and first.engine != second.engine


def test_R10_skipped_in_open_mode() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=64, decode=64, b1=1.0), mode="open")
    for _ in range(20):
        assert isinstance(s.admit(work(clk, n=1000), clk.now()), Dispatch)


def test_R10_decode_start_counts_when_disaggregated() -> None:
    clk = ManualClock()
    p, d = engine("p0", "prefill", b0=100, b1=1.0), engine("d0", "decode")
    d.start_model.theta = [500.0, 0.0]  # transfer + decode first token: 500 ms
    s = sched(p, d)
    # 100 + 1000 + 500 = 1600 fits 2000; with 1500 tokens 100+1500+500 = 2100 is over (R08)
    assert isinstance(s.admit(work(clk, n=1000), clk.now()), Dispatch)
    r = s.admit(work(clk, n=1500), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R08


# -- R11 -------------------------------------------------------------------------------


def test_R11_queue_full() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1), mode="open", queue_limit=2)
    assert isinstance(s.admit(work(clk), clk.now()), Dispatch)
    assert isinstance(s.admit(work(clk), clk.now()), Enqueued)
    assert isinstance(s.admit(work(clk), clk.now()), Enqueued)
    r = s.admit(work(clk), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R11 and answers.retry_after_seconds(r.row) == 1


def test_R11_zero_queue_limit_refuses_any_wait() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1), mode="open", queue_limit=0)
    assert isinstance(s.admit(work(clk), clk.now()), Dispatch)
    r = s.admit(work(clk), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R11


# -- FIFO and slots --------------------------------------------------------------------


def test_fifo_grants_in_arrival_order_and_frees_every_slot() -> None:
    clk = ManualClock()
    e = engine("u0", prefill=1, decode=2)
    s = sched(e, mode="open", queue_limit=10)
    d0 = s.admit(work(clk), clk.now())
    q = [s.admit(work(clk), clk.now()) for _ in range(3)]
    assert isinstance(d0, Dispatch) and all(isinstance(x, Enqueued) for x in q)
    # first token of d0 frees the prefill slot: the head of the queue goes
    g = s.first_token(d0.ticket, clk.now())
    assert [x.ticket for x in g] == [q[0].ticket]
    # decode slots: d0 and q0 hold both; q1 waits for a decode slot
    assert s.first_token(g[0].ticket, clk.now()) == []
    g2 = s.finish(d0.ticket, clk.now())
    assert [x.ticket for x in g2] == [q[1].ticket]
    for t in (g[0].ticket, g2[0].ticket):
        s.finish(t, clk.now())
    s.finish(q[2].ticket, clk.now())  # cancelled while queued
    assert (e.prefill_in_use, e.decode_in_use, s.queued, len(e.queue)) == (0, 0, 0, 0)


def test_pd_two_phases_and_decode_fifo() -> None:
    clk = ManualClock()
    p, d = engine("p0", "prefill", prefill=2), engine("d0", "decode", decode=1)
    s = sched(p, d, mode="open")
    a = s.admit(work(clk), clk.now())
    b = s.admit(work(clk), clk.now())
    assert isinstance(a, Dispatch) and a.phase == "prefill" and isinstance(b, Dispatch)
    s.prefill_done(a.ticket, clk.now(), ok=True)
    da = s.want_decode(a.ticket, clk.now())
    assert isinstance(da, Dispatch) and da.engine == "d0" and da.phase == "decode"
    s.prefill_done(b.ticket, clk.now(), ok=True)
    db = s.want_decode(b.ticket, clk.now())
    assert isinstance(db, Enqueued)
    g = s.finish(a.ticket, clk.now())
    assert [x.ticket for x in g] == [b.ticket] and g[0].phase == "decode"
    s.finish(b.ticket, clk.now())
    assert (p.prefill_in_use, d.decode_in_use) == (0, 0)


@pytest.mark.parametrize("mode", ["open", "predictive"])
def test_pd_backpressure_no_prefill_for_a_request_that_would_wait_for_decode(mode: str) -> None:
    # module rule "P/D backpressure": prefilling + prefilled + decode-queued P/D requests
    # stay below free decode slots + reserve (max(1, slots // 4) per decode engine);
    # past it a request waits in its phase-1 queue, where R11/R12 bound it, and never
    # holds prefilled KV that would expire in the decode queue (issue 11)
    clk = ManualClock()
    p, d = engine("p0", "prefill", prefill=8, b0=10.0), engine("d0", "decode", decode=2)
    s = sched(p, d, mode=mode)
    grants = [s.admit(work(clk, budget=1e9), clk.now()) for _ in range(5)]
    # room: 2 free decode slots + reserve 1 = 3, though the prefill engine has 8 slots
    assert [type(g).__name__ for g in grants] == ["Dispatch"] * 3 + ["Enqueued"] * 2
    assert p.prefill_in_use == 3 and len(p.queue) == 2 and s.pd_pending == 3
    a, b, c = (g.ticket for g in grants[:3])
    for t in (a, b):
        assert s.prefill_done(t, clk.now(), ok=True) == []  # no room opened: still pending
        assert isinstance(s.want_decode(t, clk.now()), Dispatch)
    # both decode slots taken: room = 0 free + 1 reserve; c is the one prefilled-ready
    assert s.prefill_done(c, clk.now(), ok=True) == [] and isinstance(s.want_decode(c, clk.now()), Enqueued)
    g = s.finish(a, clk.now())  # a decode slot frees: c decodes, and one queued request prefills
    assert [(x.ticket, x.phase) for x in g] == [(c, "decode"), (grants[3].ticket, "prefill")]
    s.finish(b, clk.now())
    s.finish(c, clk.now())
    s.finish(grants[3].ticket, clk.now())
    s.finish(grants[4].ticket, clk.now())
    assert (p.prefill_in_use, d.decode_in_use, s.pd_pending, s.queued, len(s.decode_queue)) == (0, 0, 0, 0, 0)


def test_pd_backpressure_counts_a_failed_decode_as_waiting_again() -> None:
    clk = ManualClock()
    p, d0, d1 = engine("p0", "prefill", prefill=8), engine("d0", "decode", decode=1), engine("d1", "decode", decode=1)
    s = sched(p, d0, d1, mode="open")
    a = s.admit(work(clk), clk.now())
    assert isinstance(a, Dispatch)
    s.prefill_done(a.ticket, clk.now(), ok=True)
    assert isinstance(s.want_decode(a.ticket, clk.now()), Dispatch) and s.pd_pending == 0
    s.decode_failed(a.ticket, clk.now())
    assert s.pd_pending == 1
    s.finish(a.ticket, clk.now())
    assert s.pd_pending == 0 and (d0.decode_in_use, d1.decode_in_use) == (0, 0)


def test_a_full_slot_limited_unified_engine_projects_the_decodes_ahead() -> None:
    # engines[].max_concurrency 1 (a llama.cpp server): a request behind one in flight
    # waits for that one's whole answer, not only its prefill (issue 12)
    clk = ManualClock()
    e = engine("u0", prefill=1, decode=1, b0=100.0)
    e.decode.lin.theta = [20.0, 0.0]  # 20 ms a token at any batch
    s = sched(e, mode="predictive")
    a = s.admit(work(clk, budget=1e9), clk.now())
    assert isinstance(a, Dispatch)
    b = s.admit(work(clk, budget=1e9), clk.now())
    assert isinstance(b, Enqueued)
    out = s.output_lengths.predict("chat", 100, 16)
    # its prefill (100 ms + 100 tokens x 1 ms) after the one in flight's remaining prefill,
    # plus the decode ahead of it: out tokens x 20 ms
    assert b.ticket.projected_ttft_ms is not None and b.ticket.projected_ttft_ms >= 200.0 + out * 20.0 - 1e-6


def test_retry_excludes_the_failed_decode_engine() -> None:
    clk = ManualClock()
    p, d0, d1 = engine("p0", "prefill"), engine("d0", "decode"), engine("d1", "decode")
    s = sched(p, d0, d1, mode="open")
    a = s.admit(work(clk), clk.now())
    assert isinstance(a, Dispatch)
    s.prefill_done(a.ticket, clk.now(), ok=True)
    first = s.want_decode(a.ticket, clk.now())
    assert isinstance(first, Dispatch)
    s.decode_failed(a.ticket, clk.now())
    second = s.want_decode(a.ticket, clk.now())
    assert isinstance(second, Dispatch) and second.engine != first.engine
    s.decode_failed(a.ticket, clk.now())
    assert not s.has_retry_decoder(a.ticket)


def test_reconcile_moves_waiters_off_a_drained_engine_or_refuses_R09() -> None:
    clk = ManualClock()
    a, b = engine("a", prefill=1), engine("b", prefill=1)
    s = sched(a, b, mode="open")
    s.admit(work(clk), clk.now())
    s.admit(work(clk), clk.now())
    q = s.admit(work(clk), clk.now())
    assert isinstance(q, Enqueued)
    a.draining = True
    grants, refused = s.reconcile(clk.now())
    assert not refused and all(t.engine == "b" for t in b.queue) or grants
    b.draining = True
    grants, refused = s.reconcile(clk.now())
    assert [t for t, _ in refused] == [q.ticket] and refused[0][1].row is E.R09


# -- R12, R13 --------------------------------------------------------------------------


def test_R12_admission_wait_expires() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1), mode="open")
    s.admit(work(clk), clk.now())
    q = s.admit(work(clk, wait=0.5), clk.now())
    assert isinstance(q, Enqueued)
    assert s.expiry(q.ticket, clk.now()) is None and abs(s.time_left(q.ticket, clk.now()) - 0.5) < 1e-9
    clk.advance(0.5)
    assert s.expiry(q.ticket, clk.now()) is E.R12


def test_R13_deadline_expires() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1), mode="open")
    s.admit(work(clk), clk.now())
    q = s.admit(work(clk, wait=10, deadline=0.2), clk.now())
    assert isinstance(q, Enqueued) and abs(s.time_left(q.ticket, clk.now()) - 0.2) < 1e-9
    clk.advance(0.25)
    assert s.expiry(q.ticket, clk.now()) is E.R13


def test_R12_wins_over_R13_at_the_same_instant() -> None:
    clk = ManualClock()
    s = sched(engine("u0", prefill=1), mode="open")
    s.admit(work(clk), clk.now())
    q = s.admit(work(clk, wait=0.5, deadline=0.5), clk.now())
    assert isinstance(q, Enqueued)
    clk.advance(0.5)
    assert s.expiry(q.ticket, clk.now()) is E.R12


def test_R12_counts_the_decode_wait_too() -> None:
    clk = ManualClock()
    p, d = engine("p0", "prefill"), engine("d0", "decode", decode=1)
    s = sched(p, d, mode="open")
    a = s.admit(work(clk), clk.now())
    b = s.admit(work(clk, wait=1.0), clk.now())
    assert isinstance(a, Dispatch) and isinstance(b, Dispatch)
    s.prefill_done(a.ticket, clk.now(), ok=True)
    s.want_decode(a.ticket, clk.now())
    s.prefill_done(b.ticket, clk.now(), ok=True)
    assert isinstance(s.want_decode(b.ticket, clk.now()), Enqueued)
    clk.advance(1.0)
    assert s.expiry(b.ticket, clk.now()) is E.R12
    assert s.waited_s(b.ticket, clk.now()) == 1.0  # the message's waited_ms (was 0 after a decode-slot wait)


# -- learning hooks --------------------------------------------------------------------


def test_prefill_measurements_refine_the_model_online() -> None:
    clk = ManualClock()
    e = engine("u0", prefill=1, b0=10.0, b1=0.1)
    s = sched(e, mode="open")
    for _ in range(60):
        d = s.admit(work(clk, n=1000), clk.now())
        assert isinstance(d, Dispatch)
        clk.advance(0.3)  # the engine really takes 300 ms for 1000 tokens
        s.first_token(d.ticket, clk.now())
        s.finish(d.ticket, clk.now())
    assert abs(e.prefill.predict_ms(1000) - 300.0) / 300.0 < 0.1


# -- precedence (docs/style.md P3) -----------------------------------------------------


@given(st.fixed_dictionaries({p: st.booleans() for p in PREDICATES}))
def test_precedence_is_total_first_matching_row_decides(facts: dict[str, bool]) -> None:
    row = first_match(facts)
    held = [r for r in REFUSALS if facts[r.when]]
    if not held:
        assert row is None
    else:
        assert row is held[0]
        assert all(not facts[r.when] for r in REFUSALS if r.order is not None and row.order is not None and r.order < row.order)


@given(st.fixed_dictionaries({p: st.booleans() for p in PREDICATES}))
def test_precedence_evaluates_lazily(facts: dict[str, bool]) -> None:
    called: list[str] = []

    def lazy(name: str):  # type: ignore[no-untyped-def]
        def f() -> bool:
            called.append(name)
            return facts[name]

        return f

    row = first_match({p: lazy(p) for p in PREDICATES})
    stop = PREDICATES.index(row.when) if row is not None else len(PREDICATES) - 1
    assert called == list(PREDICATES[: stop + 1])


def test_table_order_is_the_contract_order() -> None:
    # the contract's rows in their order, with the identity and tenant rows (issue 22):
    # R15/R16 and R17/R18 after R01, R19 after the body's rows, R20 before R11
    assert [r.code for r in REFUSALS] == [
        "router_not_ready", "missing_api_key", "invalid_api_key", "tenant_in_flight_full", "tenant_request_rate_exceeded",
        "http_retention_full", "request_too_large", "invalid_request", "model_not_found", "invalid_sampling_width", "unsupported_option",
        "tenant_token_rate_exceeded", "prompt_exceeds_ttft_budget", "backend_unavailable", "ttft_budget_exceeded", "tenant_queue_full",
        "admission_queue_full", "admission_wait_expired", "deadline_expired", "tpot_budget_exceeded",
    ]
    assert [r.status for r in REFUSALS] == [503, 401, 401, 429, 429, 429, 413, 400, 404, 400, 400, 429, 429, 503, 429, 429, 429, 504, 504, 429]


# -- R14 (decode side) -----------------------------------------------------------------


def test_R14_projected_tpot_over_budget() -> None:
    clk = ManualClock()
    p, d = engine("p0", "prefill", prefill=8, b0=10, b1=0.01), engine("d0", "decode", decode=64)
    d.decode.lin.theta = [10.0, 1.0]  # TPOT = 10 + 1 ms per sequence in the batch
    s = Scheduler([p, d], mode="predictive", queue_limit=8, margin=Margin(initial=1.0, adaptive=False), tpot_budget_ms=20.0)
    admitted = 0
    for _ in range(12):
        r = s.admit(work(clk), clk.now())
        if isinstance(r, Refuse):
            assert r.row is E.R14
            break
        admitted += 1
    # request k joins a batch of k + 1 (the k ahead of it, all bound for d0): the 11th
    # (k = 10) would decode at 10 + 11 = 21 ms > 20 ms
    assert admitted == 10
    assert answers.retry_after_seconds(r.row, r.overrun_s) >= 1
    # without a TPOT budget the check is off
    s.tpot_budget_ms = None
    assert not isinstance(s.admit(work(clk), clk.now()), Refuse)


def test_R14_unified_counts_the_engine_queue() -> None:
    clk = ManualClock()
    u = engine("u0", prefill=1, decode=64, b0=1, b1=0.0)
    u.decode.lin.theta = [5.0, 5.0]
    s = Scheduler([u], mode="predictive", queue_limit=16, margin=Margin(initial=1.0, adaptive=False), tpot_budget_ms=26.0)
    results = [s.admit(work(clk), clk.now()) for _ in range(6)]
    kinds = [type(x).__name__ for x in results]
    assert kinds[:4] == ["Dispatch", "Enqueued", "Enqueued", "Enqueued"] and isinstance(results[4], Refuse) and results[4].row is E.R14


@pytest.mark.load_by_hand
def test_open_mode_breaks_ties_on_decode_load() -> None:
    clk = ManualClock()
    a, b = engine("a", prefill=4, decode=8), engine("b", prefill=4, decode=8)
    s = sched(a, b, mode="open")
    a.decode_in_use = 5  # a is busier decoding; both have free prefill slots
    r = s.admit(work(clk), clk.now())
    assert isinstance(r, Dispatch) and r.engine == "b"


@pytest.mark.load_by_hand
def test_R14_places_on_the_lowest_projected_tpot_among_engines_that_fit() -> None:
    clk = ManualClock()
    a, b = engine("a", prefill=4, decode=64, b0=10, b1=0.0), engine("b", prefill=4, decode=64, b0=12, b1=0.0)
    for e in (a, b):
        e.decode.lin.theta = [5.0, 1.0]
    a.decode_in_use = 20  # a projects the lower TTFT (10 vs 12 ms) but decodes a batch of 20
    s = Scheduler([a, b], mode="predictive", queue_limit=8, margin=Margin(initial=1.0, adaptive=False), tpot_budget_ms=100.0)
    r = s.admit(work(clk), clk.now())
    assert isinstance(r, Dispatch) and r.engine == "b"
    # when only a fits the TTFT budget it wins whatever its batch; TTFT-only ranking keeps a
    s.finish(r.ticket, clk.now())
    b.busy_until = clk.now() + 10.0
    r = s.admit(work(clk), clk.now())
    assert isinstance(r, Dispatch) and r.engine == "a"
    s.finish(r.ticket, clk.now())
    b.busy_until = 0.0
    s.tpot_budget_ms = None
    r = s.admit(work(clk), clk.now())
    assert isinstance(r, Dispatch) and r.engine == "a"


def test_R08_is_the_prompt_alone_and_the_decode_slot_wait_is_R10() -> None:
    """Issue 11: under P/D decode saturation, prompts whose prefill fits were refused R08
    ("shorten the prompt", no Retry-After) because the decode-slot wait was counted in the
    prompt-alone estimate. The wait is load: R10, with Retry-After."""
    clk = ManualClock()
    p, d = engine("p0", "prefill", b0=100, b1=1.0), engine("d0", "decode", decode=1)
    s = sched(p, d, mode="predictive")
    a = s.admit(work(clk, n=10, budget=30000), clk.now())  # takes d0's only decode slot
    assert isinstance(a, Dispatch)
    s.prefill_done(a.ticket, clk.now(), ok=True)
    assert isinstance(s.want_decode(a.ticket, clk.now()), Dispatch)
    alone = 100 + 1500 + 5  # prefill + KV transfer/first token: 1605 ms
    (proj, solo, _), = s.project(1500, clk.now())
    assert solo == alone and proj > alone  # the projection carries the decode wait, solo does not
    r = s.admit(work(clk, n=1500, budget=(alone + proj) / 2), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R10
    assert answers.retry_after_seconds(r.row, r.overrun_s) is not None
