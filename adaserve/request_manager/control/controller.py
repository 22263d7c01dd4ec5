"""Speculation control: speculate only where it pays, measured and calibrated online.

Every iteration of policy `adaserve` asks three questions, answered from two online models
(`AcceptanceCalibrator`: draft probability -> observed acceptance; `ForwardCostModel`:
forward time by tokens and context, measured from the iterations the server runs):

1. Draft at all?  A costly drafter (a draft model) runs only while speculation has paid off.
   After each drafting iteration we score it against incremental decoding,
       R = [E / (t_draft + T(n + k))] / [n / T(n)],
   with n the requests, k the verified tree nodes, E = n + the tokens accepted, t_draft as
   measured and T the cost model's forward time (at the size that ran). While the moving average
   of R is below 1, drafting is off; after `probe_interval` iterations one iteration probes
   again, the interval doubling after every probe that loses (up to `probe_interval_max`).
2. How deep?  A step-wise drafter stops growing when the next level's calibrated mass cannot
   buy its cost: sum of the frontier's f(v) x (T(n)/n, seconds a token is worth) < one draft
   step plus the verify time of the frontier's tokens.
3. Which nodes?  The policy's selection runs on calibrated trees; then nodes are dropped, the
   least probable leaf first (throughput-step nodes before SLO-step nodes), and the tree size
   kept is the one that maximises E_k / T(n + k) (draft time is spent by then). k = 0 is plain
   decoding, so an iteration never predicts fewer tokens per second than incremental.
   With a budget ceiling above B (`budget_ceiling`), a tree size that takes the forward past
   B is kept only if the forward stays within the pace, at the tokens it expects from it
   (`prefill.pace_allowance`: 0.95 x its SLO x e_r), of every stream that B's forward keeps
   within it (`_PaceFit`): tokens past B raise the forward's tokens per second, but a stream
   with few of them pays the whole longer forward for its one token, and at a tight SLO it
   lost its pace. A stream B's forward already takes past its pace does not bind.
   T(n + k) is never taken below T(n) + k x the cost model's per-token slope around those
   sizes (`verify_s`): two adjacent buckets' fits can differ by noise alone, and a node
   priced at that difference is verified whatever its acceptance. Nor is a tree forward
   taken at the cost model's word: the forwards that verified trees are measured against
   their prediction, as plain decode forwards are, and a verify forward is priced at its
   prediction times how much more the trees' forwards overran theirs (`tree_cost_factor`).
   The few tree forwards of a cost model's bucket are what it knows least (on torch here,
   4 decode rows plus one node measured 20-50% above a prediction that put the node at
   1-5 ms), and they are chosen where the prediction is lowest. Padding is checked the same
   way (`pad_cost_factor`): a padded forward is predicted cheaper than its exact size by the
   fit of another bucket, and on torch here 4 rows padded to 6 ran ~70 ms where the fit had
   put 4 rows alone at 104 ms and they took 53.
   Exploration: until `explore_observations` depth-1 nodes have been verified, what pays is
   the prior's word (a suffix drafter's chains say q = 1 at every depth), so nothing is kept
   for it alone: the most probable nodes are verified to learn, up to `explore_cost` of a
   plain forward's time (at least one node), so a cold calibration learns what the drafter is
   worth instead of never trying it or verifying deep trees on trust; later, one node when
   nothing paid. Exploring is paid from a credit that grows by `explore_budget` of each plain
   forward and gets back the tokens exploring had accepted (fewer nodes when it cannot pay
   for all), so learning costs at most a few percent even where a verified tree token costs
   nearly a forward (llama.cpp on a CPU), and stops once one node accepted at the best rate
   the observations allow could not pay.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from adaserve.config import SchedulerConfig
from adaserve.request_manager.control.calibration import AcceptanceCalibrator
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.policies import SpecShape
from adaserve.request_manager.slo import TSpecEstimator
from adaserve.tree import CandidateTree

# A predicted forward is never shorter than this (a model with no data must not divide by 0).
MIN_FORWARD_S = 1e-4
# A costly drafter runs only when a draft the target always agreed with would beat plain
# decoding by this factor: real acceptance is below 1, so a best case at break-even cannot
# pay. At one request on llama.cpp the default draft's best case sat at 0.99-1.00, and each
# pass of the policies benchmark drafted and verified on the coin flip: 0.87x incremental.
BEST_CASE_MIN_RATIO = 1.1
# Exploration goes on while the depth-1 acceptance rate could still pay with this confidence.
EXPLORE_DELTA = 0.1
# The exploration credit holds at most this many plain forwards' time.
EXPLORE_CREDIT_FORWARDS = 1.0
# How tree (or padded) forwards overran their predicted time, relative to plain decode ones: the
# weight of an observation decays by this much with each later one of its kind (~20 kept),
# the difference is shrunk toward none by this many pseudo-observations, and the factor
# it makes stays within these bounds. One forward's log error counts at most log(3) either way.
OVERRUN_DECAY = 0.95
OVERRUN_PRIOR = 2.0
TREE_FACTOR_BOUNDS = (0.67, 2.0)
OVERRUN_CAP = math.log(3.0)

# (request index, tokens it expects from this forward) -> the longest forward its pace
# affords in seconds; None: the request keeps no pace.
Allowance = Callable[[int, float], float | None]


class _PaceFit:
    """Which prefixes of the pruning order a forward may run past B (`prune`'s `allowance`).

    `ok[k]` for the first k nodes added: True up to the `within` nodes B holds beside the
    roots. Past them, the streams that B's forward (the first `within` nodes) keeps within
    their allowance are protected: a longer forward is allowed only while it stays within
    every protected stream's allowance at the tokens it expects from its nodes among the k.
    A stream B's forward already takes past its pace does not stop the others' nodes (more of
    its own can only raise its allowance). An allowance only grows as its request gains
    nodes, so the minimum is recomputed only when the request that held it gains one."""

    def __init__(self, n: int, within: int, allowance: Allowance | None, plain_s: float) -> None:
        self.ok = [True]
        self.within, self.allowance = within, allowance
        if allowance is None:
            return
        self.expected = [1.0] * n
        self.allow = [allowance(r, 1.0) for r in range(n)]
        self.limit = math.inf
        if within <= 0:  # the roots alone fill B: their forward is B's
            self._protect(plain_s)

    def _protect(self, b_forward_s: float) -> None:
        self.allow = [a if a is not None and a >= b_forward_s else None for a in self.allow]
        self.limit = min((a for a in self.allow if a is not None), default=math.inf)

    def add(self, k: int, r: int, p: float, verify_s: float) -> None:
        """The k-th node added belongs to request r, expected accepted with probability p;
        the forward of the first k is predicted at verify_s."""
        if self.allowance is None:
            self.ok.append(True)
            return
        self.expected[r] += p
        held = self.allow[r]
        if k <= self.within or held is not None:
            self.allow[r] = self.allowance(r, self.expected[r])
        if k == self.within:
            self._protect(verify_s)
        elif k > self.within and held is not None and held <= self.limit:
            self.limit = min((a for a in self.allow if a is not None), default=math.inf)
        self.ok.append(k <= self.within or verify_s <= self.limit)


class SpeculationController:
    """Decides, per iteration, whether to draft, how deep, and which nodes are worth verifying."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        costly_drafter: bool,
        max_pad_tokens: int,
        verify_cost: ForwardCostModel,
        draft_cost: ForwardCostModel | None = None,
    ) -> None:
        """`draft_cost`: time of one draft step by tokens fed (costly drafters; measured)."""
        self.cfg = cfg
        self.costly_drafter = costly_drafter
        self.max_pad_tokens = max_pad_tokens
        self.calibrator = AcceptanceCalibrator(
            num_buckets=cfg.calibration_buckets,
            max_depth=max(cfg.max_depth, len(cfg.specinfer_expansion)),
            prior_strength=cfg.calibration_prior_strength,
            decay=cfg.calibration_decay,
        )
        self.verify_cost = verify_cost
        self.draft_cost = draft_cost
        self.score = 1.0  # moving average of R
        self.num_scored = 0
        self.off_until = -1  # iteration index before which drafting stays off
        self.probe_interval = cfg.probe_interval_min
        self.iteration = 0
        self.num_skipped_drafts = 0
        # Seconds of forward time exploration may still spend (it starts full, at the first
        # tree), and the exploring iteration awaiting its verification: (seconds a token is
        # worth, tokens its paying part was expected to add), with the tokens accepted since.
        self.explore_credit = 0.0
        self._credit_started = False
        self._explore_pending: tuple[float, float] | None = None
        self._explore_accepted = 0
        self.probing = False  # this iteration probes a drafter that was switched off
        self.num_padded = 0  # forwards for which padding was predicted cheaper
        # Decayed sums of log(measured / predicted) and their weights, for decode forwards
        # without tree nodes or padding ("plain") and for those that verified trees ("tree").
        self._overrun = {"plain": [0.0, 0.0], "tree": [0.0, 0.0], "padded": [0.0, 0.0]}
        self.tree_cost_factor = 1.0
        self.pad_cost_factor = 1.0

    # ------------------------------------------------------------------ 1. draft at all?
    def should_draft(self, num_requests: int, shape: SpecShape, context: int) -> bool:
        self.iteration += 1
        if not self.costly_drafter:
            return True
        if (
            self.iteration >= self.off_until
            and self.best_case_ratio(num_requests, shape, context) < BEST_CASE_MIN_RATIO
        ):
            # Even a draft the target always agreed with could not pay for its steps here:
            # look again only after the longest probe interval (costs may change).
            self.off_until = self.iteration + self.cfg.probe_interval_max
        if self.iteration >= self.off_until:
            # A probe after an off period drafts one level: if depth 1 does not pay, no
            # deeper tree will, and a shallow probe costs one draft step, not d.
            scored = self.num_scored >= self.cfg.control_min_scored
            self.probing = scored and self.iteration == self.off_until
            return True
        self.num_skipped_drafts += 1
        return False

    def may_pay(self, num_requests: int, shape: SpecShape, context: int) -> bool:
        """Could drafting pay at all for this many requests (prompt catch-up asks before it
        spends a draft prefill on a drafter that the first decode iteration would turn off)?"""
        if not self.costly_drafter:
            return True
        return (
            self.drafting_on
            and self.best_case_ratio(num_requests, shape, context) >= BEST_CASE_MIN_RATIO
        )

    def best_case_ratio(self, n: int, shape: SpecShape, context: int) -> float:
        """R if every drafted token were accepted, at the best depth k <= d (chains)."""
        step_tokens = n * (shape.frontier_sizes()[0] if shape.depth else 1)
        best = 0.0
        for k in range(1, shape.depth + 1):
            spec = (
                n
                * (1 + k)
                / (
                    k * self.draft_step_s(step_tokens, context)
                    + self.verify_s(n, n * k, context, self.node_pairs(n, context, n * k))
                )
            )
            best = max(best, spec)
        return best / (n / self.forward_s(n, context))

    def draft_step_s(self, tokens: int, context: int) -> float:
        """Predicted time of one draft step feeding `tokens` tokens (0 for a free drafter)."""
        if self.draft_cost is None or not self.costly_drafter:
            return 0.0
        return self.draft_cost.predict(max(1, tokens), context)

    @property
    def exploring(self) -> bool:
        """Calibration has not yet seen enough verified nodes to be trusted."""
        return self.calibrator.observations(1) < self.cfg.explore_observations

    @property
    def drafting_on(self) -> bool:
        return not self.costly_drafter or self.iteration + 1 >= self.off_until

    def record_score(self, ratio: float) -> None:
        """R of an iteration that drafted; turns drafting off while the average loses."""
        if not self.costly_drafter:
            return
        w = 1.0 if self.num_scored == 0 or self.probing else self.cfg.control_score_ema
        # A probe's own score decides: the average still holds the iterations that lost.
        self.score = (1 - w) * self.score + w * ratio
        self.num_scored += 1
        if self.num_scored < self.cfg.control_min_scored:
            return
        if self.score < 1.0:
            self.off_until = self.iteration + self.probe_interval
            self.probe_interval = min(2 * self.probe_interval, self.cfg.probe_interval_max)
        else:
            self.probe_interval = self.cfg.probe_interval_min

    def record_draft_time(
        self, seconds: float, steps: int, tokens_per_step: int, context: int
    ) -> None:
        """A drafting iteration's measured time refines the draft step's cost model."""
        if self.draft_cost is not None:
            self.draft_cost.observe(max(1, tokens_per_step), context, seconds / max(1, steps))

    # ------------------------------------------------------------------ 2. how deep?
    def forward_s(self, tokens: int, context: int, tree_pairs: int = 0) -> float:
        """Predicted target forward time of `tokens` tokens, at its cheapest padded size;
        `tree_pairs`: the query-key pairs of its tree nodes past their roots (cost_terms)."""
        cost = self.verify_cost
        if self.max_pad_tokens <= tokens:  # nothing to pad to (llama.cpp: never)
            return max(cost.predict(tokens, context, 0, 0, tree_pairs), MIN_FORWARD_S)
        padded = cost.best_padded(tokens, context, self.max_pad_tokens, tree_pairs=tree_pairs)
        padded_s = cost.predict(padded, context, padded - tokens, 0, tree_pairs)
        if padded != tokens:
            # Padding is priced as padded forwards ran against their prediction.
            exact_s = cost.predict(tokens, context, 0, 0, tree_pairs)
            padded_s = min(padded_s * self.pad_cost_factor, exact_s)
        # Never 0: a model with no data (or a slope fitted too steep) must not divide by it.
        return max(padded_s, MIN_FORWARD_S)

    def verify_s(
        self,
        n: int,
        nodes: int,
        context: int,
        tree_pairs: int = 0,
        roots_s: float | None = None,
    ) -> float:
        """Predicted time of a forward of `n` roots and `nodes` tree nodes: never less than the
        roots' forward plus `nodes` x the cost model's per-token slope over the sizes around
        (`token_slope`), so nodes are not priced at the difference of two noisy buckets' fits.
        `roots_s`: `forward_s(n, context)` when the caller has it (pruning prices every prefix
        of one selection over the same roots: without it, each price searched the padded
        sizes of the roots' forward again, most of a paper-scale iteration's host time)."""
        spec = self.forward_s(n + nodes, context, tree_pairs)
        if nodes <= 0:
            return spec
        slope = self.verify_cost.token_slope(n, n + nodes, context)
        if roots_s is None:
            roots_s = self.forward_s(n, context)
        floor = roots_s + nodes * slope
        return max(max(spec, floor) * self.tree_cost_factor, floor)

    def observe_forward(
        self, predicted_s: float | None, measured_s: float, tree_tokens: int, padded: bool
    ) -> None:
        """A decode forward (no prompt chunk riding along) as predicted and as measured:
        updates `tree_cost_factor` and `pad_cost_factor` (`_overrun_factor`: how much more
        unpadded tree forwards, or padded plain ones, overran than unpadded plain ones).
        Relative to plain forwards, so
        a machine that runs slower than its fit for a while (which moves every kind alike, and
        which pruning's ratios cancel) changes nothing. A padded tree forward is neither."""
        if predicted_s is None or predicted_s <= 0 or measured_s <= 0:
            return
        if tree_tokens and padded:
            return
        kind = "tree" if tree_tokens else "padded" if padded else "plain"
        error = min(max(math.log(measured_s / predicted_s), -OVERRUN_CAP), OVERRUN_CAP)
        acc = self._overrun[kind]
        acc[0] = OVERRUN_DECAY * acc[0] + error
        acc[1] = OVERRUN_DECAY * acc[1] + 1.0
        self.tree_cost_factor = self._overrun_factor("tree")
        self.pad_cost_factor = self._overrun_factor("padded")

    def overrun_weights(self) -> dict[str, float]:
        """The decayed number of forwards of each kind observed ("plain", "tree", "padded")."""
        return {kind: acc[1] for kind, acc in self._overrun.items()}

    def _overrun_factor(self, kind: str) -> float:
        """exp(the mean log overrun of `kind` - that of plain forwards), the difference shrunk
        toward 0 by OVERRUN_PRIOR pseudo-observations of `kind` (1.0 before any)."""
        total, weight = self._overrun[kind]
        if weight <= 0:
            return 1.0
        plain_total, plain_weight = self._overrun["plain"]
        plain = plain_total / plain_weight if plain_weight > 0 else 0.0
        gap = weight / (weight + OVERRUN_PRIOR) * (total / weight - plain)
        lo, hi = TREE_FACTOR_BOUNDS
        return min(max(math.exp(gap), lo), hi)

    @staticmethod
    def node_pairs(n: int, context: int, nodes: int) -> int:
        """Extra pairs of `nodes` tree nodes over `n` requests holding `context` tokens, each
        node at its request's mean context (for decisions made before the trees exist)."""
        return nodes * (context // max(1, n) + 1)

    def record_iteration_time(self, shape: SpecShape | None, total_s: float) -> None:
        """Nothing to learn here: t_spec comes from the cost model (`t_spec_s`)."""
        return None

    def pad_to(
        self,
        tokens: int,
        context: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> int:
        """Tokens to run the verify forward at: padded when the cost model says it is cheaper.

        Only for a clear saving (pad_min_saving), and every pad_explore_every-th padded forward runs
        unpadded instead, so the cost of the exact size is measured again and a seed that was
        too high cannot keep us padding forever. `silent` tokens (prompt chunks riding along)
        return no logits, as the padding rows return none; the pairs as in `cost_terms`.
        """
        cost = self.verify_cost
        limit = max(tokens, self.max_pad_tokens)
        best = cost.best_padded(tokens, context, limit, silent, silent_pairs, tree_pairs)
        if best == tokens:
            return tokens
        self.num_padded += 1
        padded_s = cost.predict(best, context, silent + best - tokens, silent_pairs, tree_pairs)
        padded_s *= self.pad_cost_factor
        saving = 1.0 - padded_s / cost.predict(tokens, context, silent, silent_pairs, tree_pairs)
        if saving < self.cfg.pad_min_saving or self.num_padded % self.cfg.pad_explore_every == 0:
            return tokens
        return best

    def keep_going(self, num_requests: int, context: int):
        """A `KeepGoing` for step-wise drafters: is the next level worth a draft step?"""
        token_s = self.forward_s(num_requests, context) / num_requests

        def decide(trees: list[CandidateTree], frontier: list[list[int]]) -> bool:
            mass = 0.0
            nodes = 0
            for tree, nodes_ in zip(trees, frontier):
                cal = self.calibrator.calibrate_tree(tree)
                mass += sum(cal.path_prob(v) for v in nodes_)
                nodes += len(nodes_)
            pairs = self.node_pairs(num_requests, context, nodes)
            extra = self.verify_s(num_requests, nodes, context, pairs) - self.forward_s(
                num_requests, context
            )
            step_s = self.draft_step_s(nodes, context)
            return mass * token_s >= step_s + max(extra, 0.0) / 2

        return decide

    def t_spec_s(
        self, num_requests: int, context: int, shape: SpecShape, extra_tokens: int = 0
    ) -> float:
        """Predicted iteration time for A(r): draft steps plus a forward at the budget (plus
        `extra_tokens` of prefill riding along)."""
        tokens = max(num_requests, min(self.cfg.budget, num_requests * shape.max_nodes))
        draft = (
            0.0
            if shape.cheap_only
            else shape.depth * self.draft_step_s(num_requests * shape.width, context)
        )
        pairs = self.node_pairs(num_requests, context, tokens - num_requests)
        return draft + self.forward_s(tokens + extra_tokens, context + extra_tokens, pairs)

    # ------------------------------------------------------------------ 3. which nodes?
    def calibrate(self, trees: Sequence[CandidateTree]) -> list[CandidateTree]:
        return [self.calibrator.calibrate_tree(t) for t in trees]

    def prune(
        self,
        trees: Sequence[CandidateTree],
        selections: Sequence[Sequence[int]],
        protected: Sequence[Sequence[int]],
        context: int,
        cached: Sequence[int] | None = None,
        allowance: Allowance | None = None,
    ) -> tuple[list[list[int]], float]:
        """Keep the prefix of the selection that maximises expected tokens per second.

        `trees` are calibrated; `protected` are the SLO step's nodes (dropped last); `cached`:
        each request's tokens in the KV cache (a node at depth d attends cached + d + 1 keys,
        so a node of a long request costs more; None: every request at the mean context).
        `allowance(r, e_r)`: the longest forward request r's pace affords when it expects e_r
        tokens from it (None: r keeps no pace); given, a prefix that takes the forward past B
        (the budget ceiling) is kept only if its predicted forward fits the allowance of
        every stream that B's forward keeps within its own (`_PaceFit`), so the tokens past B
        that raise the forward's tokens per second never take a stream past its pace.
        Returns (selections, expected tokens E of what is kept).
        """
        n = len(trees)
        # Removal order: unprotected before protected, lowest f(v) first, deeper first on ties
        # (f never grows along a path, so a node goes only after its selected children).
        removable = []
        for r, sel in enumerate(selections):
            guard = set(protected[r])
            for v in sel:
                if v != 0:
                    removable.append(
                        (v in guard, trees[r].path_logprobs[v], -trees[r].depths[v], r, v)
                    )
        removable.sort()
        adds = list(reversed(removable))  # the order in which nodes are (re)added
        mean = context // max(1, n)
        # pairs[k]: the extra query-key pairs of the first k nodes added
        pairs = [0]
        for *_, r, v in adds:
            pairs.append(
                pairs[-1] + (mean if cached is None else cached[r]) + trees[r].depths[v] + 1
            )
        plain_s = self.forward_s(n, context)
        best_k, best_rate = 0, n / plain_s
        expected = best_expected = float(n)
        # Nodes B holds beside the roots; past them, only what the protected streams' paces allow.
        fits = _PaceFit(n, self.cfg.budget - n, allowance, plain_s)
        for k, (*_, r, v) in enumerate(adds, start=1):
            p = trees[r].path_prob(v)
            expected += p
            verify_s = self.verify_s(n, k, context, pairs[k], plain_s)
            fits.add(k, r, p, verify_s)
            rate = expected / verify_s
            if rate > best_rate and fits.ok[k]:
                best_k, best_rate, best_expected = k, rate, expected
        if self.exploring:
            # What "pays" above rests on the draft's own word (a cold prior): nothing is
            # verified on it alone. Whatever is verified now is exploring, priced below.
            best_k, best_expected = 0, float(n)
        explore_k = self._explore_size(n, context, pairs, best_k)
        # Verify more than pays, to learn: paid from the exploration credit, so what learning
        # costs (net of what it gets accepted) stays within explore_budget of the plain
        # forward time, however costly a tree token is on this backend; when the credit
        # cannot pay for them all, the most probable nodes it can pay for.
        base_s = self.verify_s(n, best_k, context, pairs[best_k], plain_s)
        while explore_k > best_k and (
            not fits.ok[explore_k]
            or self.verify_s(n, explore_k, context, pairs[explore_k], plain_s) - base_s
            > self.explore_credit
        ):
            explore_k -= 1
        if explore_k > best_k:
            self.explore_credit -= (
                self.verify_s(n, explore_k, context, pairs[explore_k], plain_s) - base_s
            )
            self._explore_pending = (self.forward_s(n, context) / n, best_expected - n)
            best_k = explore_k
            best_expected = n + sum(trees[r].path_prob(v) for *_, r, v in adds[:best_k])
        kept: list[list[int]] = [[0] for _ in trees]
        for _, _, _, r, v in adds[:best_k]:
            kept[r].append(v)
        return [sorted(s) for s in kept], best_expected

    def _explore_size(self, n: int, context: int, pairs: Sequence[int], best_k: int) -> int:
        """Nodes to verify to learn from (0: none beyond the `best_k` that pay); `pairs[k]`:
        the extra query-key pairs of the first k candidate nodes.

        While calibration has not seen the drafter (`exploring`): the most probable nodes, as
        many as add at most explore_cost of a plain forward (at least one); once it has, one
        node (or what a padded forward holds for free) only when nothing paid, so a drafter
        that became good (another workload) gets used again. Never where one node accepted at
        the best rate the observations allow could not pay. Also accrues the credit.
        """
        candidates = len(pairs) - 1
        plain_s = self.forward_s(n, context)
        self._accrue_credit(plain_s)
        if not candidates or not self._exploration_may_pay(n, context):
            return 0
        if self.exploring:
            limit = (1.0 + self.cfg.explore_cost) * plain_s
            k = 1
            while (
                k < candidates and self.verify_s(n, k + 1, context, pairs[k + 1], plain_s) <= limit
            ):
                k += 1
            return k
        if best_k:
            return 0
        free = self.verify_cost.best_padded(n, context, max(n, self.max_pad_tokens)) - n
        return min(candidates, max(1, free))

    def nothing_proposed(self, n: int, context: int) -> None:
        """An iteration whose drafter proposed no node for any of its `n` requests: nothing to
        select or prune, only the exploration credit accrues (as `prune` would accrue it)."""
        self._accrue_credit(self.forward_s(n, context))

    def _accrue_credit(self, plain_s: float) -> None:
        """Settle the last exploring iteration, then grow the credit by explore_budget of a
        plain forward (`plain_s`), up to EXPLORE_CREDIT_FORWARDS of one."""
        self._settle_exploration()
        cap = EXPLORE_CREDIT_FORWARDS * plain_s
        if not self._credit_started:
            self.explore_credit, self._credit_started = cap, True  # try a new drafter at once
        self.explore_credit = min(cap, self.explore_credit + self.cfg.explore_budget * plain_s)

    def _settle_exploration(self) -> None:
        """Credit back the tokens an exploring iteration got accepted beyond what its paying
        part was expected to yield (negative when it got fewer)."""
        if self._explore_pending is None:
            return
        token_s, paying_gain = self._explore_pending
        self.explore_credit += (self._explore_accepted - paying_gain) * token_s
        self._explore_pending = None
        self._explore_accepted = 0

    def _exploration_may_pay(self, n: int, context: int) -> bool:
        """Could one more verified node pay at the best acceptance rate the depth-1
        observations so far allow (an upper confidence bound)? Where a tree token costs
        nearly a forward, a few rejections end exploring; where it is almost free, never."""
        ucb = self.calibrator.acceptance_upper_bound(1, EXPLORE_DELTA)
        one = self.verify_s(n, 1, context, self.node_pairs(n, context, 1))
        return (n + ucb) / one > n / self.forward_s(n, context)

    def iteration_ratio(
        self, expected: float, n: int, tokens: int, context: int, draft_s: float
    ) -> float:
        """R of one iteration: its tokens/s (E tokens in draft + verify time) over incremental's."""
        verify = self.verify_s(n, tokens - n, context, self.node_pairs(n, context, tokens - n))
        spec = expected / (draft_s + verify)
        return spec / (n / self.forward_s(n, context))

    # ------------------------------------------------------------------ observation
    def observe_verification(
        self, tree: CandidateTree, verified: Sequence[int], accepted: Sequence[int]
    ) -> None:
        self.calibrator.observe_verification(tree, verified, accepted)
        if self._explore_pending is not None:
            self._explore_accepted += len(accepted)

    def after_iteration(
        self,
        shape: SpecShape | None,
        trees: Sequence[CandidateTree],
        expected_tokens: Sequence[float],
        draft_s: float,
        num_requests: int,
        accepted: int,
        padded_tokens: int,
        context: int,
    ) -> None:
        """Score an iteration in which the costly drafter ran; refine the draft's cost model."""
        if shape is None or not self.costly_drafter or shape.cheap_only:
            return  # only iterations where the costly drafter ran score it
        steps = max(max(t.depths) for t in trees)
        self.record_draft_time(draft_s, steps, num_requests * shape.width, context)
        # Scored by the calibrated expectation once calibration has seen the drafter (one
        # lucky probe must not switch a bad draft back on), by what was accepted before.
        tokens = num_requests + accepted if self.exploring else sum(expected_tokens)
        self.record_score(
            self.iteration_ratio(tokens, num_requests, padded_tokens, context, draft_s)
        )

    def calibration_summary(self):
        """Per-depth calibration and whether drafting is on (the /metrics gauges)."""
        return self.calibrator.depth_summary(), self.drafting_on


class NoControl:
    """The controller of policies that reproduce the paper or a baseline (and incremental):
    draft whenever the policy does, verify what the selection chose, pad nothing. t_spec is
    the moving average of measured speculative iterations, as the paper has it."""

    drafting_on = True
    probing = False
    exploring = False

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.t_spec = TSpecEstimator(cfg.t_spec_init_s, cfg.t_spec_ema)

    def should_draft(self, num_requests: int, shape: SpecShape, context: int) -> bool:
        return True

    def may_pay(self, num_requests: int, shape: SpecShape, context: int) -> bool:
        return True

    def keep_going(self, num_requests: int, context: int) -> None:
        return None  # drafters grow every level the shape asks for

    def calibrate(self, trees: Sequence[CandidateTree]) -> list[CandidateTree]:
        return list(trees)

    def t_spec_s(
        self, num_requests: int, context: int, shape: SpecShape, extra_tokens: int = 0
    ) -> float:
        return self.t_spec.value_s

    def prune(
        self,
        trees: Sequence[CandidateTree],
        selections: Sequence[Sequence[int]],
        protected: Sequence[Sequence[int]],
        context: int,
        cached: Sequence[int] | None = None,
        allowance: Allowance | None = None,
    ) -> tuple[list[list[int]], float]:
        expected = sum(t.path_prob(v) for t, sel in zip(trees, selections) for v in sel)
        return [list(s) for s in selections], expected

    def pad_to(
        self,
        tokens: int,
        context: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> int:
        return tokens

    def nothing_proposed(self, n: int, context: int) -> None:
        return None

    def observe_forward(
        self, predicted_s: float | None, measured_s: float, tree_tokens: int, padded: bool
    ) -> None:
        return None

    def observe_verification(
        self, tree: CandidateTree, verified: Sequence[int], accepted: Sequence[int]
    ) -> None:
        return None

    def after_iteration(
        self,
        shape: SpecShape | None,
        trees: Sequence[CandidateTree],
        expected_tokens: Sequence[float],
        draft_s: float,
        num_requests: int,
        accepted: int,
        padded_tokens: int,
        context: int,
    ) -> None:
        return None

    def record_iteration_time(self, shape: SpecShape | None, total_s: float) -> None:
        """t_spec learns from iterations that speculated (plain decoding is another shape)."""
        if shape is not None:
            self.t_spec.update(total_s)

    def calibration_summary(self):
        return None


Controller = SpeculationController | NoControl
