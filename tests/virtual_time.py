"""A target whose forwards cost a chosen time, on the engine's clock instead of by sleeping."""

from __future__ import annotations

from collections.abc import Callable

from adaserve import LLMEngine
from adaserve.exec.timing import NUM_SEQS, cost_point_shapes, split_tokens
from adaserve.sim.engine import VirtualClock


def slow_forwards(engine: LLMEngine, extra_s: Callable[[int], float]) -> LLMEngine:
    """Every target forward of n tokens (padding included) takes `extra_s(n)` seconds more.

    The engine's clock becomes a VirtualClock that counts only the added seconds, so the
    scheduler sees the slow target (TPOT, deadlines, its cost model) while the test neither
    waits for it nor depends on how fast the machine running it is (a CI machine's host time
    varies run to run). The start-up cost curve is the added time too, as it would be when
    measured on such a target; then a fresh scheduler takes over. Build the engine with
    `prepare=False` to skip timing the real curve that this one replaces.
    """
    clock = VirtualClock(host_time=False)
    engine.engine.clock = clock
    runner = engine.engine.target
    real_forward = runner._forward

    def forward(batch):
        out = real_forward(batch)
        clock.advance(extra_s(len(batch.token_ids)))
        return out

    def cost_points(max_tokens: int) -> list[tuple[int, int, float]]:
        # The shapes the real curve times, each at its added time alone (host time does not
        # count on this clock), so no forward needs to run for them.
        counts, context = cost_point_shapes(runner, max_tokens)
        return [(n, context * len(split_tokens(n, NUM_SEQS)), extra_s(n)) for n in counts]

    runner._forward = forward
    runner.cost_points = cost_points
    # Measured here, on this runner's added time: not what another engine of the same model
    # measured earlier in the process (`timing.measured_once`), and not kept for the next.
    runner.timing_key = lambda: None
    # A forward's added time depends on its size alone: a tree's nodes cost what the curve's do.
    runner.tree_pair_cost = lambda: 0.0
    cfg = engine.sched_cfg
    engine.apply_profile(cfg.budget, cfg.t_spec_init_s)
    return engine


def slow_draft(engine: LLMEngine, seconds: float) -> LLMEngine:
    """Every draft-model forward takes `seconds` more on the engine's (virtual) clock.

    Call after `slow_forwards`: the draft model's cost then stands beside the target's on the
    same clock, so whether drafting pays is decided by these costs, not by the host's speed."""
    clock = engine.engine.clock
    assert isinstance(clock, VirtualClock), "slow_forwards first: the clock must be virtual"
    draft = engine.engine.draft
    real_forward = draft._forward

    def forward(batch):
        out = real_forward(batch)
        clock.advance(seconds)
        return out

    draft._forward = forward
    return engine
