"""Online model of a model runner's forward time: a free curve in the token count, plus a
context slope per token count, and what prompt tokens and tree nodes cost apart from decode
tokens.

    T(n, c, s, q, t) = g(bucket(n)) + a(bucket(n)) * c - b * s + e * q + h * t,  a, b, e, h >= 0

n is the number of tokens in the forward, c the context tokens its sequences attend (each
sequence's cached tokens, once). s of the n tokens are silent: their logits are not computed
(prompt-chunk tokens, padding), and q is the query-key pairs they compute (a chunk of m tokens
after p cached ones: m p + m (m + 1) / 2). t is the pairs of each tree node past its root (a
node at depth d of a request with p cached tokens attends p + d + 1 keys), which c, counting
the request once, does not see (`ForwardBatch.cost_terms` counts s, q and t). g is the cost
with every row's logits. b is one output row's share (the LM head, vocab x hidden per row: on
ggml, 4 decode + 16 prompt tokens over 24 x 300 cached took 112 ms, the same 20 tokens all
with logits 122 ms). e prices a chunk's attention, which c counts once per sequence while each
chunk token does it: a 16-token chunk 1,000 tokens into its prompt does 16,000 query-key pairs
where a decode token does 1,000. Without these two terms every decode iteration carrying a
prompt chunk was priced as if its tokens were decode tokens (~10% high for small chunks near
the start of a prompt, low for chunks deep in a long one). h is the same for tree nodes, and
is its own coefficient because the two differ: on ggml a 3-node tree 1,500 tokens into one
request took 32.8 ms where 3 decode rows over 3 x 500 took 24.9 ms (~2.6 us per extra pair),
while a chunk's pair costs about half that. Without t a k-node tree was priced as k decode
rows; with t in e, one coefficient fitted on both (4.2 us on a speculating ggml server)
overpriced big chunks' pairs and the big buckets' g was fitted low to make up (its prompts
alone priced up to 40% lower than before, 1.6-2.1 ms per token at 256-875 against ~3.7
measured).

bucket(n) is n for n <= 32 and the next power of two above; a sample of 40 tokens counts
in bucket 64, and a prediction for 40 tokens interpolates between buckets 32 and 64.
g is free: on a CPU the second token costs more than eight (no linearity, no monotonicity).
The slope is per bucket because attention work is query-key pairs, not context: a decode
forward of n tokens over c context tokens does about c pairs, a tree of k tokens per request
about k c. One shared slope, fitted mostly on prefill chunks, priced a decode iteration over
long contexts at seconds (2.2 s predicted for a 120 ms forward).

Fit: weighted least squares with exponential forgetting, kept as sufficient statistics per
bucket k: the weighted moments M_k = sum_i w_i v_i v_i^T of v = (1, x, z, u, t', y) over its
samples (x = c / 1024, z = s, u = q / 65536, t' = t / 65536, y seconds). A new sample in
bucket k first multiplies bucket k's moments by `forget`. Forgetting is per bucket, not
global, so a rarely used bucket keeps its value instead of fading because others were busy.

b, e and h come first, shared by every bucket: in each bucket the spreads of z, u, t' and y
with the intercept and x taken out (Frisch-Waugh), summed over buckets, give a 3 x 3 ridge
least squares for (-b, e, h) (toward a stored model's values, else 0; each ridge worth one
sample 2 rows or 6,554 pairs off its bucket's mean); of the solutions with some coefficients
held at 0 and the others solved exactly, the best one whose signs are right is kept. Then
each bucket is fitted on y' = y + b z - e u - h t', minimising
sum_i w_i (g_k + a_k x_i - y'_i)^2 + lambda (a_k - a_0)^2, with W, X, XX, Y', XY' its sums
of w, w x, w x^2, w y', w x y':

    a_k = max((XY'_k - X_k Y'_k / W_k + lambda a_0) / (XX_k - X_k^2 / W_k + lambda), 0)
    g_k = (Y'_k - a_k X_k) / W_k
    (if g_k < 0: g_k = 0, a_k = max((XY'_k + lambda a_0) / (XX_k + lambda), 0): through 0)

lambda is a ridge worth one sample at 1024 tokens of context spread. a_0 is the stored slope
of a model from from_coefficients, else the pooled slope of the bucket's regime (decode-sized
buckets up to 32 tokens, prefill-sized above: sum of covariances over sum of spreads), else 0:
a bucket whose contexts barely varied borrows its neighbours' evidence. Seeds are
pseudo-samples in the same statistics (they fade as their bucket is observed). Buckets with
neither seed nor sample are interpolated linearly in n between known buckets (g and a), held
flat below the smallest, and extrapolated above the largest with the last segment's slope in
n for g (never negative) and the last a. Silent rows never take more than half a forward's
predicted time off (a fit on few mixed forwards must not price a big chunk at nothing).

`token_slope(n, m, c)` is the weighted least-squares slope, in the token count, of the
predictions at the known exact buckets from n/2 to 2m: what one more token costs around those
sizes with the buckets' own noise averaged out (speculation control prices tree nodes no lower
than that; a difference of two adjacent buckets can come out at nothing or below); 0 (no
floor) from n = 32 on, where forwards are priced between power-of-two knots.
"""

from __future__ import annotations

import bisect
import json
import math
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, TypedDict

from adaserve.exec.timing import measured_once

_CONTEXT_SCALE = 1024.0  # slope fitted per 1024 context tokens, so a and g have like magnitudes
_SLOPE_RIDGE = 1.0  # pseudo-weight pulling a bucket's slope to its prior (see the docstring)
_EXACT_BUCKETS = 32  # token counts up to this are their own bucket
_PAIR_SCALE = 65536.0  # query-key pairs (cost_terms) counted in units of this
_SILENT_RIDGE = 4.0  # pseudo-weight pulling b to its prior: one sample 2 silent rows off
_PAIR_RIDGE = 0.01  # pseudo-weight pulling e (and h) to its prior: one sample 6,554 pairs off
_MAX_SILENT_SAVING = 0.5  # silent rows take at most this share off a forward's time
_ONE, _X, _Z, _U, _T, _Y = range(6)  # the sample vector v's entries
_SHARED = (_Z, _U, _T)  # the entries whose coefficients (-b, e, h) every bucket shares


class MeasuredRunner(Protocol):
    """What seeding from start-up measurements reads of a runner (`exec/runner.py`)."""

    def cost_points(self, max_tokens: int) -> list[tuple[int, int, float]]: ...

    def tree_pair_cost(self) -> float | None: ...

    def timing_key(self) -> tuple | None: ...


class CostCoefficients(TypedDict):
    """Fitted coefficients, as written into a profile JSON."""

    g_s: dict[int, float]  # bucket size -> g, seconds (known buckets only)
    slopes_s_per_token: dict[int, float]  # bucket size -> a, seconds per context token
    slope_s_per_token: float  # the buckets' slopes pooled (weighted by their context spread)
    silent_row_s: float  # b: seconds saved per token that returns no logits
    silent_pair_s: float  # e: seconds per query-key pair of the silent tokens
    tree_pair_s: float  # h: seconds per query-key pair of tree nodes past their root


def bucket_of(tokens: int) -> int:
    """The bucket a forward of `tokens` tokens is priced at: exact up to 32, then powers of two."""
    if tokens <= _EXACT_BUCKETS:
        return tokens
    return 1 << (tokens - 1).bit_length()


def _check(
    tokens: int, context: int, silent: int = 0, silent_pairs: int = 0, tree_pairs: int = 0
) -> None:
    if tokens < 1:
        raise ValueError(f"tokens must be >= 1, got {tokens}")
    if context < 0:
        raise ValueError(f"context must be >= 0, got {context}")
    if not 0 <= silent <= tokens:
        raise ValueError(f"silent tokens must be in [0, {tokens}], got {silent}")
    if silent_pairs < 0 or tree_pairs < 0:
        raise ValueError(f"pairs must be >= 0, got {silent_pairs} and {tree_pairs}")


_MEMO_SIZE = 4096
# Forwards whose prediction error is kept (the noise a simulation of this server draws).
ERROR_WINDOW = 4096
ERROR_LEVELS = (
    *(0.0, 0.01, 0.025, 0.05),
    *(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9),
    *(0.95, 0.975, 0.99, 1.0),
)


class ForwardCostModel:
    """Online T(n, c, s, q, t) = g(bucket(n)) + a(bucket(n)) * c - b * s + e * q + h * t for one
    model runner, in seconds."""

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
        self._stats: dict[int, list[list[float]]] = {}  # bucket -> M, 5 x 5 moments of v
        # bucket -> its share of the pooled fit of b, e and h (_residual_moments), until it
        # changes: a fit runs every iteration, a sample changes one bucket.
        self._residuals: dict[int, tuple[list[list[float]], list[float]]] = {}
        self._shared_fit: tuple[float, float, float] | None = None  # (b, e, h) until it moves
        self._counts: dict[int, int] = {}  # bucket -> accepted real observations
        self._streak: dict[int, int] = {}  # bucket -> consecutive rejected samples
        self._slope_prior = 0.0  # a_0, seconds per context token
        self._slope_priors: dict[int, float] = {}  # per-bucket a_0 (from a stored model)
        self._slope_weight = _SLOPE_RIDGE
        # b and e, their priors (b_0, e_0) and ridge weights: seconds per silent token and per
        # _PAIR_SCALE extra pairs
        self._silent, self._pairs, self._tree = 0.0, 0.0, 0.0
        self._silent_prior, self._pairs_prior, self._tree_prior = 0.0, 0.0, 0.0
        self._silent_weight, self._pairs_weight = _SILENT_RIDGE, _PAIR_RIDGE
        self.num_observations = 0
        self.num_rejected = 0
        # log(measured / predicted) of the last forwards observed once their bucket had a fit:
        # how far real forwards stray from the prediction (a simulator draws its noise here).
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)
        self._dirty = True
        self._slope = 0.0  # pooled, for reporting
        self._knots: list[int] = []  # known buckets, ascending
        self._values: list[float] = []  # g at the knots, seconds
        self._slopes: list[float] = []  # a at the knots, seconds per context token
        # (tokens, context, silent, pairs, tree pairs) -> predicted seconds, until the next
        # fit: selection and pruning ask for the same few shapes thousands of times per
        # iteration.
        self._memo: dict[tuple[int, int, int, int, int], float] = {}
        self._slope_memo: dict[tuple[int, int, int], float] = {}  # token_slope, until the next fit

    # ---- data in -------------------------------------------------------------------------

    def _add_at(
        self,
        k: int,
        context: float,
        silent: int,
        silent_pairs: int,
        tree_pairs: int,
        seconds: float,
        weight: float,
        decay: float,
    ) -> None:
        v = (
            1.0,
            context / _CONTEXT_SCALE,
            float(silent),
            silent_pairs / _PAIR_SCALE,
            tree_pairs / _PAIR_SCALE,
            seconds,
        )
        m = self._stats.setdefault(k, [[0.0] * 6 for _ in range(6)])
        # A bucket that has seen no silent token, chunk pair or tree pair (every decode-only
        # bucket) adds exactly nothing to the pooled fit of (b, e, h): a sample that keeps it
        # so leaves that fit as it was, and the refit every iteration skips it.
        shared_moved = any(v[i] != 0.0 or m[i][i] != 0.0 for i in _SHARED)
        for i, row in enumerate(m):
            wv = weight * v[i]
            for j in range(6):
                row[j] = row[j] * decay + wv * v[j]
        if shared_moved:
            self._residuals.pop(k, None)
            self._shared_fit = None
        self._dirty = True

    def seed(self, points: Iterable[tuple[int, int, float]], weight: float = 3.0) -> None:
        """Add offline-profile (tokens, context, seconds) points as `weight` pseudo-samples each."""
        if weight <= 0:
            raise ValueError(f"seed weight must be > 0, got {weight}")
        for tokens, context, seconds in points:
            _check(tokens, context)
            self._add_at(bucket_of(tokens), context, 0, 0, 0, float(seconds), weight, decay=1.0)

    def set_tree_pair_prior(self, seconds_per_pair: float) -> None:
        """h's prior (seconds per tree pair, measured at start-up: `timing.tree_pair_cost`),
        which holds until the forwards observed say otherwise. Seeds from the cost curve
        carry no tree pairs, so without it a tree deep in a context is priced as if its
        nodes attended the short contexts of the curve's forwards."""
        if not seconds_per_pair >= 0:
            raise ValueError(f"seconds per tree pair must be >= 0, got {seconds_per_pair}")
        self._tree_prior = float(seconds_per_pair) * _PAIR_SCALE
        self._shared_fit = None
        self._dirty = True

    def seed_measured(self, runner: MeasuredRunner, max_tokens: int, trees: bool) -> None:
        """Seed from a runner's start-up measurements: its cost curve up to `max_tokens` and,
        for a server that verifies `trees`, what a tree pair costs (h's prior) when it could
        be measured (on llama.cpp here ~2 s of start-up: incremental decoding skips it)."""
        self.seed(
            measured_once(runner, f"curve:{max_tokens}", lambda: runner.cost_points(max_tokens))
        )
        h = measured_once(runner, "tree pairs", runner.tree_pair_cost) if trees else None
        if h is not None:
            self.set_tree_pair_prior(h)

    def observe(
        self,
        tokens: int,
        context: int,
        seconds: float,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> bool:
        """Add one measured forward of `tokens` tokens, `silent` of them without logits and
        computing `silent_pairs` query-key pairs, its tree nodes past their roots `tree_pairs`
        (`ForwardBatch.cost_terms`); False if it was rejected as an outlier."""
        _check(tokens, context, silent, silent_pairs, tree_pairs)
        if not seconds >= 0 or seconds == float("inf"):
            raise ValueError(f"seconds must be a finite time >= 0, got {seconds}")
        k = bucket_of(tokens)
        if self._counts.get(k, 0) >= self.min_observations_for_outliers:
            predicted = self.predict(tokens, context, silent, silent_pairs, tree_pairs)
            self._note_error(seconds, predicted)
            limit = self.outlier_factor * predicted
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
            # predict() interpolates between buckets lo and k, so this sample says
            #   (1 - f) T_lo(c) + f T_k(c) = y,   f = (tokens - lo) / (k - lo)
            # With T_lo at its current fit that is g(k) + a(k) c = (y - (1 - f) T_lo(c)) / f,
            # with weight f^2 (the exact least-squares term). Taking the sample as a bucket-k
            # one would price every forward of 33-63 tokens at 64's cost, and so pull g(64)
            # down to the smaller forwards' times.
            f = (tokens - lo) / (k - lo)
            # (T_lo and T_k at this forward's silent tokens: the sample adds to bucket k with
            # them.)
            if self._dirty:
                self._solve()
            low = (
                self._g(lo)
                + self._a(lo) * context
                + self._shared_s(silent, silent_pairs, tree_pairs)
            )
            implied = (seconds - (1.0 - f) * low) / f
            # Dividing by a small f amplifies any error in T_lo: keep what the sample can
            # mean, a k-token forward costing at least this one and at most k/tokens of it.
            implied = min(max(implied, seconds), seconds * k / tokens)
            self._add_at(
                k, context, silent, silent_pairs, tree_pairs, implied, f * f, decay=self.forget
            )
            return True
        self._add_at(
            k, context, silent, silent_pairs, tree_pairs, float(seconds), 1.0, decay=self.forget
        )
        return True

    def _shared_s(self, silent: int, silent_pairs: int, tree_pairs: int) -> float:
        """-b s + e q + h t: what silent tokens and the pairs beyond one query per sequence
        change of a forward's time."""
        return (
            self._pairs * silent_pairs + self._tree * tree_pairs
        ) / _PAIR_SCALE - self._silent * silent

    def _note_error(self, seconds: float, predicted: float) -> None:
        if seconds <= 0 or predicted <= 0:
            return
        cap = math.log(self.outlier_factor)  # a hiccup counts as one outlier, not as infinity
        self._errors.append(min(max(math.log(seconds / predicted), -cap), cap))

    def prediction_error(self) -> tuple[int, float, float]:
        """(forwards, mean, standard deviation) of log(measured / predicted), over the last
        ERROR_WINDOW forwards scored."""
        n = len(self._errors)
        if n == 0:
            return 0, 0.0, 0.0
        mean = sum(self._errors) / n
        var = sum((e - mean) ** 2 for e in self._errors) / n
        return n, mean, math.sqrt(var)

    def error_quantiles(self) -> list[tuple[float, float]]:
        """(level, log error) at ERROR_LEVELS: the shape of the noise, heavy tail included."""
        ordered = sorted(self._errors)
        if not ordered:
            return []
        last = len(ordered) - 1
        return [(q, ordered[round(q * last)]) for q in ERROR_LEVELS]

    # ---- fit -----------------------------------------------------------------------------

    def _solve_shared(self) -> tuple[float, float, float]:
        """(b, e, h), pooled over buckets (see the module docstring)."""
        if self._shared_fit is None:
            self._shared_fit = self._fit_shared()
        return self._shared_fit

    def _fit_shared(self) -> tuple[float, float, float]:
        a = [[0.0] * 3 for _ in range(3)]  # residual moments of (z, u, t), summed
        r = [0.0] * 3  # and of (z, u, t) with y
        for k, m in self._stats.items():
            res = self._residuals.get(k)
            if res is None:
                res = self._residuals[k] = _residual_moments(m)
            spread, cov = res
            for i in range(3):
                r[i] += cov[i]
                for j in range(3):
                    a[i][j] += spread[i][j]
        ridge = (self._silent_weight, self._pairs_weight, self._pairs_weight)
        prior = (-self._silent_prior, self._pairs_prior, self._tree_prior)
        for i in range(3):
            a[i][i] = max(a[i][i], 0.0) + ridge[i]
            r[i] += ridge[i] * prior[i]
        # Maximise r.c - c.A.c / 2 with c = (-b, e, h), b, e, h >= 0: every set of free
        # coefficients (the others held at 0) solved exactly, the best one of the right signs.
        sign = (-1.0, 1.0, 1.0)
        best, best_gain = (0.0, 0.0, 0.0), 0.0
        for free in _SUBSETS:
            c = _solve_small([[a[i][j] for j in free] for i in free], [r[i] for i in free])
            if c is None or any(sign[i] * ci < 0 for i, ci in zip(free, c)):
                continue
            full = [0.0, 0.0, 0.0]
            for i, ci in zip(free, c):
                full[i] = ci
            gain = sum(r[i] * full[i] for i in range(3)) - 0.5 * sum(
                full[i] * a[i][j] * full[j] for i in range(3) for j in range(3)
            )
            if gain > best_gain:
                best, best_gain = (full[0], full[1], full[2]), gain
        return -best[0], best[1], best[2]

    def _solve(self) -> None:
        self._knots = sorted(self._stats)
        lam = self._slope_weight
        b, e, h = self._silent, self._pairs, self._tree = self._solve_shared()
        # Each bucket fits y + b z - e u - h t: its times as if every row had been a decode row.
        adjusted = {}
        for k in self._knots:
            m = self._stats[k]
            one, mx = m[_ONE], m[_X]
            y = one[_Y] + b * one[_Z] - e * one[_U] - h * one[_T]
            xy = mx[_Y] + b * mx[_Z] - e * mx[_U] - h * mx[_T]
            adjusted[k] = (one[_ONE], one[_X], mx[_X], y, xy)
        # First pass: each bucket's own slope (toward the stored prior) and its context spread.
        fits = {}
        for k in self._knots:
            w, x, xx, y, xy = adjusted[k]
            spread = max(xx - x * x / w, 0.0)
            prior = self._slope_priors.get(k, self._slope_prior) * _CONTEXT_SCALE
            fits[k] = (spread, xy - x * y / w, prior)
        # A bucket whose contexts barely varied borrows the pooled slope of its regime
        # (decode-sized forwards up to 32 tokens, prefill-sized above) unless a stored model
        # gave it its own.
        pooled = {}
        for small in (True, False):
            members = [k for k in self._knots if (k <= _EXACT_BUCKETS) == small]
            spread = sum(fits[k][0] for k in members)
            cov = sum(fits[k][1] for k in members)
            pooled[small] = max(cov / spread, 0.0) if spread > 0 else None
        self._values, self._slopes = [], []
        for k in self._knots:
            w, x, _, y, _ = adjusted[k]
            spread, cov, prior = fits[k]
            borrowed = pooled[k <= _EXACT_BUCKETS]
            if k not in self._slope_priors and borrowed is not None:
                prior = borrowed
            a = max((cov + lam * prior) / (spread + lam), 0.0)  # seconds per 1024 tokens
            g = (y - a * x) / w
            if g < 0:
                # A steep slope over contexts far from 0 can put the intercept below zero,
                # pricing the same forward over a short context at nothing: fit through 0.
                _, _, xx, _, xy = adjusted[k]
                g, a = 0.0, max((xy + lam * prior) / (xx + lam), 0.0)
            self._values.append(g)
            self._slopes.append(a / _CONTEXT_SCALE)
        total = sum(f[0] for f in fits.values())
        mean = sum(f[0] * a for f, a in zip(fits.values(), self._slopes)) / total if total else 0.0
        self._slope = mean
        self._dirty = False
        self._memo.clear()
        self._slope_memo.clear()

    def _g(self, k: int) -> float:
        """g at bucket k: fitted, or interpolated / extrapolated from the known buckets."""
        return _interpolate(self._knots, self._values, k, extend=True)

    def _a(self, k: int) -> float:
        """The context slope at bucket k, the same way (held at the last beyond the largest)."""
        return _interpolate(self._knots, self._slopes, k, extend=False)

    def predict(
        self,
        tokens: int,
        context: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> float:
        """Predicted forward seconds for `tokens` tokens over `context` tokens, `silent` of
        them without logits and computing `silent_pairs` query-key pairs, tree nodes past
        their roots computing `tree_pairs` (0 with no data)."""
        if self._dirty:
            self._solve()
        key = (tokens, context, silent, silent_pairs, tree_pairs)
        hit = self._memo.get(key)
        if hit is not None:
            return hit
        _check(tokens, context, silent, silent_pairs, tree_pairs)
        k = bucket_of(tokens)
        value = self._g(k) + self._a(k) * context
        if k != tokens:
            # Between two power-of-two buckets a forward runs at its own size (padding is
            # the caller's choice): interpolate rather than price it at the next bucket.
            lo = k // 2
            low = self._g(lo) + self._a(lo) * context
            value = low + (value - low) * (tokens - lo) / (k - lo)
        value = (
            max(value, 0.0) + (self._pairs * silent_pairs + self._tree * tree_pairs) / _PAIR_SCALE
        )
        value -= min(self._silent * silent, _MAX_SILENT_SAVING * value)
        if len(self._memo) >= _MEMO_SIZE:
            self._memo.clear()
        self._memo[key] = value
        return value

    def token_slope(self, tokens: int, more: int, context: int) -> float:
        """Seconds a token adds, on average, to a forward growing from `tokens` to `more`
        tokens over `context`: the weighted least-squares slope, in the token count, of the
        predictions at the known exact buckets from tokens / 2 to 2 x `more` (weights: their
        samples), never negative.

        What tree nodes cost is a difference of two buckets' fits, and each bucket is fitted
        on its own forwards: adjacent buckets seen over different contexts can put a 12-token
        forward no dearer than an 11-token one (seen on llama.cpp: 59.1 and 58.9 ms predicted
        at 800 context tokens, ~4 ms apart measured), and a node priced at nothing is verified
        whatever its acceptance. The slope over the neighbourhood averages that noise out."""
        if tokens >= _EXACT_BUCKETS:
            # Forwards this big are priced between power-of-two knots, linearly: no adjacent
            # noisy buckets to average, and the exact ones below are no guide here (seen only
            # over short contexts, their context slopes extrapolated to a batch's 17k tokens
            # priced a tree node at 1 ms on a table where one costs 0.15 ms).
            return 0.0
        if self._dirty:
            self._solve()
        lo, hi = max(1, tokens // 2), min(_EXACT_BUCKETS, 2 * max(tokens, more))
        first = bisect.bisect_left(self._knots, lo)
        last = bisect.bisect_right(self._knots, hi)
        if last - first < 2:
            first, last = 0, bisect.bisect_right(self._knots, _EXACT_BUCKETS)
        # Keyed by the knots used: the sizes of one pruning pass mostly share them.
        key = (first, last, context)
        hit = self._slope_memo.get(key)
        if hit is not None:
            return hit
        near = self._knots[first:last]
        slope = 0.0
        if len(near) >= 2:
            ws = [max(self._stats[k][_ONE][_ONE], 1e-9) for k in near]
            ys = [self.predict(k, context) for k in near]
            w = sum(ws)
            mk = sum(wi * k for wi, k in zip(ws, near)) / w
            my = sum(wi * y for wi, y in zip(ws, ys)) / w
            sxx = sum(wi * (k - mk) ** 2 for wi, k in zip(ws, near))
            sxy = sum(wi * (k - mk) * (y - my) for wi, k, y in zip(ws, near, ys))
            slope = max(sxy / sxx, 0.0) if sxx > 0 else 0.0
        if len(self._slope_memo) >= _MEMO_SIZE:
            self._slope_memo.clear()
        self._slope_memo[key] = slope
        return slope

    def best_padded(
        self,
        tokens: int,
        context: int,
        max_tokens: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> int:
        """Token count in [tokens, max_tokens] (tokens or a bucket size) with the least predicted
        time, smallest on ties; `tokens` itself when max_tokens <= tokens. Padding rows are
        silent (they return no logits; their few pairs are not counted)."""
        best, best_s = tokens, self.predict(tokens, context, silent, silent_pairs, tree_pairs)
        if max_tokens <= tokens:
            return best
        if self._dirty:
            self._solve()
        # Between two known buckets a prediction is linear in the size, so the cheapest size is
        # a known bucket or the largest size allowed: those alone are priced (at one token and
        # B = 256 on a GPU, 12 predictions an iteration instead of 34).
        top = max_tokens if max_tokens <= _EXACT_BUCKETS else 1 << (max_tokens.bit_length() - 1)
        lo = bisect.bisect_right(self._knots, tokens)
        hi = bisect.bisect_right(self._knots, top)
        candidates = self._knots[lo:hi]
        if top > tokens and (not candidates or candidates[-1] != top):
            candidates = [*candidates, top]
        for m in candidates:
            s = self.predict(m, context, silent + m - tokens, silent_pairs, tree_pairs)
            if s < best_s:
                best, best_s = m, s
        return best

    # ---- persistence -----------------------------------------------------------------------

    def coefficients(self) -> CostCoefficients:
        """Per-bucket g and context slope a of the known buckets, the pooled slope, and b."""
        if self._dirty:
            self._solve()
        return {
            "g_s": dict(zip(self._knots, self._values)),
            "slopes_s_per_token": dict(zip(self._knots, self._slopes)),
            "slope_s_per_token": self._slope,
            "silent_row_s": self._silent,
            "silent_pair_s": self._pairs / _PAIR_SCALE,
            "tree_pair_s": self._tree / _PAIR_SCALE,
        }

    @classmethod
    def from_coefficients(
        cls,
        g_s: Mapping[int, float],
        slope_s_per_token: float | Mapping[int, float],
        weight: float = 3.0,
        silent_row_s: float = 0.0,
        silent_pair_s: float = 0.0,
        tree_pair_s: float = 0.0,
        **kwargs: Any,
    ) -> ForwardCostModel:
        """A model seeded with a profile: each g value and its bucket's slope (one slope for
        every bucket, or one per bucket) count as `weight` samples; `silent_row_s`,
        `silent_pair_s` and `tree_pair_s` are b's, e's and h's priors (they hold until
        forwards with silent tokens or trees are observed)."""
        if min(silent_row_s, silent_pair_s, tree_pair_s) < 0:
            raise ValueError(
                "silent_row_s, silent_pair_s and tree_pair_s must be >= 0, got "
                f"{silent_row_s}, {silent_pair_s}, {tree_pair_s}"
            )
        slopes = (
            dict(slope_s_per_token)
            if isinstance(slope_s_per_token, Mapping)
            else dict.fromkeys(g_s, float(slope_s_per_token))
        )
        if any(a < 0 for a in slopes.values()):
            raise ValueError(f"context slopes must be >= 0, got {slope_s_per_token}")
        model = cls(**kwargs)
        model.seed(((int(n), 0, float(g)) for n, g in g_s.items()), weight=weight)
        model._slope_priors = {int(k): float(a) for k, a in slopes.items()}
        if not isinstance(slope_s_per_token, Mapping):
            model._slope_prior = float(slope_s_per_token)
        model._slope_weight = weight
        model._silent_prior = float(silent_row_s)
        model._pairs_prior = float(silent_pair_s) * _PAIR_SCALE
        model._tree_prior = float(tree_pair_s) * _PAIR_SCALE
        model._silent_weight = _SILENT_RIDGE * weight
        model._pairs_weight = _PAIR_RIDGE * weight
        model._shared_fit = None  # the priors moved
        return model

    def to_json(self) -> str:
        """The coefficients as a JSON object (bucket keys as strings)."""
        coef = self.coefficients()
        data: dict[str, Any] = {
            "g_s": {str(k): v for k, v in coef["g_s"].items()},
            "slopes_s_per_token": {str(k): v for k, v in coef["slopes_s_per_token"].items()},
            "slope_s_per_token": coef["slope_s_per_token"],
            "silent_row_s": coef["silent_row_s"],
            "silent_pair_s": coef["silent_pair_s"],
            "tree_pair_s": coef["tree_pair_s"],
        }
        n, mean, sigma = self.prediction_error()
        if n:
            data["log_error"] = {
                "forwards": n,
                "mean": mean,
                "sigma": sigma,
                "quantiles": self.error_quantiles(),
            }
        return json.dumps(data)

    @classmethod
    def from_json(cls, text: str, weight: float = 3.0, **kwargs: Any) -> ForwardCostModel:
        """Inverse of to_json: a model seeded with the stored coefficients (a model stored
        before per-bucket slopes gives its one slope to every bucket; one stored before b
        has b = e = 0, one before h has h = 0)."""
        data = json.loads(text)
        g_s = {int(k): float(v) for k, v in data["g_s"].items()}
        silent = (
            float(data.get("silent_row_s", 0.0)),
            float(data.get("silent_pair_s", 0.0)),
            float(data.get("tree_pair_s", 0.0)),
        )
        slopes: float | dict[int, float] = float(data["slope_s_per_token"])
        if "slopes_s_per_token" in data:
            slopes = {int(k): float(v) for k, v in data["slopes_s_per_token"].items()}
        return cls.from_coefficients(g_s, slopes, weight, *silent, **kwargs)


def _residual_moments(m: list[list[float]]) -> tuple[list[list[float]], list[float]]:
    """One bucket's spreads of (z, u, t) about their means, and their covariances with y, with
    what its context x explains taken out (the bucket's term in the pooled fit of b, e, h)."""
    w, first = m[_ONE][_ONE], m[_ONE]

    def spread(i: int, j: int) -> float:
        return m[i][j] - first[i] * first[j] / w

    sxx = spread(_X, _X)

    def resid(i: int, j: int) -> float:
        if sxx <= 1e-12 * w:  # the context barely varied: nothing to take out
            return spread(i, j)
        return spread(i, j) - spread(_X, i) * spread(_X, j) / sxx

    return [[resid(i, j) for j in _SHARED] for i in _SHARED], [resid(i, _Y) for i in _SHARED]


# Which of (b, e, h) a fit leaves free, every combination (the others held at 0).
_SUBSETS = ((0, 1, 2), (0, 1), (0, 2), (1, 2), (0,), (1,), (2,))


def _solve_small(a: list[list[float]], r: list[float]) -> list[float] | None:
    """x with a x = r for a small symmetric positive system (None if singular)."""
    n = len(r)
    m = [row[:] + [r[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda i: abs(m[i][col]))
        if abs(m[piv][col]) < 1e-18:
            return None
        m[col], m[piv] = m[piv], m[col]
        for i in range(n):
            if i != col:
                f = m[i][col] / m[col][col]
                for j in range(col, n + 1):
                    m[i][j] -= f * m[col][j]
    return [m[i][n] / m[i][i] for i in range(n)]


def _interpolate(knots: list[int], values: list[float], k: int, extend: bool) -> float:
    """values at k: exact at a knot, linear between knots, flat below the first; above the
    last, when `extend`, the steeper of the last segment's rise and the mean rise from the
    first knot (never falling), else flat.

    A forward's time is convex in its tokens (flat while the weights stream, then linear once
    compute-bound), so past the largest measured forward it rises at least as fast as on
    average from the smallest: one noisy knot that flattens the last segment (a 64-token
    forward measured at 376 ms beside 355 ms at 32, on a CPU where a token costs ~6 ms) then
    cannot price a 1,100-token prompt at 1 s instead of 7."""
    if not knots:
        return 0.0
    i = bisect.bisect_left(knots, k)
    if i < len(knots) and knots[i] == k:
        return values[i]
    if i == 0:
        return values[0]
    if i == len(knots):
        if len(knots) == 1 or not extend:
            return values[-1]
        step = (values[-1] - values[-2]) / (knots[-1] - knots[-2])
        mean = (values[-1] - values[0]) / (knots[-1] - knots[0])
        return values[-1] + max(step, mean, 0.0) * (k - knots[-1])
    k0, k1, v0, v1 = knots[i - 1], knots[i], values[i - 1], values[i]
    return v0 + (v1 - v0) * (k - k0) / (k1 - k0)
