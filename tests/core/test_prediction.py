"""What the router learns (docs/prediction.md): prefill model, decode profile, drift, output
lengths, margin, TPOT from token IDs."""

from __future__ import annotations

import random

import pytest

from narwhal.core.prediction import (
    DecodeModel,
    Drift,
    LinearModel,
    Margin,
    OutputLengthLearner,
    PrefillModel,
    tpot_from_arrivals,
)


def truth(n: float, a: float = 15.0, b: float = 0.08, c: float = 2e-5) -> float:
    return a + b * n + c * n * n


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_prefill_profile_fit_recovers_timing_within_10_percent(seed: int) -> None:
    rnd = random.Random(seed)
    m = PrefillModel()
    m.fit([(n, truth(n) * rnd.lognormvariate(0, 0.05)) for n in (16, 256, 768, 1536) for _ in range(2)])
    for n in (32, 500, 1000, 1536, 2048):
        assert abs(m.predict_ms(n) - truth(n)) / truth(n) < 0.10, n


def test_prefill_online_refinement_converges_and_keeps_outliers_out() -> None:
    rnd = random.Random(7)
    m = PrefillModel(b0_ms=5.0, b1_ms_per_token=0.01)  # a poor prior
    for _ in range(400):
        n = rnd.randint(10, 4000)
        m.observe(n, truth(n) * rnd.lognormvariate(0, 0.05))
    m.observe(1000, truth(1000) * 50)  # a stalled measurement
    assert m.outliers == 1
    for n in (100, 1000, 3000):
        assert abs(m.predict_ms(n) - truth(n)) / truth(n) < 0.10


def test_linear_fit_keeps_coefficients_nonnegative() -> None:
    m = PrefillModel()
    m.fit([(n, 10 + 0.05 * n) for n in (16, 256, 768, 1536)])
    b0, b1, b2 = m.coefficients
    assert b0 >= 0 and b1 >= 0 and b2 >= 0


def test_decode_profile_and_drift_correction() -> None:
    d = DecodeModel()
    d.fit([(1.0, 10.0), (1.0, 10.2), (4.0, 10.6), (4.0, 10.5)])
    assert abs(d.predict_ms(1) - 10.1) < 0.5
    # the engine becomes 1.5x slower: the CUSUM alarms and the correction follows
    alarms = sum(d.observe(1, 15.15) for _ in range(60))
    assert alarms >= 1
    assert abs(d.predict_ms(1) - 15.15) / 15.15 < 0.1


def test_drift_score_stays_quiet_in_control() -> None:
    rnd = random.Random(3)
    dr = Drift(sigma0=0.1)
    for _ in range(500):
        dr.observe(10 * rnd.lognormvariate(0, 0.05), 10)
    assert dr.alarms == 0 and abs(dr.score) < 1.5


def test_drift_alarms_both_ways() -> None:
    dr = Drift(sigma0=0.1)
    assert any(dr.observe(7.0, 10.0) for _ in range(30))
    assert dr.correction < 1.0


def test_T11_tpot_from_arrivals_counts_ids_not_events() -> None:
    assert tpot_from_arrivals([(0.0, 1), (0.02, 1), (0.04, 1)]) == pytest.approx(0.02)
    # 5 tokens, two of them in the last event: (0.06 - 0) / 4
    assert tpot_from_arrivals([(0.0, 1), (0.02, 1), (0.04, 1), (0.06, 2)]) == pytest.approx(0.015)
    assert tpot_from_arrivals([(0.0, 1)]) is None


def test_output_length_quantiles_fall_back_through_the_hierarchy() -> None:
    ol = OutputLengthLearner(min_samples=20)
    assert ol.predict("chat", 100, None) == 128.0  # the default until learned
    for i in range(100):
        ol.observe("chat", 100, 256, 50 + i % 10)
    assert 50 <= ol.predict("chat", 100, 256) <= 60
    assert ol.predict("chat", 100, 256, q=0.9) >= ol.predict("chat", 100, 256)
    # another max_tokens bucket falls back to the prompt-length bucket
    assert 50 <= ol.predict("chat", 100, 4000) <= 60
    assert ol.predict("chat", 100, 20) == 20  # clamped to max_tokens


def test_margin_learns_the_quantile_per_depth_bucket() -> None:
    m = Margin(initial=1.2, quantile=0.9, min_samples=50)
    assert m.m(0) == 1.2
    for i in range(100):
        m.observe(0, 100.0 * (1.0 + (i % 10) / 20), 100.0)  # ratios 1.0 .. 1.45
    assert 1.35 <= m.m(0) <= 1.45
    assert m.m(4) == 1.2  # another bucket keeps the initial margin


def test_drift_does_not_random_walk_on_noise_wider_than_the_profile() -> None:
    # the profile saw sigma0 = 0.05; in operation the residuals are unbiased but 6x wider
    # (a busy machine, tiny prefills): the correction must stay put (no "R10 storms")
    rnd = random.Random(11)
    dr = Drift(sigma0=0.05)
    for _ in range(2000):
        dr.observe(10 * rnd.lognormvariate(0, 0.3), 10)
    assert 0.8 < dr.correction < 1.25 and dr.alarms <= 40  # < 2 % of samples


def test_drift_correction_is_capped() -> None:
    dr = Drift(sigma0=0.1)
    for _ in range(5000):
        dr.observe(1e6, 1.0)
    assert dr.correction <= Drift.CAP


def test_margin_ignores_tiny_projections_and_is_capped() -> None:
    m = Margin(initial=1.2, quantile=0.9, min_samples=10)
    for _ in range(50):
        m.observe(0, actual_ms=1.5, projected_ms=0.03)  # HTTP round trip vs a ~0 projection
    assert m.m(0) == 1.0
    for _ in range(50):
        m.observe(2, actual_ms=1000.0, projected_ms=100.0)
    assert m.m(2) == Margin.CAP


def test_T11_token_arrivals_give_the_same_tpot_in_constant_memory() -> None:
    import sys

    from narwhal.core.prediction import TokenArrivals

    events = [(0.0, 1), (0.02, 1), (0.04, 1), (0.06, 2)]
    acc = TokenArrivals()
    for t, k in events:
        acc.add(t, k)
    assert acc.tpot() == pytest.approx(tpot_from_arrivals(events))
    size = sys.getsizeof(acc)
    for i in range(100_000):  # a 100k-token answer: the bookkeeping does not grow
        acc.add(0.1 + i * 0.01, 1)
    assert sys.getsizeof(acc) == size and acc.tokens == 100_005
    one = TokenArrivals()
    one.add(0.0, 1)
    assert one.tpot() is None


# -- _Window: the sorted copy kept as values come and go ---------------------------------

from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from narwhal.core.prediction import _quantile, _Window  # noqa: E402


@given(size=st.integers(1, 20), values=st.lists(st.floats(-1e6, 1e6, allow_nan=False), max_size=80), q=st.floats(0, 1))
def test_window_quantile_equals_a_sort_of_the_last_values(size: int, values: list[float], q: float) -> None:
    w = _Window(size)
    for v in values:
        w.add(v)
    last = values[-size:]
    assert w.quantile(q) == _quantile(sorted(last), q)
    assert len(w) == len(last)


def _textbook_update(m: LinearModel, x: list[float], y: float) -> None:
    """One RLS step as the textbook writes it (the reference for LinearModel.update)."""
    k = len(x)
    w = 1.0 / max(y, 1e-3) ** 2
    px = [sum(m.P[i][j] * x[j] for j in range(k)) for i in range(k)]
    denom = m.lam / w + sum(x[i] * px[i] for i in range(k))
    if denom <= 0:
        return
    gain = [v / denom for v in px]
    err = y - sum(t * v for t, v in zip(m.theta, x, strict=True))
    m.theta = [max(0.0, m.theta[i] + gain[i] * err) for i in range(k)]
    m.P = [[(m.P[i][j] - gain[i] * px[j]) / m.lam for j in range(k)] for i in range(k)]
    m.samples += 1


@pytest.mark.parametrize("k", [2, 3, 4])
def test_the_rls_update_is_the_textbook_one(k: int) -> None:
    """LinearModel.update (written out for three features, the prefill model's) moves theta
    and P as the textbook loops do, step after step."""
    rng = random.Random(k)
    mine = LinearModel([rng.uniform(0, 50) for _ in range(k)])
    ref = LinearModel(list(mine.theta))
    for _ in range(2000):
        x = [1.0] + [rng.uniform(0, 4) for _ in range(k - 1)]
        y = rng.uniform(0.5, 200.0)
        mine.update(x, y)
        _textbook_update(ref, x, y)
        assert mine.theta == pytest.approx(ref.theta, rel=1e-12, abs=1e-300)
        assert [v for row in mine.P for v in row] == pytest.approx([v for row in ref.P for v in row], rel=1e-9, abs=1e-12)
    assert mine.samples == ref.samples == 2000
    with pytest.raises(ValueError):
        mine.update([1.0] * (k + 1), 1.0)
