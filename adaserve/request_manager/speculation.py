"""This iteration's trees: draft, (calibrate,) select, (prune) — and what control learns after.

`TreePlanner` is the speculative half of an iteration, kept apart from the scheduler's
queues and KV bookkeeping. One planner serves every policy: the shape and the selection
come from `policies.py`; speculation control (policy adaserve) adds calibration, pruning and
the decision whether to draft at all (`control.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace

from adaserve.config import SchedulerConfig
from adaserve.exec.runner import Engine
from adaserve.exec.timing import measured_once
from adaserve.request_manager.control.controller import (
    Controller,
    NoControl,
    SpeculationController,
)
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.drafters import Drafter, make_drafter
from adaserve.request_manager.drafters.combined import CombinedDrafter
from adaserve.request_manager.policies import SpecShape, select_nodes, spec_shape
from adaserve.request_manager.prefill import pace_allowance
from adaserve.request_manager.request import Request
from adaserve.request_manager.slo import slo_requirements
from adaserve.tree import CandidateTree, subtree, top_chain

logger = logging.getLogger("adaserve.speculation")


@dataclass
class TreePlan:
    """Who gets verified this iteration: a candidate tree and selected nodes per request."""

    trees: list[CandidateTree]  # as drafted (capped); verification indexes these
    selections: list[list[int]]  # sorted node indices, root 0 included
    expected_tokens: list[float]  # 1 + sum of the selected nodes' (calibrated) f(v)
    shape: SpecShape | None = None  # None: no draft ran (plain decoding)
    draft_s: float = 0.0
    select_s: float = 0.0

    @classmethod
    def plain(cls, requests: Sequence[Request]) -> TreePlan:
        return cls(
            [CandidateTree.root(r.last_token) for r in requests],
            [[0] for _ in requests],
            [1.0] * len(requests),
        )


class TreePlanner:
    """Drafter + selection + controller of one scheduler."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        engine: Engine,
        drafter: str | Drafter,
        cost: ForwardCostModel,
        measure: bool = True,
    ) -> None:
        """`measure=False`: the draft's cost curve is not timed (a planner about to be
        replaced, `LLMEngine(prepare=False)`)."""
        self.cfg, self.engine = cfg, engine
        self.drafter: Drafter | None = None
        self.num_draft_failures = 0  # iterations whose drafter raised (verified roots only)
        # Policy adaserve: SpeculationController; every other policy: the null controller.
        self.controller: Controller = NoControl(cfg)
        if not cfg.speculative:
            return
        if isinstance(drafter, Drafter):
            self.drafter = drafter
        else:
            if drafter == "auto":
                drafter = "model" if engine.draft is not None else "suffix"
            if "model" in drafter:
                engine.enable_draft_graphs(cfg.max_num_seqs, _widest_frontier(cfg))
            self.drafter = make_drafter(drafter, cfg, engine)
        if cfg.controlled:
            draft_cost = None
            if self.drafter.costly and engine.draft is not None:
                draft_cost = ForwardCostModel(forget=cfg.cost_forget)
                if measure:
                    draft = engine.draft
                    curve = f"curve:{cfg.budget}"
                    draft_cost.seed(
                        measured_once(draft, curve, lambda: draft.cost_points(cfg.budget))
                    )
            # A backend that runs every forward at its own size (llama.cpp) is priced at it:
            # a padded size the runner would never run must not look like the cheaper one.
            pad_limit = cfg.budget if engine.target.supports_padding else 0
            self.controller = SpeculationController(
                cfg, self.drafter.costly, pad_limit, cost, draft_cost
            )

    def shape(self, running: Sequence[Request]) -> SpecShape | None:
        """This iteration's tree shape; None: plain decoding (incremental, or drafting is off)."""
        shape = spec_shape(self.cfg, len(running))
        ctl = self.controller
        if shape is not None and self.cfg.controlled:
            if len(running) >= self.cfg.selection_budget:
                return None  # the roots alone fill the budget: nothing could be verified
            context = sum(r.num_cached for r in running)
            if not ctl.should_draft(len(running), shape, context):
                # The costly drafter does not pay now; a cheap part (the suffix index of
                # "eagle+suffix") still proposes, scored by calibration and pruning alone.
                if isinstance(self.drafter, CombinedDrafter) and self.drafter.has_cheap_part:
                    return replace(shape, cheap_only=True)
                return None
            if ctl.probing and shape.expansion is None:
                return SpecShape(depth=1, width=shape.width)
        return shape

    def draft_may_pay(self, num_requests: int, context: int) -> bool:
        """Whether a costly drafter could pay for `num_requests` decoding at `context` (False:
        its prompt catch-up is not worth running; it catches up if drafting turns on)."""
        shape = spec_shape(self.cfg, num_requests)
        if shape is None:
            return False
        return self.controller.may_pay(num_requests, shape, context)

    def scratch_tokens(self, shape: SpecShape | None) -> int:
        return 0 if shape is None or self.drafter is None else self.drafter.scratch_tokens(shape)

    def plan(
        self, reqs: list[Request], shape: SpecShape | None, context: int, extra_tokens: int
    ) -> TreePlan:
        """Draft and select for `reqs`; `extra_tokens` (prefill) ride in the same forward."""
        if shape is None:
            return TreePlan.plain(reqs)
        assert self.drafter is not None
        start = self.engine.clock()
        ctl = self.controller
        if self.engine.draft is not None and not shape.cheap_only:
            scratch = self.drafter.scratch_tokens(shape)
            for r in reqs:  # the scheduler checked these fit; the drafter frees the scratch
                self.engine.draft.cache.reserve(r.draft_block_table, r.num_tokens + scratch)
        keep_going = None if shape.cheap_only else ctl.keep_going(len(reqs), context)
        try:
            trees = self.drafter.propose(reqs, shape, keep_going)
        except Exception:
            # Drafts are only proposals: a failing drafter costs this iteration its
            # speculation, never a request. Its per-request state is dropped (rebuilt later).
            # The traceback once, then a count: formatting one costs ~1 ms an iteration.
            self.num_draft_failures += 1
            n = self.num_draft_failures
            if n == 1:
                logger.exception(
                    "drafter %s failed; this iteration verifies roots only", self.drafter.name
                )
            elif n & (n - 1) == 0:
                logger.error(
                    "drafter %s has failed in %d iterations (traceback logged at the first)",
                    self.drafter.name,
                    n,
                )
            for r in reqs:
                r.draft_num_cached = 0
                self.drafter.on_release(r)
            if self.engine.draft is not None:
                for r in reqs:
                    self.engine.draft.cache.truncate(r.draft_block_table, r.num_tokens)
            return TreePlan.plain(reqs)
        t_draft = self.engine.clock()
        trees = [self.constrain(r, self.cap_depth(r, t)) for r, t in zip(reqs, trees)]
        if all(len(t) == 1 for t in trees):
            # Nothing proposed (a suffix lookup that matched nowhere, most iterations on new
            # text): nothing to calibrate, select or prune, which costs ~0.1 ms of host time
            # an iteration on this CPU, ~1% of a llama.cpp decode.
            ctl.nothing_proposed(len(reqs), context)
            return TreePlan(
                trees,
                [[0] for _ in reqs],
                [1.0] * len(reqs),
                shape,
                draft_s=t_draft - start,
                select_s=self.engine.clock() - t_draft,
            )
        if self.cfg.policy == "sequence":
            trees = [top_chain(t) for t in trees]  # a drafter may branch; sequence is a chain
        # Controlled: the selection sees calibrated f(v) and the cost model's t_spec.
        scored = ctl.calibrate(trees)
        t_spec = ctl.t_spec_s(len(reqs), context, shape, extra_tokens)
        a_cap, a_need = slo_requirements(reqs, t_draft, t_spec, shape.depth)
        selections, slo_step = select_nodes(self.cfg, scored, a_cap, a_need)
        cached = [r.num_cached for r in reqs]
        allowance = None
        if self.cfg.selection_budget > self.cfg.budget:
            # Past B only within every stream's pace (controller.prune, `budget_ceiling`).
            margin = self.cfg.slo_pace_margin

            def allowance(i: int, e: float) -> float | None:
                return pace_allowance(reqs[i], e, margin)

        selections, _ = ctl.prune(scored, selections, slo_step, context, cached, allowance)
        expected = [sum(t.path_prob(v) for v in sel) for t, sel in zip(scored, selections)]
        return TreePlan(
            trees,
            selections,
            expected,
            shape,
            draft_s=t_draft - start,
            select_s=self.engine.clock() - t_draft,
        )

    def cap_depth(self, req: Request, tree: CandidateTree) -> CandidateTree:
        """Drop nodes deeper than the request can still use (max_tokens, max_model_len)."""
        room = (
            min(
                req.params.max_tokens - len(req.output_token_ids),
                self.engine.max_model_len - req.num_tokens,
            )
            - 1
        )
        if max(tree.depths) <= room:
            return tree
        return subtree(tree, [v for v in range(len(tree)) if tree.depths[v] <= room])

    def constrain(self, req: Request, tree: CandidateTree) -> CandidateTree:
        """Cut the nodes a request's structured output refuses (with their subtrees): they
        could never be emitted, so verifying them would only cost."""
        if req.grammar is None or len(tree) == 1:
            return tree
        keep = req.grammar.valid_nodes(tree.tokens, tree.parents)
        return tree if len(keep) == len(tree) else subtree(tree, keep)

    def after_iteration(
        self,
        plan: TreePlan,
        num_requests: int,
        accepted: int,
        padded_tokens: int,
        context: int,
        total_s: float,
    ) -> None:
        """Feed what the iteration measured back into t_spec and speculation control."""
        ctl = self.controller
        ctl.record_iteration_time(plan.shape, total_s)
        if self.drafter is None or not self.drafter.costly:
            return
        ctl.after_iteration(
            plan.shape,
            plan.trees,
            plan.expected_tokens,
            plan.draft_s,
            num_requests,
            accepted,
            padded_tokens,
            context,
        )


def _widest_frontier(cfg: SchedulerConfig) -> int:
    """The most nodes one request feeds in a draft step under this policy (graph widths)."""
    if cfg.policy == "specinfer":
        expansion = cfg.specinfer_expansion
        sizes = SpecShape(len(expansion), max(expansion), expansion).frontier_sizes()
        return max(sizes[:-1], default=1)
    return 1 if cfg.policy == "sequence" else cfg.max_width
