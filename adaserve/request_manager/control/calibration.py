"""Online calibration of draft probabilities against what the target actually accepts.

Selection ranks nodes by f(v) = prod_{u in path(v)} P(u | parent(u)), the draft's own
conditionals standing in for acceptance probabilities. Drafts are often badly calibrated
(an n-gram drafter that says 0.9 may be right half the time), so we learn the map

    q = exp(logprob(v))  ->  p(v) = P(target accepts v | target accepted parent(v))

per depth d in 1..max_depth (deeper nodes share the last depth) and per q-bucket
b = floor(q * num_buckets). Each bin keeps exponentially forgotten counts; an observation
in a bin first multiplies that bin's (trials n, accepts k, sum of q Q) by `decay`.

Cold start / shrinkage: s pseudo-trials at the bucket centre c_b whose acceptance is the prior
prior(q) = prior_scale * q * r_d (prior_scale = 1 trusts the draft until data says otherwise),
r_d the depth's accepts over its predicted accepts (all buckets), shrunk toward the depth above:

    r_1 = (K_1 + s) / (Q_1 + s)        r_d = (K_d + s r_{d-1}) / (Q_d + s)

so a draft that is wrong everywhere at a depth is discounted in buckets that have little data,
and so are the deeper depths that have seen little or nothing: a deep node is reached only
through its ancestors, rarely observed, and without this its prior would stay the draft's own
word (a suffix drafter's chains say q = 1 at every depth) after depth 1 has shown otherwise.

    p_b = (k_b + s * prior(c_b)) / (n_b + s)        x_b = (Q_b + s * c_b) / (n_b + s)

x_b is the bin's mean q under the same shrinkage. Within a depth, p_b is made non-decreasing in b
by pool-adjacent-violators weighted by n_b + s (a higher draft probability never maps to a lower
calibrated one), then clamped to [1e-4, 1 - 1e-4]. calibrated(d, q) interpolates linearly through
the points (0, 0), (x_0, p_0), ..., (x_{B-1}, p_{B-1}) and is flat past the last one. The (0, 0)
anchor keeps small q in proportion (q = 0.001 must not become a bucket-wide 0.05, since
path log-probs add), and at cold start the curve is exactly prior_scale * q up to x_{B-1}.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass

from adaserve.tree.candidate import CandidateTree

_EPS = 1e-4  # calibrated probabilities live in [_EPS, 1 - _EPS]


@dataclass(frozen=True)
class DepthCalibration:
    """Calibration state of one depth, for metrics; the means are None without observations."""

    depth: int
    observations: float  # decayed trial count
    mean_draft_prob: float | None  # mean raw q of the observations: what the draft predicted
    mean_calibrated_prob: float | None  # mean calibrated prediction for the same observations
    acceptance_rate: float | None  # observed accepts / trials


def _pool_adjacent_violators(values: list[float], weights: list[float]) -> list[float]:
    """Weighted isotonic (non-decreasing) regression of `values`."""
    # Each block: [weighted mean, total weight, number of entries]
    blocks: list[list[float]] = []
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            v2, w2, n2 = blocks.pop()
            v1, w1, n1 = blocks.pop()
            blocks.append([(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for v, _, n in blocks:
        out.extend([v] * int(n))
    return out


_MEMO_SIZE = 4096


class AcceptanceCalibrator:
    """Learns P(accept v | parent accepted) as a monotone function of draft q, per depth."""

    def __init__(
        self,
        num_buckets: int = 10,
        max_depth: int = 8,
        prior_strength: float = 4.0,
        prior_scale: float = 1.0,
        decay: float = 0.995,
    ) -> None:
        if num_buckets < 1:
            raise ValueError(f"num_buckets must be >= 1, got {num_buckets}")
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        if prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {prior_strength}")
        if prior_scale <= 0:
            raise ValueError(f"prior_scale must be > 0, got {prior_scale}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        self.num_buckets = num_buckets
        self.max_depth = max_depth
        self.prior_strength = prior_strength
        self.prior_scale = prior_scale
        self.decay = decay
        self._centers = [(b + 0.5) / num_buckets for b in range(num_buckets)]
        self.reset()

    def reset(self) -> None:
        """Forget every observation (back to the prior)."""
        shape = [[0.0] * self.num_buckets for _ in range(self.max_depth)]
        self._trials = [row[:] for row in shape]  # [depth - 1][bucket], decayed
        self._accepts = [row[:] for row in shape]
        self._sum_q = [row[:] for row in shape]
        # Interpolation table per depth: knots x (with the 0 anchor) and calibrated p at them.
        self._xs: list[list[float]] = [[] for _ in range(self.max_depth)]
        self._ps: list[list[float]] = [[] for _ in range(self.max_depth)]
        self._dirty = set(range(self.max_depth))
        # Per depth, q -> calibrated p until the depth is refitted (drafting re-scores the
        # same trees after every growth step).
        self._memo: list[dict[float, float]] = [{} for _ in range(self.max_depth)]

    def _row(self, depth: int) -> int:
        if depth < 1:
            raise ValueError(f"depth must be >= 1 (the root is not calibrated), got {depth}")
        return min(depth, self.max_depth) - 1

    def _bucket(self, q: float) -> int:
        return min(max(int(q * self.num_buckets), 0), self.num_buckets - 1)

    def _bucket_fit(self, row: int) -> tuple[list[float], list[float], list[float]]:
        """(x_b, raw p_b, weight n_b + s) per bucket of one depth, before monotonicity."""
        s = self.prior_strength
        r = self._draft_ratio(row)
        xs, ps, ws = [], [], []
        for b, c in enumerate(self._centers):
            n = self._trials[row][b]
            prior = min(self.prior_scale * c * r, 1.0)
            xs.append((self._sum_q[row][b] + s * c) / (n + s))
            ps.append((self._accepts[row][b] + s * prior) / (n + s))
            ws.append(n + s)
        return xs, ps, ws

    def _draft_ratio(self, row: int) -> float:
        """r_d: accepts over predicted accepts at this depth, shrunk toward the depth above
        (depth 1: toward 1). The depth's own evidence corrects every bucket's prior at once (a
        sparse bucket of a draft that is right 5% of the time must not keep trusting its 0.9)."""
        s = self.prior_strength
        r = 1.0
        for d in range(row + 1):
            r = (sum(self._accepts[d]) + s * r) / (sum(self._sum_q[d]) + s)
        return r

    def _refresh(self, row: int) -> None:
        xs, ps, ws = self._bucket_fit(row)
        mono = _pool_adjacent_violators(ps, ws)
        self._xs[row] = [0.0] + xs
        self._ps[row] = [0.0] + [min(max(p, _EPS), 1.0 - _EPS) for p in mono]
        self._dirty.discard(row)
        self._memo[row].clear()

    def calibrated(self, depth: int, q: float) -> float:
        """Calibrated P(accept | parent accepted) for a node at `depth` with draft prob q."""
        row = self._row(depth)
        if row in self._dirty:
            self._refresh(row)
        memo = self._memo[row]
        hit = memo.get(q)
        if hit is not None:
            return hit
        xs, ps = self._xs[row], self._ps[row]
        qc = min(max(q, 0.0), 1.0)
        i = bisect.bisect_right(xs, qc)  # xs[i - 1] <= q < xs[i]
        if i >= len(xs):
            p = ps[-1]
        else:
            x0, x1, p0, p1 = xs[i - 1], xs[i], ps[i - 1], ps[i]
            p = min(max(p0 + (p1 - p0) * (qc - x0) / (x1 - x0), _EPS), 1.0 - _EPS)
        if len(memo) >= _MEMO_SIZE:
            memo.clear()
        memo[q] = p
        return p

    def calibrate_tree(self, tree: CandidateTree) -> CandidateTree:
        """A copy of `tree` whose logprobs are log calibrated(depth, q); the input is untouched."""
        logprobs = [tree.logprobs[0]]
        path_logprobs = [tree.path_logprobs[0]]
        for v in range(1, len(tree)):
            lp = math.log(self.calibrated(tree.depths[v], math.exp(tree.logprobs[v])))
            logprobs.append(lp)
            path_logprobs.append(path_logprobs[tree.parents[v]] + lp)
        return CandidateTree(
            tokens=list(tree.tokens),
            parents=list(tree.parents),
            depths=list(tree.depths),
            logprobs=logprobs,
            path_logprobs=path_logprobs,
        )

    def observe(self, depth: int, q: float, accepted: bool) -> None:
        """Record one trial: a node at `depth` with draft prob q whose parent was accepted."""
        row = self._row(depth)
        q = min(max(q, 0.0), 1.0)
        b = self._bucket(q)
        d = self.decay
        self._trials[row][b] = self._trials[row][b] * d + 1.0
        self._accepts[row][b] = self._accepts[row][b] * d + (1.0 if accepted else 0.0)
        self._sum_q[row][b] = self._sum_q[row][b] * d + q
        self._dirty.update(range(row, self.max_depth))  # deeper priors lean on this depth

    def observe_verification(
        self, tree: CandidateTree, verified_nodes: Sequence[int], accepted_nodes: Sequence[int]
    ) -> None:
        """Record a verification of the RAW draft tree (not a calibrated copy).

        verified_nodes: candidate-tree indices that were verified, root 0 included.
        accepted_nodes: the accepted ones along one path, root excluded.
        Only nodes whose parent was accepted are trials; the others were never reachable.
        """
        accepted = set(accepted_nodes)
        accepted.add(0)
        for v in verified_nodes:
            if v == 0 or tree.parents[v] not in accepted:
                continue
            self.observe(tree.depths[v], math.exp(tree.logprobs[v]), v in accepted)

    def observations(self, depth: int) -> float:
        """Decayed count of observations at `depth` (deeper than max_depth: the last row)."""
        return sum(self._trials[self._row(depth)])

    def acceptance_upper_bound(self, depth: int, delta: float = 0.1) -> float:
        """An upper confidence bound on the acceptance rate at `depth` (Hoeffding: the true rate
        exceeds it with probability < delta); 1 before any observation."""
        row = self._row(depth)
        n = sum(self._trials[row])
        if n <= 0:
            return 1.0
        return min(1.0, sum(self._accepts[row]) / n + math.sqrt(math.log(1 / delta) / (2 * n)))

    def depth_summary(self) -> list[DepthCalibration]:
        """Per depth 1..max_depth: observations, mean draft q, mean calibrated, acceptance rate."""
        out = []
        for row in range(self.max_depth):
            n = sum(self._trials[row])
            if n <= 0:
                out.append(DepthCalibration(row + 1, 0.0, None, None, None))
                continue
            # Each bucket's observations are represented by their mean q.
            calibrated = sum(
                t * self.calibrated(row + 1, sq / t)
                for t, sq in zip(self._trials[row], self._sum_q[row])
                if t > 0
            )
            out.append(
                DepthCalibration(
                    depth=row + 1,
                    observations=n,
                    mean_draft_prob=sum(self._sum_q[row]) / n,
                    mean_calibrated_prob=calibrated / n,
                    acceptance_rate=sum(self._accepts[row]) / n,
                )
            )
        return out
