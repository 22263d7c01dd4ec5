"""Online model of a model runner's forward time: free per-token-count curve plus context slope.

    T(n, c) = g(bucket(n)) + a * c,        a >= 0

n is the number of tokens in the forward, c the context tokens attended. bucket(n) is n for
n <= 32 and the next power of two above; a sample of 40 tokens counts in bucket 64, and a
prediction for 40 tokens interpolates between g(32) and g(64).
g is free: on a CPU the second token costs more than eight (no linearity, no monotonicity).

Fit: weighted least squares with exponential forgetting, kept as sufficient statistics per
bucket k over its samples i (weights w_i, context x_i = c_i / 1024, time y_i):

    W_k = sum w,  X_k = sum w x,  XX_k = sum w x^2,  Y_k = sum w y,  XY_k = sum w x y

A new sample in bucket k first multiplies bucket k's statistics by `forget`. Forgetting is per
bucket, not global, so a rarely used bucket keeps its value instead of fading because others
were busy. Minimising sum_k sum_i w_i (g_k + a x_i - y_i)^2 + lambda (a - a_0)^2 gives g_k in
closed form for a given a, and a from the pooled within-bucket regression:

    a = (sum_k [XY_k - X_k Y_k / W_k] + lambda a_0) / (sum_k [XX_k - X_k^2 / W_k] + lambda)
    a <- max(a, 0),   g_k = (Y_k - a X_k) / W_k

lambda is a small ridge (a -> a_0 = 0 when contexts never vary) or, after from_coefficients,
the weight of the profiled slope. Seeds are pseudo-samples in the same statistics (they fade
as their bucket is observed). Buckets with neither seed nor sample are interpolated linearly in
n between known buckets, held flat below the smallest, and extrapolated above the largest with
the last segment's slope (never negative).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Mapping
from typing import Any, TypedDict

_CONTEXT_SCALE = 1024.0  # slope fitted per 1024 context tokens, so a and g have like magnitudes
_SLOPE_RIDGE = 1e-3  # pseudo-weight pulling an unidentified slope to its prior
_EXACT_BUCKETS = 32  # token counts up to this are their own bucket


class CostCoefficients(TypedDict):
    """Fitted coefficients, as written into a profile JSON."""

    g_s: dict[int, float]  # bucket size -> g, seconds (known buckets only)
    slope_s_per_token: float  # a, seconds per context token


def bucket_of(tokens: int) -> int:
    """The bucket a forward of `tokens` tokens is priced at: exact up to 32, then powers of two."""
    if tokens <= _EXACT_BUCKETS:
        return tokens
    return 1 << (tokens - 1).bit_length()


def _check(tokens: int, context: int) -> None:
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")


_MEMO_SIZE = 4096


class ForwardCostModel:
    """Online T(n, c) = g(bucket(n)) + a * c for one model runner, in seconds."""

    def __init__(
        self,
        forget: float = 0.98,
        outlier_factor: float = 3.0,
        min_observations_for_outliers: int = 3,
        max_consecutive_outliers: int = 3,
    ) -> None:
        if not 0 < forget <= 1:
            raise ValueError(f"forget must be in (0, 1], got {forget}")
        if outlier_factor <= 1:
            raise ValueError(f"outlier_factor must be > 1, got {outlier_factor}")
        self.forget = forget
        self.outlier_factor = outlier_factor
        self.min_observations_for_outliers = min_observations_for_outliers
        # This many rejections in a row in one bucket means the cost really changed: accept.
        self.max_consecutive_outliers = max_consecutive_outliers
        self._stats: dict[int, list[float]] = {}  # bucket -> [W, X, XX, Y, XY]
        self._counts: dict[int, int] = {}  # bucket -> accepted real observations
        self._streak: dict[int, int] = {}  # bucket -> consecutive rejected samples
        self._slope_prior = 0.0  # a_0, seconds per context token
        self._slope_weight = _SLOPE_RIDGE
        self.num_observations = 0
        self.num_rejected = 0
        self._dirty = True
        self._slope = 0.0
        self._knots: list[int] = []  # known buckets, ascending
        self._values: list[float] = []  # g at the knots, seconds
        # (tokens, context) -> predicted seconds, until the next fit: selection and pruning
        # ask for the same few shapes thousands of times per iteration.
        self._memo: dict[tuple[int, int], float] = {}

    # ---- data in -------------------------------------------------------------------------

    def _add(self, tokens: int, context: int, seconds: float, weight: float, decay: float) -> None:
        self._add_at(bucket_of(tokens), context, seconds, weight, decay)

    def _add_scaled(self, k: int, context: float, seconds: float, weight: float) -> None:
        """One observation expressed as a bucket-k sample of the given weight (it decays)."""
        self._add_at(k, context, seconds, weight, decay=self.forget)

    def _add_at(self, k: int, context: float, seconds: float, weight: float, decay: float) -> None:
        x = context / _CONTEXT_SCALE
        s = self._stats.setdefault(k, [0.0] * 5)
        for i, term in enumerate((1.0, x, x * x, seconds, x * seconds)):
            s[i] = s[i] * decay + weight * term
        self._dirty = True

    def seed(self, points: Iterable[tuple[int, int, float]], weight: float = 3.0) -> None:
        """Add offline-profile (tokens, context, seconds) points as `weight` pseudo-samples each."""
        if weight <= 0:
            raise ValueError(f"seed weight must be > 0, got {weight}")
        for tokens, context, seconds in points:
            _check(tokens, context)
            self._add(tokens, context, float(seconds), weight, decay=1.0)

    def observe(self, tokens: int, context: int, seconds: float) -> bool:
        """Add one measured forward; returns False if it was rejected as an outlier."""
        _check(tokens, context)
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"seconds must be a finite time >= 0, got {seconds}")
        k = bucket_of(tokens)
        if self._counts.get(k, 0) >= self.min_observations_for_outliers:
            limit = self.outlier_factor * self.predict(tokens, context)
            streak = self._streak.get(k, 0)
            if seconds > limit and streak + 1 < self.max_consecutive_outliers:
                # An OS hiccup (page fault storm, another process) must not poison g.
                self._streak[k] = streak + 1
                self.num_rejected += 1
                return False
        self._streak[k] = 0
        self._counts[k] = self._counts.get(k, 0) + 1
        self.num_observations += 1
        lo = k // 2
        if k != tokens and lo in self._stats:
            # predict() interpolates g between buckets lo and k, so this sample says
            #   (1 - f) g(lo) + f g(k) + a c = y,   f = (tokens - lo) / (k - lo)
            # With g(lo) at its current fit that is g(k) + a (c / f) = (y - (1 - f) g(lo)) / f,
            # with weight f^2 (the exact least-squares term). Taking the sample as g(k) itself
            # would price every forward of 33-63 tokens at 64's cost, and so pull g(64) down
            # to the smaller forwards' times.
            f = (tokens - lo) / (k - lo)
            if self._dirty:
                self._solve()
            target = (seconds - (1.0 - f) * self._g(lo)) / f
            self._add_scaled(k, context / f, target, f * f)
            return True
        self._add(tokens, context, float(seconds), 1.0, decay=self.forget)
        return True

    # ---- fit -----------------------------------------------------------------------------

    def _solve(self) -> None:
        num = self._slope_weight * self._slope_prior * _CONTEXT_SCALE
        den = self._slope_weight
        for w, x, xx, y, xy in self._stats.values():
            num += xy - x * y / w
            den += max(xx - x * x / w, 0.0)
        slope = max(num / den, 0.0)  # seconds per _CONTEXT_SCALE tokens
        self._knots = sorted(self._stats)
        self._values = [
            (self._stats[k][3] - slope * self._stats[k][1]) / self._stats[k][0] for k in self._knots
        ]
        self._slope = slope / _CONTEXT_SCALE
        self._dirty = False
        self._memo.clear()

    def _g(self, k: int) -> float:
        """g at bucket k: fitted, or interpolated / extrapolated from the known buckets."""
        knots, values = self._knots, self._values
        if not knots:
            return 0.0
        i = bisect.bisect_left(knots, k)
        if i < len(knots) and knots[i] == k:
            return values[i]
        if i == 0:
            return values[0]
        if i == len(knots):
            if len(knots) == 1:
                return values[-1]
            step = (values[-1] - values[-2]) / (knots[-1] - knots[-2])
            return values[-1] + max(step, 0.0) * (k - knots[-1])
        k0, k1, v0, v1 = knots[i - 1], knots[i], values[i - 1], values[i]
        return v0 + (v1 - v0) * (k - k0) / (k1 - k0)

    def predict(self, tokens: int, context: int) -> float:
        """Predicted forward seconds for `tokens` tokens over `context` tokens (0 with no data)."""
        if self._dirty:
            self._solve()
        hit = self._memo.get((tokens, context))
        if hit is not None:
            return hit
        _check(tokens, context)
        k = bucket_of(tokens)
        g = self._g(k)
        if k != tokens:
            # Between two power-of-two buckets a forward runs at its own size (padding is
            # the caller's choice): interpolate rather than price it at the next bucket.
            lo = k // 2
            g = self._g(lo) + (g - self._g(lo)) * (tokens - lo) / (k - lo)
        value = max(g + self._slope * context, 0.0)
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[(tokens, context)] = value
        return value

    def best_padded(self, tokens: int, context: int, max_tokens: int) -> int:
        """Token count in [tokens, max_tokens] (tokens or a bucket size) with the least predicted
        time, smallest on ties; `tokens` itself when max_tokens <= tokens."""
        best, best_s = tokens, self.predict(tokens, context)
        m = tokens + 1
        while m <= max_tokens:
            if bucket_of(m) == m:
                s = self.predict(m, context)
                if s < best_s:
                    best, best_s = m, s
                m += 1
            else:
                m = bucket_of(m)
        return best

    # ---- persistence -----------------------------------------------------------------------

    def coefficients(self) -> CostCoefficients:
        """Per-bucket g of the known buckets and the context slope a."""
        if self._dirty:
            self._solve()
        return {"g_s": dict(zip(self._knots, self._values)), "slope_s_per_token": self._slope}

    @classmethod
    def from_coefficients(
        cls,
        g_s: Mapping[int, float],
        slope_s_per_token: float,
        weight: float = 3.0,
        **kwargs: Any,
    ) -> ForwardCostModel:
        """A model seeded with a profile: each g value and the slope count as `weight` samples."""
        if slope_s_per_token < 0:
            raise ValueError(f"slope_s_per_token must be >= 0, got {slope_s_per_token}")
        model = cls(**kwargs)
        model.seed(((int(n), 0, float(g)) for n, g in g_s.items()), weight=weight)
        model._slope_prior = float(slope_s_per_token)
        model._slope_weight = weight
        return model

    def to_json(self) -> str:
        """The coefficients as a JSON object (bucket keys as strings)."""
        coef = self.coefficients()
        g_s = {str(k): v for k, v in coef["g_s"].items()}
        return json.dumps({"g_s": g_s, "slope_s_per_token": coef["slope_s_per_token"]})

    @classmethod
    def from_json(cls, text: str, weight: float = 3.0, **kwargs: Any) -> ForwardCostModel:
        """Inverse of to_json: a model seeded with the stored coefficients."""
        data = json.loads(text)
        g_s = {int(k): float(v) for k, v in data["g_s"].items()}
        return cls.from_coefficients(g_s, float(data["slope_s_per_token"]), weight, **kwargs)


class DraftCostModel:
    """Draft iteration time: one first step (roots and catch-up tokens), then frontier steps.

    T = step(roots, c) + (num_steps - 1) * step(frontier_tokens, c); the context is taken as
    constant over the iteration (its growth by a few tokens per step is within noise).
    """

    def __init__(self, step: ForwardCostModel | None = None) -> None:
        self.step = step if step is not None else ForwardCostModel()

    def predict(self, num_steps: int, roots: int, frontier_tokens: int, context: int) -> float:
        """Predicted seconds of a draft iteration of `num_steps` forwards (0 for 0 steps)."""
        if num_steps <= 0:
            return 0.0
        first = self.step.predict(roots, context)
        return first + (num_steps - 1) * self.step.predict(max(frontier_tokens, 1), context)

    def observe_step(self, tokens: int, context: int, seconds: float) -> bool:
        """Add one measured draft forward; False if rejected as an outlier."""
        return self.step.observe(tokens, context, seconds)
