"""What the router learns about each engine (docs/prediction.md).

  * PrefillModel: T(n) = s * max(0, b0 + b1*n + b2*n^2) ms (section 2), fitted from
    profiling by weighted least squares with a ridge toward the prior and b >= 0, then
    refined online by recursive least squares with forgetting (lambda = 0.999) and weight
    1/T^2; samples whose measured/predicted ratio is outside [0.2, 5] stay out of the fit
    and feed the drift score instead.
  * DecodeModel: TPOT(B) = s_dec * (a + b*B) ms for batch size B, the load-conditioned
    profile of section 8, fitted the same way.
  * Drift: EWMA of log(measured / profiled) residuals (winsorised at 3 sigma0), z =
    mu / sigma0, two one-sided CUSUMs (k = 0.5, h = 5) that set the correction factor
    s = exp(mu) on alarm ("decode correction", section 8).
  * OutputLengthLearner: windowed quantiles (256 samples, >= 20 to use a level) over a
    key hierarchy (section 7); P50 for expected decode load, P90 for safety checks.
  * Margin: the conformal ratio actual/projected TTFT per queue-depth bucket (section 4).
Features are scaled (n in thousands of tokens) so the 3x3 systems stay well conditioned.
Everything here is pure arithmetic on floats: no clock, no I/O.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections import deque
from operator import mul
from typing import Any

__all__ = [
    "LinearModel",
    "PrefillModel",
    "DecodeModel",
    "Drift",
    "OutputLengthLearner",
    "Margin",
    "tpot_from_arrivals",
    "depth_bucket",
    "DEPTH_BUCKET_OF",
]

_SCALE = 1000.0  # prompt tokens per feature unit


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        if abs(m[p][c]) < 1e-12:
            return None
        m[c], m[p] = m[p], m[c]
        for r in range(n):
            if r != c:
                f = m[r][c] / m[c][c]
                if f:
                    for k in range(c, n + 1):
                        m[r][k] -= f * m[c][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def _inverse(a: list[list[float]]) -> list[list[float]]:
    n = len(a)
    cols = []
    for i in range(n):
        e = [1.0 if j == i else 0.0 for j in range(n)]
        x = _solve(a, e)
        cols.append(x if x is not None else e)
    return [[cols[j][i] for j in range(n)] for i in range(n)]


class LinearModel:
    """y = theta . x with theta >= 0: batch fit (ridge toward a prior) + online RLS."""

    __slots__ = ("theta", "prior", "P", "lam", "ridge", "samples", "fitted")

    def __init__(self, prior: list[float], *, lam: float = 0.999, ridge: float = 1e-3) -> None:
        self.prior = list(prior)
        self.theta = list(prior)
        k = len(prior)
        self.P = [[(1e3 if i == j else 0.0) for j in range(k)] for i in range(k)]
        self.lam = lam
        self.ridge = ridge
        self.samples = 0
        self.fitted = False

    def predict(self, x: list[float]) -> float:
        return max(0.0, sum(t * v for t, v in zip(self.theta, x, strict=True)))

    def fit(self, xs: list[list[float]], ys: list[float]) -> None:
        """Weighted least squares (w = 1/y^2), ridge toward the prior, theta >= 0 by an
        active set: a coefficient that comes out negative is pinned to 0 and the rest refit."""
        k = len(self.prior)
        active = list(range(k))
        theta = [0.0] * k
        for _ in range(k):
            a = [[0.0] * len(active) for _ in active]
            b = [0.0] * len(active)
            for x, y in zip(xs, ys, strict=True):
                w = 1.0 / max(y, 1e-3) ** 2
                for i, ci in enumerate(active):
                    b[i] += w * x[ci] * y
                    for j, cj in enumerate(active):
                        a[i][j] += w * x[ci] * x[cj]
            # the ridge is relative to the data's own scale (weights 1/y^2 are tiny)
            lam = self.ridge * max(1e-300, sum(a[i][i] for i in range(len(active))) / len(active))
            for i, ci in enumerate(active):
                a[i][i] += lam
                b[i] += lam * self.prior[ci]
            sol = _solve(a, b)
            if sol is None:
                return
            theta = [0.0] * k
            for i, ci in enumerate(active):
                theta[ci] = sol[i]
            neg = [ci for ci in active if theta[ci] < 0]
            if not neg:
                break
            active = [ci for ci in active if ci not in neg]
            if not active:
                theta = [0.0] * k
                break
        self.theta = [max(0.0, t) for t in theta]
        # covariance of the fit, so online updates move it in proportion to the evidence
        a_full = [[0.0] * k for _ in range(k)]
        for x, y in zip(xs, ys, strict=True):
            w = 1.0 / max(y, 1e-3) ** 2
            for i in range(k):
                for j in range(k):
                    a_full[i][j] += w * x[i] * x[j]
        lam_full = self.ridge * max(1e-300, sum(a_full[i][i] for i in range(k)) / k)
        for i in range(k):
            a_full[i][i] += lam_full
        self.P = _inverse(a_full)
        self.samples = len(ys)
        self.fitted = True

    def update(self, x: list[float], y: float) -> None:
        """One recursive-least-squares step with forgetting factor lam and weight 1/y^2."""
        # the same sums in the same order as the textbook loops (bit for bit), without a
        # generator per row: this runs on every request's first token
        if len(x) != len(self.theta):
            raise ValueError("x and theta differ in length")
        if len(x) == 3:
            self._update3(x, y)
            return
        w = 1.0 / max(y, 1e-3) ** 2
        P = self.P
        lam = self.lam
        px = [sum(map(mul, row, x)) for row in P]
        denom = lam / w + sum(map(mul, x, px))
        if denom <= 0:
            return
        gain = [v / denom for v in px]
        theta = self.theta
        err = y - sum(map(mul, theta, x))
        self.theta = [max(0.0, t + g * err) for t, g in zip(theta, gain, strict=True)]
        self.P = [[(p - g * q) / lam for p, q in zip(row, px, strict=True)] for row, g in zip(P, gain, strict=True)]
        self.samples += 1

    def _update3(self, x: list[float], y: float) -> None:
        """`update` for three features (the prefill model's), written out: the same
        operations in the same order, so the same floats (tests/core/test_prediction.py)."""
        x0, x1, x2 = x
        (p00, p01, p02), (p10, p11, p12), (p20, p21, p22) = self.P
        w = 1.0 / max(y, 1e-3) ** 2
        lam = self.lam
        q0 = p00 * x0 + p01 * x1 + p02 * x2
        q1 = p10 * x0 + p11 * x1 + p12 * x2
        q2 = p20 * x0 + p21 * x1 + p22 * x2
        denom = lam / w + (x0 * q0 + x1 * q1 + x2 * q2)
        if denom <= 0:
            return
        g0, g1, g2 = q0 / denom, q1 / denom, q2 / denom
        t0, t1, t2 = self.theta
        err = y - (t0 * x0 + t1 * x1 + t2 * x2)
        self.theta = [max(0.0, t0 + g0 * err), max(0.0, t1 + g1 * err), max(0.0, t2 + g2 * err)]
        self.P = [
            [(p00 - g0 * q0) / lam, (p01 - g0 * q1) / lam, (p02 - g0 * q2) / lam],
            [(p10 - g1 * q0) / lam, (p11 - g1 * q1) / lam, (p12 - g1 * q2) / lam],
            [(p20 - g2 * q0) / lam, (p21 - g2 * q1) / lam, (p22 - g2 * q2) / lam],
        ]
        self.samples += 1


class Drift:
    """Residual drift score and CUSUM alarm on log(measured / predicted)."""

    __slots__ = ("alpha", "sigma0", "k", "h", "mu", "s_pos", "s_neg", "correction", "alarms", "samples", "_sq")

    MIN_SHIFT = 0.05  # a mean log residual below ~5 % moves nothing
    CAP = 10.0  # the correction stays within [1/CAP, CAP]

    def __init__(self, *, alpha: float = 0.05, sigma0: float = 0.1, k: float = 0.5, h: float = 5.0) -> None:
        self.alpha, self.sigma0, self.k, self.h = alpha, sigma0, k, h
        self.mu = 0.0
        self.s_pos = self.s_neg = 0.0
        self.correction = 1.0  # the factor applied to predictions ("decode correction")
        self.alarms = 0
        self.samples = 0
        self._sq = sigma0 * sigma0

    @property
    def score(self) -> float:
        """z = mu / sigma0: how many in-control deviations the recent mean residual is off."""
        return self.mu / self.sigma0

    def observe(self, measured: float, predicted: float) -> bool:
        """Feed one residual; True when the CUSUM alarms and the correction moved.

        Residuals are standardised by sigma = max(sigma0, the in-operation deviation)
        (an EWMA of squared residuals), so a noisier engine or machine than the profile
        saw does not alarm on noise; an alarm moves the correction only for a shift of at
        least MIN_SHIFT in the mean log residual, and the correction stays within
        [1/CAP, CAP]."""
        if measured <= 0 or predicted <= 0:
            return False
        # residual against the *corrected* prediction: after an alarm the score re-centres
        r = math.log(measured / (predicted * self.correction))
        sigma = max(self.sigma0, math.sqrt(self._sq))
        # winsorised at 3 sigma: one stalled measurement cannot raise an alarm alone
        lim = 3.0 * sigma
        r = max(-lim, min(lim, r))
        self.samples += 1
        self.mu += self.alpha * (r - self.mu)
        self._sq += self.alpha * ((r - self.mu) ** 2 - self._sq)
        z = r / sigma
        self.s_pos = max(0.0, self.s_pos + z - self.k)
        self.s_neg = max(0.0, self.s_neg - z - self.k)
        if self.s_pos > self.h or self.s_neg > self.h:
            self.s_pos = self.s_neg = 0.0
            if abs(self.mu) < self.MIN_SHIFT:
                return False
            self.correction = min(self.CAP, max(1.0 / self.CAP, self.correction * math.exp(self.mu)))
            self.mu = 0.0
            self.alarms += 1
            return True
        return False

    def calibrate(self, pairs: list[tuple[float, float]]) -> None:
        """After a profile fit, from its (measured, predicted) ms pairs: sigma0 is the
        standard deviation of their log residuals (at least 0.05; kept with fewer than three
        positive measurements), and the correction starts again at 1.0."""
        resid = [math.log(y / max(pred, 1e-6)) for y, pred in pairs if y > 0]
        if len(resid) >= 3:
            m = sum(resid) / len(resid)
            sd = math.sqrt(sum((r - m) ** 2 for r in resid) / (len(resid) - 1))
            self.sigma0 = max(0.05, sd)
        self.correction = 1.0

    def snapshot(self) -> dict[str, Any]:
        return {
            "score": round(self.score, 4),
            "mean_log_residual": round(self.mu, 4),
            "cusum_up": round(self.s_pos, 3),
            "cusum_down": round(self.s_neg, 3),
            "correction": round(self.correction, 4),
            "alarms": self.alarms,
            "samples": self.samples,
            "sigma0": round(self.sigma0, 4),
            "sigma": round(max(self.sigma0, math.sqrt(self._sq)), 4),
        }


class PrefillModel:
    """T(n) = s * (b0 + b1*n + b2*n^2) in ms for a prompt of n tokens."""

    __slots__ = ("lin", "drift", "outliers")

    def __init__(self, b0_ms: float = 20.0, b1_ms_per_token: float = 0.05, b2_ms_per_token2: float = 0.0) -> None:
        self.lin = LinearModel([b0_ms, b1_ms_per_token * _SCALE, b2_ms_per_token2 * _SCALE * _SCALE])
        self.drift = Drift(sigma0=0.15)
        self.outliers = 0

    @staticmethod
    def _x(n: float) -> list[float]:
        u = n / _SCALE
        return [1.0, u, u * u]

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """(b0 ms, b1 ms/token, b2 ms/token^2)."""
        t = self.lin.theta
        return t[0], t[1] / _SCALE, t[2] / (_SCALE * _SCALE)

    def predict_ms(self, n: float) -> float:
        t = self.lin.theta
        u = n / _SCALE
        return self.drift.correction * max(0.0, t[0] + t[1] * u + t[2] * u * u)

    def fit(self, samples: list[tuple[float, float]]) -> None:
        """Profiling: (prompt tokens, measured ms) pairs."""
        self.lin.fit([self._x(n) for n, _ in samples], [y for _, y in samples])
        self.drift.calibrate([(y, self.predict_ms(n)) for n, y in samples])

    def observe(self, n: float, measured_ms: float) -> None:
        """Online refinement from one measured prefill (service) time."""
        pred = self.predict_ms(n)
        trusted = self.lin.fitted or self.lin.samples >= 20  # a prior alone filters nothing
        if trusted and pred > 0 and not (0.2 <= measured_ms / pred <= 5.0):
            self.outliers += 1
            self.drift.observe(measured_ms, pred / self.drift.correction)
            return
        self.drift.observe(measured_ms, pred / self.drift.correction if pred > 0 else measured_ms)
        self.lin.update(self._x(n), measured_ms / self.drift.correction)

    def snapshot(self) -> dict[str, Any]:
        b0, b1, b2 = self.coefficients
        return {
            "b0_ms": round(b0, 4),
            "b1_ms_per_token": round(b1, 8),
            "b2_ms_per_token2": round(b2, 12),
            "samples": self.lin.samples,
            "fitted": self.lin.fitted,
            "outliers": self.outliers,
        }


class DecodeModel:
    """TPOT(B) = s_dec * (a + b*B) ms at batch size B."""

    __slots__ = ("lin", "drift", "last_tpot_ms")

    def __init__(self, a_ms: float = 20.0, b_ms: float = 0.2) -> None:
        self.lin = LinearModel([a_ms, b_ms])
        self.drift = Drift(sigma0=0.1)
        self.last_tpot_ms: float | None = None

    def predict_ms(self, batch: float) -> float:
        t = self.lin.theta
        return self.drift.correction * max(0.0, t[0] + t[1] * batch)

    def fit(self, samples: list[tuple[float, float]]) -> None:
        """Profiling: (batch size, measured TPOT ms) pairs."""
        batches = {b for b, _ in samples}
        if len(batches) < 2:
            # one batch size: the intercept carries it, the slope keeps its prior share
            b = next(iter(batches))
            mean = sum(y for _, y in samples) / len(samples)
            slope = min(self.lin.theta[1], mean / max(b, 1.0) / 10)
            self.lin.theta = [max(0.0, mean - slope * b), slope]
            self.lin.fitted = True
            self.lin.samples = len(samples)
        else:
            self.lin.fit([[1.0, b] for b, _ in samples], [y for _, y in samples])
        self.drift.calibrate([(y, self.predict_ms(b)) for b, y in samples])

    def observe(self, batch: float, tpot_ms: float) -> bool:
        """One measured TPOT (from token IDs): drift first, then the profile's own refinement.
        True when the drift alarm fired."""
        self.last_tpot_ms = tpot_ms
        base = max(0.0, self.lin.theta[0] + self.lin.theta[1] * batch)
        return self.drift.observe(tpot_ms, base) if base > 0 else False

    def snapshot(self) -> dict[str, Any]:
        a, b = self.lin.theta
        return {
            "a_ms": round(a, 4),
            "b_ms_per_sequence": round(b, 6),
            "tpot_ms_at_batch_1": round(self.predict_ms(1), 4),
            "last_tpot_ms": None if self.last_tpot_ms is None else round(self.last_tpot_ms, 4),
            "fitted": self.lin.fitted,
            "samples": self.lin.samples,
        }


class TokenArrivals:
    """What TPOT needs of a stream's output events, in constant memory (issue 11: one
    tuple per event was ~9 MB for a 100k-token answer): the first and last event's time,
    the events and the IDs they carried."""

    __slots__ = ("first_at", "last_at", "events", "tokens")

    def __init__(self) -> None:
        self.first_at = self.last_at = 0.0
        self.events = self.tokens = 0

    def add(self, now: float, k: int) -> None:
        if not self.events:
            self.first_at = now
        self.last_at = now
        self.events += 1
        self.tokens += k

    def tpot(self) -> float | None:
        """T11: (t_last - t_first) / (N - 1), N the IDs (the first event's all at t_first)."""
        if self.tokens < 2 or self.events < 2:
            return None
        return (self.last_at - self.first_at) / (self.tokens - 1)


def tpot_from_arrivals(arrivals: list[tuple[float, int]]) -> float | None:
    """TPOT = (t_last - t_first) / (N - 1) over identified tokens (docs/prediction.md section 9).

    `arrivals` holds (time, IDs in the event) per event; N is the total of IDs. The first
    event's IDs all count as arriving at t_first."""
    n = sum(k for _, k in arrivals)
    if n < 2 or len(arrivals) < 2:
        return None
    return (arrivals[-1][0] - arrivals[0][0]) / (n - 1)


def _quantile(sorted_vals: list[float], q: float) -> float:
    if not sorted_vals:
        return 0.0
    pos = q * (len(sorted_vals) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_vals) - 1)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


class _Window:
    """The last `size` values, and the same values kept sorted as they come and go (an
    insertion and a deletion by bisection per value: a quantile per first token cost a
    sort of the whole window, ~20 us at 500, on the TTFT path)."""

    __slots__ = ("vals", "_sorted")

    def __init__(self, size: int) -> None:
        self.vals: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []

    def add(self, v: float) -> None:
        vals = self.vals
        if len(vals) == vals.maxlen:
            del self._sorted[bisect_left(self._sorted, vals[0])]
        vals.append(v)
        insort(self._sorted, v)

    def quantile(self, q: float) -> float:
        return _quantile(self._sorted, q)

    def __len__(self) -> int:
        return len(self.vals)


def _half_octave(n: float) -> int:
    return int(2 * math.log2(max(n, 1.0)))


class OutputLengthLearner:
    """Windowed output-length quantiles over (route, max_tokens bucket) ->
    (route, half-octave prompt bucket) -> (route) -> all."""

    __slots__ = ("window", "min_samples", "default", "_w", "observed", "censored")

    def __init__(self, *, window: int = 256, min_samples: int = 20, default: float = 128.0) -> None:
        self.window, self.min_samples, self.default = window, min_samples, default
        self._w: dict[tuple[Any, ...], _Window] = {}
        self.observed = 0
        self.censored = 0

    def _keys(self, route: str, prompt_tokens: float, max_tokens: int | None) -> list[tuple[Any, ...]]:
        mt = None if max_tokens is None else _half_octave(max_tokens)
        return [("mt", route, mt), ("p", route, _half_octave(prompt_tokens)), ("r", route), ("all",)]

    def observe(self, route: str, prompt_tokens: float, max_tokens: int | None, output_tokens: int, *, finish_reason: str | None = None) -> None:
        # A "length" finish is censored at max_tokens: stored as is, so it can only raise
        # the quantiles of its key (a stand-in for Kaplan-Meier, docs/prediction.md section 7).
        self.observed += 1
        if finish_reason == "length":
            self.censored += 1
        for key in self._keys(route, prompt_tokens, max_tokens):
            w = self._w.get(key)
            if w is None:
                w = self._w[key] = _Window(self.window)
            w.add(float(output_tokens))

    def predict(self, route: str, prompt_tokens: float, max_tokens: int | None, q: float = 0.5) -> float:
        for key in self._keys(route, prompt_tokens, max_tokens):
            w = self._w.get(key)
            if w is not None and len(w) >= self.min_samples:
                v = w.quantile(q)
                break
        else:
            v = self.default
        return float(min(v, max_tokens)) if max_tokens is not None else v

    def snapshot(self) -> dict[str, Any]:
        w = self._w.get(("all",))
        return {
            "observed": self.observed,
            "censored": self.censored,
            "p50": None if not w else round(w.quantile(0.5), 2),
            "p90": None if not w else round(w.quantile(0.9), 2),
            "keys": len(self._w),
        }


_DEPTH_BUCKETS = ((0, 0), (1, 2), (3, 5), (6, 10), (11, 1 << 30))


# the bucket of each small depth, precomputed for the admission hot path
DEPTH_BUCKET_OF: tuple[int, ...] = tuple(next(i for i, (lo, hi) in enumerate(_DEPTH_BUCKETS) if lo <= d <= hi) for d in range(_DEPTH_BUCKETS[-1][0]))


def depth_bucket(depth: int) -> int:
    for i, (lo, hi) in enumerate(_DEPTH_BUCKETS):
        if lo <= depth <= hi:
            return i
    return len(_DEPTH_BUCKETS) - 1


class Margin:
    """m = max(1, q-quantile of actual/projected TTFT) per queue-depth bucket; `initial`
    until a bucket has `min_samples` samples."""

    __slots__ = ("initial", "quantile", "min_samples", "adaptive", "window", "_w", "_m", "covered", "samples", "_abs_err", "_recent")

    def __init__(self, initial: float = 1.2, quantile: float = 0.9, min_samples: int = 50, adaptive: bool = True, window: int = 500) -> None:
        self.initial, self.quantile, self.min_samples = initial, quantile, min_samples
        self.adaptive, self.window = adaptive, window
        self._w = [_Window(self.window) for _ in _DEPTH_BUCKETS]
        self._m = [self.initial] * len(_DEPTH_BUCKETS)
        self.covered = 0
        self.samples = 0
        self._abs_err = 0.0
        self._recent: deque[float] = deque(maxlen=1000)  # actual / projected

    def m(self, depth: int) -> float:
        return self._m[depth_bucket(depth)]

    @property
    def factors(self) -> list[float]:
        """m per depth bucket (index with DEPTH_BUCKET_OF; depths past it: the last)."""
        return self._m

    # Projections below FLOOR_MS are compared as FLOOR_MS: a near-zero projection (an idle
    # engine, a tiny prompt) against a TTFT that includes the HTTP round trip would teach
    # a margin of 30x, which then refuses real work. A margin never exceeds CAP: past
    # that the model itself is wrong, and the drift correction is the fix.
    FLOOR_MS = 25.0
    CAP = 4.0

    def observe(self, depth: int, actual_ms: float, projected_ms: float) -> None:
        if projected_ms <= 0:
            return
        b = depth_bucket(depth)
        self.samples += 1
        ratio = actual_ms / max(projected_ms, self.FLOOR_MS)
        self._abs_err += abs(ratio - 1.0)
        self._recent.append(ratio)
        if ratio <= self._m[b]:
            self.covered += 1
        if not self.adaptive:
            return
        w = self._w[b]
        w.add(ratio)
        if len(w) >= self.min_samples:
            self._m[b] = min(self.CAP, max(1.0, w.quantile(self.quantile)))

    def snapshot(self) -> dict[str, Any]:
        recent = sorted(self._recent)
        return {
            "by_depth_bucket": [round(x, 4) for x in self._m],
            "samples": self.samples,
            # how often the actual TTFT stayed within projection x margin
            "coverage": None if not self.samples else round(self.covered / self.samples, 4),
            # accuracy of the TTFT projection itself: mean |actual/projected - 1|
            "projection_mape": None if not self.samples else round(self._abs_err / self.samples, 4),
            "actual_over_projected_p50": None if not recent else round(_quantile(recent, 0.5), 4),
            "actual_over_projected_p90": None if not recent else round(_quantile(recent, 0.9), 4),
        }
