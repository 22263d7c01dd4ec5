"""One iteration is three calls: `schedule()` plans, `engine.run(plan)` runs, `commit` applies.

The plan says exactly what the forward runs (its trees' and chunks' tokens and KV slots),
the commit's stats count what the plan held, and driving an engine through the three calls
gives the tokens the target alone gives.
"""

from __future__ import annotations

import pytest

from adaserve import LLM, LLMEngine, SamplingParams
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig


def _engine(path, policy: str) -> LLMEngine:
    return LLMEngine(
        ModelConfig(model=str(path)),
        CacheConfig(block_size=4, num_blocks=512),
        SchedulerConfig(policy=policy, budget=12, max_prefill_chunk=8, min_prefill_chunk=4),
    )


PROMPTS = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 5, 9, 13, 17, 21], [3, 4, 5, 3, 4, 5, 3, 4]]


@pytest.mark.parametrize("policy", ["adaserve_paper", "adaserve"])
def test_schedule_run_commit_is_one_iteration_and_the_plan_is_what_ran(tiny_llama, policy) -> None:
    # adaserve_paper verifies every tree it selects, so the run must hold trees; adaserve's
    # speculation control verifies them only while the forwards it times say they pay (on a
    # loaded machine a whole run of the tiny model can say they never do): same invariants.
    engine = _engine(tiny_llama, policy)
    sched = engine.scheduler
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in PROMPTS]
    saw_chunk = saw_tree = False
    for _ in range(200):
        if not engine.has_unfinished():
            break
        plan = sched.schedule()
        batch = plan.batch
        # The batch holds each tree's nodes then each chunk's tokens, in the plan's order.
        sizes = [len(t.tree) for t in plan.trees] + [c.num_tokens for c in plan.chunks]
        assert batch.query_lens == sizes, "the batch is not the plan's trees and chunks"
        for t in plan.trees:
            r = t.request
            assert t.kv_start == r.num_cached, "a tree must start at the request's cached tokens"
            assert len(r.block_table) * 4 >= r.num_cached + len(t.tree), "tree KV not reserved"
        for c in plan.chunks:
            assert c.start == c.request.num_cached and c.end > c.start
        assert plan.pad_to >= len(batch.token_ids)
        saw_chunk |= bool(plan.chunks)
        saw_tree |= any(len(t.tree) > 1 for t in plan.trees)
        out = engine.engine.run(plan)
        if plan.is_empty:
            assert out.logits is None
        changed = sched.commit(plan, out)
        stats = sched.last_stats
        if not plan.is_empty:
            assert stats is plan.stats
            assert stats.tree_tokens == sum(len(t.tree) - 1 for t in plan.trees)
            assert stats.prefill_tokens == sum(c.num_tokens for c in plan.chunks)
            assert stats.forward_s == out.forward_s
            assert {t.request.request_id for t in plan.trees} <= {r.request_id for r in changed}
    assert not engine.has_unfinished(), "the three calls did not finish the requests"
    assert saw_chunk, "the run never planned a prompt chunk"
    assert saw_tree or policy == "adaserve", "adaserve_paper never planned a tree"
    ref = LLM(model=str(tiny_llama)).generate(PROMPTS, params)
    for r, want in zip(reqs, ref):
        assert r.output_token_ids == want.outputs[0].token_ids, "three calls != target alone"


def test_an_idle_scheduler_plans_nothing(tiny_llama) -> None:
    engine = _engine(tiny_llama, "incremental")
    plan = engine.scheduler.schedule()
    assert plan.idle and plan.is_empty
    out = engine.engine.run(plan)
    assert out.logits is None and out.forward_s == 0.0
    assert engine.scheduler.commit(plan, out) == []
