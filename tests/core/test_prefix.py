"""The prefix index (core/prefix.py) and the cache-aware projection of admission
(refusals.yaml R10 note: one projection for placement, R08 and R10)."""

from __future__ import annotations

import pytest

from narwhal.core.admission import Scheduler
from narwhal.core.clock import ManualClock
from narwhal.core.fleet import EngineState
from narwhal.core.prediction import Margin
from narwhal.core.prefix import (
    APPROX_BLOCK_BYTES,
    MAX_PROMPT_BLOCKS,
    PrefixIndex,
    rendered,
    text_keys,
    token_keys,
)
from narwhal.core.tickets import Dispatch, Enqueued, Refuse, Work
from narwhal_generated import errors as E

# -- keys ------------------------------------------------------------------------------

TURN1 = {"messages": [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Tell me about narwhals. " * 30}]}
TURN2 = {"messages": [*TURN1["messages"], {"role": "assistant", "content": "They are whales. " * 20}, {"role": "user", "content": "And their tusks?"}]}


@pytest.mark.parametrize("a, b, shared", [
    (b"x" * 1000, b"x" * 1000, 3),  # equal: every full block (1000 // 256)
    (b"x" * 1000, b"x" * 1000 + b"y" * 600, 3),  # an extension shares the first's full blocks
    (b"x" * 300 + b"a" * 700, b"x" * 300 + b"b" * 700, 1),  # they part in block 2
    (b"a" + b"x" * 999, b"b" + b"x" * 999, 0),  # they part in the first byte: nothing shared
    (b"x" * 255, b"x" * 255, 0),  # no full block
])
def test_text_keys_share_exactly_the_common_full_blocks(a: bytes, b: bytes, shared: int) -> None:
    ka, kb = text_keys(a), text_keys(b)
    assert len(ka) == len(a) // APPROX_BLOCK_BYTES
    n = 0
    while n < min(len(ka), len(kb)) and ka[n] == kb[n]:
        n += 1
    assert n == shared


def test_keys_are_stable_across_processes_and_bounded() -> None:
    # blake2b, not Python's per-process hash(): a worker and the authority agree
    assert text_keys(b"z" * 256) == (int.from_bytes(__import__("hashlib").blake2b(b"narwhal-prefix" + b"z" * 256, digest_size=8).digest(), "big", signed=True),)
    assert len(text_keys(b"q" * APPROX_BLOCK_BYTES * (MAX_PROMPT_BLOCKS + 10))) == MAX_PROMPT_BLOCKS


def test_a_conversations_next_turn_renders_as_an_extension_of_the_last() -> None:
    r1, r2 = rendered("chat", TURN1), rendered("chat", TURN2)
    assert r2.startswith(r1) and len(r2) > len(r1)
    k1, k2 = text_keys(r1), text_keys(r2)
    assert k2[: len(k1)] == k1
    assert rendered("completion", {"prompt": [1, 2, 3]}) == b"\x00\x00\x00\x01\x00\x00\x00\x02\x00\x00\x00\x03"
    assert rendered("completion", {"prompt": None}) == b""


def test_token_keys_continue_a_chain_from_a_parent() -> None:
    ids = list(range(64))
    whole = token_keys(ids, 16)
    assert len(whole) == 4
    assert token_keys(ids[32:], 16, parent=whole[1]) == whole[2:]


# -- the index ---------------------------------------------------------------------------


def test_match_counts_the_held_leading_blocks() -> None:
    idx = PrefixIndex(100)
    keys = text_keys(b"x" * 256 * 10)
    assert idx.match(keys) == 0
    idx.insert(keys[:6])
    assert idx.match(keys) == 6
    assert idx.match(keys[:3]) == 3
    assert idx.match(()) == 0


def test_eviction_takes_leaves_before_their_parents() -> None:
    idx = PrefixIndex(8)
    a = text_keys(b"a" * 256 * 6)
    b = text_keys(b"b" * 256 * 6)
    idx.insert(a)
    evicted = idx.insert(b)  # 12 > 8: four of a's go, leaf first
    assert evicted == list(reversed(a))[:4]
    assert idx.match(a) == 2 and idx.match(b) == 6 and len(idx) == 8


@pytest.mark.parametrize("expected, reported, full, capacity_after", [
    (10, 4, True, 9),  # the engine had less: it evicted; capacity shrinks to 0.9 x held
    (10, 10, True, 10),  # as expected: unchanged
    (4, 10, True, 11),  # the engine had more while the index was full: grows by 1/8
    (4, 10, False, 10),  # more, but the index was not full: no evidence about capacity
])
def test_the_capacity_follows_the_engines_reports(expected: int, reported: int, full: bool, capacity_after: int) -> None:
    idx = PrefixIndex(10)
    idx.insert(text_keys(b"x" * 256 * (10 if full else 5)))
    idx.correct(expected, reported)
    assert idx.capacity == capacity_after
    assert len(idx) <= idx.capacity


def test_an_engine_that_caches_nothing_shrinks_its_index_to_nothing() -> None:
    idx = PrefixIndex(1000)
    keys = text_keys(b"x" * 256 * 20)
    for _ in range(60):
        idx.insert(keys)
        idx.correct(idx.match(keys), 0)
    assert idx.capacity == 0 and len(idx) == 0


# -- one projection ------------------------------------------------------------------------


def engine(name: str, *, b0: float = 10.0, b1: float = 1.0) -> EngineState:
    e = EngineState(name, f"http://{name}", role="unified", dialect="vllm", prefill_slots=4, decode_slots=8)
    e.prefill.lin.theta = [b0, b1 * 1000.0, 0.0]
    return e


def sched(*es: EngineState, trusted: bool = True) -> Scheduler:
    return Scheduler(es, mode="predictive", queue_limit=8, margin=Margin(initial=1.0, adaptive=False),
                     prefix={e.name: PrefixIndex(10_000, trusted=trusted) for e in es})


def work(clk: ManualClock, n: int, keys: tuple[int, ...], budget: float = 2000.0) -> Work:
    return Work(route="chat", prompt_tokens=n, max_tokens=16, budget_ms=budget, arrival=clk.now(), max_wait_s=10.0, deadline_s=None, prefix=keys, block_tokens=64.0)


HISTORY = text_keys(b"h" * 256 * 40)  # 40 blocks x 64 tokens = 2,560 tokens of history


def test_a_cached_history_is_projected_as_the_cheap_request_it_is_R08() -> None:
    clk = ManualClock()
    s = sched(engine("u0"))
    cold = s.admit(work(clk, 2600, HISTORY), clk.now())  # 10 + 2600 ms alone > 2000: R08
    assert isinstance(cold, Refuse) and cold.row is E.R08
    s.prefix["u0"].insert(HISTORY)  # the engine prefilled this history before
    warm = s.admit(work(clk, 2600, HISTORY), clk.now())
    assert isinstance(warm, Dispatch)
    assert warm.ticket.expected_cached == 2560.0
    assert warm.ticket.projected_ttft_ms == pytest.approx(10 + 40)  # 40 uncached tokens at 1 ms


def test_placement_weighs_cache_and_load_in_one_number() -> None:
    clk = ManualClock()
    cached, idle = engine("cached"), engine("idle")
    s = sched(cached, idle)
    s.prefix["cached"].insert(HISTORY)
    first = s.admit(work(clk, 2600, HISTORY, budget=10_000), clk.now())
    assert isinstance(first, Dispatch) and first.engine == "cached"  # 50 ms there against 2,610 idle
    # R10 note, placement cost = projected TTFT - prefill saved by the cache x (1 +
    # requests prefilling or queued per engine), times the margin. The cache saves
    # 2,610 - 50 = 2,560 ms here.
    # 3 s ahead on the cached engine, the first request prefilling there (0.5 per engine):
    # 3,050 - 3,840 against 2,610: the cache wins, though the idle engine projects lower
    cached.busy_until = clk.now() + 3.0
    second = s.admit(work(clk, 2600, HISTORY, budget=20_000), clk.now())
    assert isinstance(second, Dispatch) and second.engine == "cached"
    assert second.ticket.projected_ttft_ms == pytest.approx(3050)
    # 7 s ahead, two there (1 per engine): 7,050 - 5,120 = 1,930 < 2,610
    cached.busy_until = clk.now() + 7.0
    third = s.admit(work(clk, 2600, HISTORY, budget=20_000), clk.now())
    assert isinstance(third, Dispatch) and third.engine == "cached"
    cached.busy_until = clk.now() + 9.5  # three there (1.5): 9,550 - 6,400 = 3,150 > 2,610
    fourth = s.admit(work(clk, 2600, HISTORY, budget=20_000), clk.now())
    assert isinstance(fourth, Dispatch) and fourth.engine == "idle"
    assert fourth.ticket.projected_ttft_ms == pytest.approx(2610)


def test_an_idle_fleet_weighs_the_cache_once_for_the_copy_it_saves() -> None:
    # nothing prefilling or queued anywhere: cost = projected TTFT - saved x 1 (the copy
    # a placement elsewhere would store); one cached block saves 64 ms
    for ahead_s, want in ((0.1, "cached"), (0.13, "idle")):  # 100 + 2,546 - 64 < 2,610 < 130 + 2,546 - 64
        clk = ManualClock()
        cached, idle = engine("cached"), engine("idle")
        s = sched(cached, idle)
        s.prefix["cached"].insert(HISTORY[:1])
        cached.busy_until = clk.now() + ahead_s
        got = s.admit(work(clk, 2600, HISTORY, budget=10_000), clk.now())
        assert isinstance(got, Dispatch) and got.engine == want, ahead_s


def test_with_nothing_cached_the_queues_change_nothing() -> None:
    # the cost differs from the projected TTFT only by what a cache saves: with no
    # prefix held anywhere, a loaded fleet ranks on the projected TTFT alone
    clk = ManualClock()
    a, b = engine("a"), engine("b")
    s = sched(a, b)
    for _ in range(4):  # four requests prefilling or queued: 2 per engine
        assert isinstance(s.admit(work(clk, 100, (), budget=60_000), clk.now()), (Dispatch, Enqueued))
    a.busy_until = clk.now() + 1.0
    b.busy_until = clk.now() + 1.2
    lowest = min(s.project(2600, clk.now()), key=lambda x: x[0])
    got = s.admit(work(clk, 2600, HISTORY, budget=60_000), clk.now())
    assert not isinstance(got, Refuse) and got.ticket.expected_cached == 0.0
    assert got.ticket.engine == lowest[2].name and got.ticket.projected_ttft_ms == pytest.approx(lowest[0])


def test_an_untrusted_index_projects_full_length() -> None:
    clk = ManualClock()
    s = sched(engine("u0"), trusted=False)
    s.prefix["u0"].insert(HISTORY)
    r = s.admit(work(clk, 2600, HISTORY), clk.now())
    assert isinstance(r, Refuse) and r.row is E.R08


def test_the_prefill_sample_is_learned_on_the_uncached_tokens() -> None:
    clk = ManualClock()
    u0 = engine("u0")
    s = sched(u0)
    s.prefix["u0"].insert(HISTORY)
    d = s.admit(work(clk, 2600, HISTORY, budget=10_000), clk.now())
    assert isinstance(d, Dispatch)
    seen: list[tuple[float, float]] = []

    class Spy(type(u0.prefill)):  # type: ignore[misc]
        __slots__ = ()

        def observe(self, n: float, measured_ms: float) -> None:
            seen.append((n, measured_ms))

    spy = Spy()
    spy.lin, spy.drift = u0.prefill.lin, u0.prefill.drift
    u0.prefill = spy
    clk.advance(0.05)
    s.first_token(d.ticket, clk.now())
    assert seen == []  # deferred: the engine's own count of cached tokens comes at the end
    s.learn(d.ticket, 2048)  # the engine reports 2,048 cached (it held 32 of the 40 blocks)
    assert seen and seen[0][0] == 2600 - 2048
    assert s.prefix["u0"].capacity < 10_000  # it had less than the index thought


def test_an_engine_that_reported_once_reports_zero_by_leaving_it_out() -> None:
    clk = ManualClock()
    s = sched(engine("u0"))
    d = s.admit(work(clk, 2600, HISTORY, budget=10_000), clk.now())
    assert isinstance(d, Dispatch)
    s.learn(d.ticket, None)
    assert not s.prefix["u0"].reports  # nothing known yet
    s.learn(d.ticket, 64)
    assert s.prefix["u0"].reports
    cap = s.prefix["u0"].capacity
    d2 = s.admit(work(clk, 2600, HISTORY, budget=10_000), clk.now())
    assert isinstance(d2, Dispatch) and d2.ticket.expected_cached > 0
    s.learn(d2.ticket, None)  # vLLM: no prompt_tokens_details when none was cached
    assert s.prefix["u0"].capacity < cap
