"""Acceptance models and the synthetic drafter that follows them.

A drafter proposes, under each frontier node, children with draft probabilities q (given
the parent); at most one child is the token the target will choose. An acceptance model
says two things, by the child's depth:
- how q is distributed for the child of rank j (1 = most probable), and
- how likely a child with probability q is the right one (calibration).

Recorded (`--acceptance FILE`, written by `--record-acceptance`): q samples per (depth,
rank) from every candidate node of the logged trees; calibration per (depth, q decile) from
the verified nodes whose parent was accepted (only those were tested), smoothed towards q
itself with PRIOR_WEIGHT pseudo-observations. Depths beyond the log reuse its deepest.

Parametric (`--acceptance param:alpha=0.7,decay=0.9,kappa=2`): the top child's q at depth k
is Beta-distributed with mean alpha x decay^(k-1) and concentration kappa; lower ranks share
what is left (each takes a Beta(1, 2) part of the remainder); the drafter is calibrated, i.e.
a child is right with probability q.

The right child is drawn once per parent (one uniform number against the cumulative
calibrated probabilities), so siblings are exclusive. Which token is right comes from the
simulated target (`engine.true_next`); wrong children get other tokens.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from adaserve.request_manager.drafters.base import Drafter, KeepGoing
from adaserve.request_manager.drafters.model import draft_scratch_tokens
from adaserve.tree import CandidateTree

if TYPE_CHECKING:
    from adaserve.request_manager.policies import SpecShape
    from adaserve.request_manager.request import Request
    from adaserve.sim.engine import SimEngine

Q_BINS = 10
PRIOR_WEIGHT = 4.0
MIN_Q = 1e-4
# Children considered per frontier node (beam search keeps the best `width` of them).
MAX_CHILDREN = 8
POOL_SIZE = 512
MAX_POOL_DEPTH = 16


class AcceptanceModel(ABC):
    """Draws child probabilities and which child is right, by depth."""

    name = "?"
    _pools: dict[tuple[int, int], list[tuple[list[float], list[float]]]]

    def draw(self, depth: int, n: int, rng: random.Random) -> tuple[list[float], list[float]]:
        """(q of the n most probable children, cumulative P(child j is right)), from a pool of
        POOL_SIZE pre-drawn vectors per (depth, n): a Beta draw per child per node was most
        of a simulation's time."""
        pools = self.__dict__.setdefault("_pools", {})
        key = (min(depth, MAX_POOL_DEPTH), n)
        pool = pools.get(key)
        if pool is None:
            prng = random.Random(hash(key))
            pool = []
            for _ in range(POOL_SIZE):
                q = self.child_probs(key[0], n, prng)
                cum, acc = [], 0.0
                for qj in q:
                    acc += self.p_correct(key[0], qj)
                    cum.append(acc)
                pool.append((q, cum))
            pools[key] = pool
        return pool[rng.randrange(POOL_SIZE)]

    @abstractmethod
    def child_probs(self, depth: int, n: int, rng: random.Random) -> list[float]:
        """q of the n most probable children at `depth`, descending, summing to <= 1."""

    @abstractmethod
    def p_correct(self, depth: int, q: float) -> float:
        """P(a child at `depth` with draft probability q is the target's token)."""

    def expected_acceptance(self, depth: int, rng: random.Random, samples: int = 2000) -> float:
        """P(the top child at `depth` is right), by sampling (reports and tests)."""
        return (
            sum(self.p_correct(depth, self.child_probs(depth, 1, rng)[0]) for _ in range(samples))
            / samples
        )


class ParametricAcceptance(AcceptanceModel):
    def __init__(self, alpha: float, decay: float = 1.0, kappa: float = 2.0) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be in (0, 1), got {alpha}")
        if not 0 < decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if not kappa > 0:
            raise ValueError(f"kappa must be > 0, got {kappa}")
        self.alpha, self.decay, self.kappa = alpha, decay, kappa
        self.name = f"parametric alpha={alpha:g} decay={decay:g} kappa={kappa:g}"

    def child_probs(self, depth: int, n: int, rng: random.Random) -> list[float]:
        mean = self.alpha * self.decay ** (depth - 1)
        q = [
            min(1 - MIN_Q, max(MIN_Q, rng.betavariate(mean * self.kappa, (1 - mean) * self.kappa)))
        ]
        left = 1.0 - q[0]
        for _ in range(n - 1):
            part = left * rng.betavariate(1.0, 2.0)
            q.append(max(MIN_Q, min(part, q[-1])))
            left -= part
        return q

    def p_correct(self, depth: int, q: float) -> float:
        return q


class RecordedAcceptance(AcceptanceModel):
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        qs: dict[tuple[int, int], list[float]] = {}
        hits: dict[tuple[int, int], list[float]] = {}  # (depth, bin) -> [accepted, tested, q sum]
        trees = 0
        with open(self.path) as f:
            for line in f:
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    parents, q = row["p"], row["q"]
                    verified, accepted = set(row["v"]), set(row["a"])
                except (ValueError, KeyError, TypeError) as exc:
                    raise ValueError(
                        f"{path}: line {trees + 1} is not a recorded tree ({exc}); record one "
                        "with `adaserve serve --record-acceptance FILE`"
                    ) from None
                trees += 1
                depth = [0] * len(parents)
                kids: dict[int, list[int]] = {}
                for v in range(1, len(parents)):
                    depth[v] = depth[parents[v]] + 1
                    kids.setdefault(parents[v], []).append(v)
                for siblings in kids.values():
                    for rank, v in enumerate(sorted(siblings, key=lambda v: -q[v])):
                        qs.setdefault((depth[v], rank), []).append(q[v])
                for v in verified:
                    if parents[v] == 0 or parents[v] in accepted:
                        cell = hits.setdefault((depth[v], _bin(q[v])), [0.0, 0.0, 0.0])
                        cell[0] += v in accepted
                        cell[1] += 1
                        cell[2] += q[v]
        if not qs:
            raise ValueError(f"{path} holds no recorded trees")
        self.num_trees = trees
        self.max_depth = max(d for d, _ in qs)
        self.q_samples = {k: sorted(v) for k, v in qs.items()}
        self.hits = hits
        tested = sum(c[1] for c in hits.values())
        self.name = f"recorded {self.path.name} ({trees} trees, {int(tested)} tested nodes)"

    def _depth(self, depth: int) -> int:
        return min(depth, self.max_depth)

    def child_probs(self, depth: int, n: int, rng: random.Random) -> list[float]:
        d = self._depth(depth)
        q = []
        for rank in range(n):
            samples = self.q_samples.get((d, rank)) or self.q_samples.get((d, 0))
            if samples is None:  # this depth was never drafted: the deepest that was
                samples = self.q_samples[(self.max_depth, 0)]
            q.append(max(MIN_Q, samples[rng.randrange(len(samples))]))
        q.sort(reverse=True)
        total = sum(q)
        return q if total <= 1.0 else [x / total * (1 - MIN_Q) for x in q]

    def p_correct(self, depth: int, q: float) -> float:
        d = self._depth(depth)
        cell = self.hits.get((d, _bin(q)))
        if cell is None:
            return q
        accepted, tested, q_sum = cell
        # The bin's acceptance, pulled towards the drafter's own q when the bin is thin.
        prior = q if tested == 0 else q_sum / tested
        return (accepted + PRIOR_WEIGHT * prior) / (tested + PRIOR_WEIGHT)

    def table(self) -> list[tuple[int, float, float, int]]:
        """(depth, mean q, acceptance, tested) per calibration cell, for reports."""
        return [
            (d, c[2] / c[1], c[0] / c[1], int(c[1]))
            for (d, _), c in sorted(self.hits.items())
            if c[1] > 0
        ]


def _bin(q: float) -> int:
    return min(Q_BINS - 1, int(q * Q_BINS))


def load_acceptance(spec: str) -> AcceptanceModel:
    """'param:alpha=0.7,decay=0.9,kappa=2' or the path of a recorded JSONL file."""
    if spec.startswith("param:"):
        kw: dict[str, float] = {}
        for part in spec.removeprefix("param:").split(","):
            key, sep, value = part.partition("=")
            if not sep or key.strip() not in ("alpha", "decay", "kappa"):
                raise ValueError(
                    f"a parametric acceptance model is param:alpha=A[,decay=D][,kappa=K], "
                    f"got {spec!r}"
                )
            kw[key.strip()] = float(value)
        if "alpha" not in kw:
            raise ValueError(f"param: needs alpha (the depth-1 acceptance), got {spec!r}")
        return ParametricAcceptance(**kw)
    if not Path(spec).exists():
        raise ValueError(
            f"no acceptance file {spec!r}; give a file written by `--record-acceptance` or "
            "param:alpha=A[,decay=D][,kappa=K]"
        )
    return RecordedAcceptance(spec)


class SyntheticDrafter(Drafter):
    """Grows candidate trees like the beam-search draft does, from an acceptance model.

    `costly`: it stands for a draft model; each growth step then runs the simulated draft
    forward (the engine prices it), and the step-1 forward feeds the request's unseen tokens.
    Otherwise (a suffix index) proposing costs `propose_s` per request.
    """

    def __init__(
        self,
        engine: SimEngine,
        acceptance: AcceptanceModel,
        rng: random.Random,
        costly: bool,
        propose_s: float = 15e-6,
    ) -> None:
        self.engine, self.acceptance, self.rng = engine, acceptance, rng
        self.costly = costly
        self.propose_s = propose_s
        self.name = f"synthetic {'draft model' if costly else 'suffix'} ({acceptance.name})"

    def scratch_tokens(self, shape: SpecShape) -> int:
        return draft_scratch_tokens(shape) if self.costly else 0

    def propose(
        self, requests: Sequence[Request], shape: SpecShape, keep_going: KeepGoing | None = None
    ) -> list[CandidateTree]:
        eng = self.engine
        trees = [CandidateTree.root(r.last_token) for r in requests]
        base = [r.num_tokens - 1 for r in requests]  # the root's position
        if self.costly:
            assert eng.draft is not None
            fed = sum(r.num_tokens - r.draft_num_cached for r in requests)
            eng.draft.charge(fed, sum(r.draft_num_cached for r in requests), len(requests))
            for r in requests:
                r.draft_num_cached = r.num_tokens
        else:
            eng.clock.advance(self.propose_s * len(requests))
        frontier = [[0] for _ in requests]
        for step in range(shape.depth):
            if step and keep_going is not None and not keep_going(trees, frontier):
                break
            if step and self.costly:
                assert eng.draft is not None
                fed = sum(len(f) for f in frontier)
                context = sum(r.num_tokens for r in requests)
                eng.draft.charge(fed, context, len(requests))
            frontier = [
                self._grow(tree, f, b, shape, step) for tree, f, b in zip(trees, frontier, base)
            ]
        if self.costly:
            assert eng.draft is not None
            for r in requests:
                eng.draft.cache.truncate(r.draft_block_table, r.num_tokens)
        return trees

    def _children(self, tree: CandidateTree, node: int, base: int, n: int):
        """(token, logprob) of the n most probable children of `node`."""
        depth = tree.depths[node] + 1
        q, cum = self.acceptance.draw(depth, n, self.rng)
        right = self.engine.true_next(tree.tokens[node], base + tree.depths[node])
        u, which = self.rng.random(), -1
        for j, c in enumerate(cum):
            if u < c:
                which = j
                break
        wrong = self.engine.wrong_token
        return [(right if j == which else wrong(right, j), math.log(qj)) for j, qj in enumerate(q)]

    def _grow(
        self, tree: CandidateTree, frontier: list[int], base: int, shape: SpecShape, step: int
    ) -> list[int]:
        if shape.expansion is not None:
            k = shape.expansion[step]
            parents, tokens, lps = [], [], []
            for v in frontier:
                for tok, lp in self._children(tree, v, base, k):
                    parents.append(v)
                    tokens.append(tok)
                    lps.append(lp)
            return tree.add_nodes(parents, tokens, lps)
        # Beam search: the `width` best paths among every frontier node's children.
        n = min(MAX_CHILDREN, shape.width)
        cands = [
            (tree.path_logprobs[v] + lp, v, tok, lp)
            for v in frontier
            for tok, lp in self._children(tree, v, base, n)
        ]
        best = heapq.nlargest(shape.width, cands, key=lambda c: c[0])
        return tree.add_nodes([c[1] for c in best], [c[2] for c in best], [c[3] for c in best])
