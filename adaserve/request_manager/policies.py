"""Policies: the same iteration loop, each with its own speculation shape and selection function."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from adaserve.config import SchedulerConfig
from adaserve.tree import (
    CandidateTree,
    equal_greedy_select,
    global_greedy_select,
    select_all,
    slo_customized_select,
    throughput_optimized_select,
    tree_shape,
)


@dataclass(frozen=True)
class SpecShape:
    """How the draft grows candidate trees this iteration.

    Beam mode (`expansion` None): `depth` steps of beam search keeping `width` beams.
    Expansion mode (SpecInfer): step k gives every frontier node its top `expansion[k]` children.
    """

    depth: int
    width: int
    expansion: tuple[int, ...] | None = None
    # Speculation control has the costly drafter off: only the cheap parts of a combined
    # drafter (the suffix index) propose.
    cheap_only: bool = False

    def frontier_sizes(self) -> list[int]:
        """Nodes added at depth 1..depth (per request)."""
        if self.expansion is None:
            return [self.width] * self.depth
        sizes, n = [], 1
        for e in self.expansion[: self.depth]:
            n *= e
            sizes.append(n)
        return sizes

    @property
    def max_nodes(self) -> int:
        return 1 + sum(self.frontier_sizes())


def spec_shape(cfg: SchedulerConfig, num_requests: int) -> SpecShape | None:
    """This iteration's candidate-tree shape; None for incremental decoding."""
    p = cfg.policy
    if p == "incremental":
        return None
    if p == "sequence":
        return SpecShape(depth=cfg.gamma, width=1)
    if p == "specinfer":
        return SpecShape(
            depth=len(cfg.specinfer_expansion),
            width=max(cfg.specinfer_expansion),
            expansion=cfg.specinfer_expansion,
        )
    d, w = tree_shape(cfg.selection_budget, num_requests, cfg.max_depth, cfg.max_width)
    return SpecShape(depth=d, width=w)


def select_nodes(
    cfg: SchedulerConfig,
    trees: Sequence[CandidateTree],
    a_cap: Sequence[float | None],
    a_order: Sequence[float | None],
) -> tuple[list[list[int]], list[list[int]]]:
    """The policy's selection: per request, sorted node indices including the root.

    Returns (selections, SLO-step selections): the second is what AdaServe's SLO-customized
    step chose (speculation control drops those nodes last); roots alone for other policies.
    """
    p = cfg.policy
    roots = [[0] for _ in trees]
    if p in ("adaserve", "adaserve_paper"):
        budget = cfg.selection_budget  # B, or the controlled policy's ceiling
        slo_step, budget_left = slo_customized_select(trees, a_cap, a_order, budget, cfg.n_max)
        return throughput_optimized_select(trees, slo_step, budget_left), slo_step
    if p == "global_greedy":
        return global_greedy_select(trees, cfg.budget), roots
    if p == "equal_greedy":
        return equal_greedy_select(trees, cfg.budget), roots
    # specinfer, sequence, incremental: verify whatever was drafted
    return select_all(trees), roots
