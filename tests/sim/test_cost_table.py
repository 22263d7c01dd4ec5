"""`--cost-model table:...`: a measured verify-latency table, with the roofline's context term."""

from __future__ import annotations

import pytest

from adaserve.config import SchedulerConfig
from adaserve.sim.acceptance import ParametricAcceptance
from adaserve.sim.cost import (
    TABLE_PRESETS,
    TableCost,
    derive_sim_budget,
    load_cost,
    parse_roofline,
)
from adaserve.sim.run import SimSetup, simulate
from tests.sim.test_simulate import bench_requests


def test_the_table_interpolates_between_points_and_extends_its_ends() -> None:
    cost = load_cost("table:1:10,100:30,200:70@llama-2-7b@a100-80g").target
    assert isinstance(cost, TableCost)
    # At the points, in ms.
    assert cost.table_ms(1) == 10 and cost.table_ms(100) == 30 and cost.table_ms(200) == 70
    # Linear between them: halfway from 100 (30 ms) to 200 (70 ms) is 50 ms.
    assert cost.table_ms(150) == pytest.approx(50.0)
    assert cost.table_ms(50) == pytest.approx(10 + 49 * 20 / 99)
    # Beyond the last point the last segment's slope (0.4 ms/token) goes on.
    assert cost.table_ms(300) == pytest.approx(110.0)
    # Points may come in any order; a forward of no tokens is priced as one token.
    same = load_cost("table:200:70,1:10,100:30@llama-2-7b@a100-80g").target
    assert same.seconds(0, 0, 0) == cost.seconds(1, 0, 0) == pytest.approx(0.010)


def test_context_adds_the_rooflines_kv_read_and_attention_over_a_context_free_forward() -> None:
    cost = load_cost("table:llama-3.1-70b-artifact").target
    assert isinstance(cost, TableCost)
    roof = parse_roofline("llama-3.1-70b@a100-80gx4", 0.7)
    assert cost.kv_tokens == roof.kv_tokens
    # No context: the table itself (the artifact's 128 -> 55 ms, 1024 -> 205 ms).
    assert cost.seconds(128, 0, 0) == pytest.approx(0.055)
    assert cost.seconds(1024, 0, 0) == pytest.approx(0.205)
    # 8 sequences of 2,000 cached tokens, one new token each.
    ctx, pairs = 16_000, 8 * 2001
    extra = roof.seconds(8, ctx, pairs) - roof.seconds(8, 0, 0)
    # 16k tokens of Llama-3.1-70B KV are 5.2 GB, 1.3 GB per GPU: ~0.9 ms at 70% of 2 TB/s.
    assert 0.0007 < extra < 0.0012, extra
    assert cost.seconds(8, ctx, pairs) == pytest.approx(cost.table_ms(8) / 1000 + extra)
    assert cost.seconds(8, 2 * ctx, 2 * pairs) > cost.seconds(8, ctx, pairs)


@pytest.mark.parametrize("name", sorted(TABLE_PRESETS))
def test_the_artifact_presets_set_the_budget_where_forwards_get_expensive(name: str) -> None:
    cost = load_cost(f"table:{name}").target
    # The tables turn steep from the first points on: B stays far below the roofline's (218
    # for Llama-2-70B on 4 x A100) and above what one sequence needs.
    budget = derive_sim_budget(cost, 1.5)
    roofline = derive_sim_budget(load_cost("roofline:llama-3.1-70b@a100-80gx4").target, 1.5)
    assert 8 <= budget < roofline, (budget, roofline)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("table:1:10,128:55", "MODEL@GPU"),
        ("table:1:10,abc@llama-2-7b@a100-80g", "TOKENS:MS"),
        ("table:1:10@llama-2-7b@a100-80g", "at least two"),
        ("table:1:10,1:20@llama-2-7b@a100-80g", "distinct"),
        ("table:1:30,128:20@llama-2-7b@a100-80g", "not fall"),
        ("table:1:10,128:55@llama-2-7b@v100", "unknown GPU"),
    ],
)
def test_a_bad_table_says_what_to_fix(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_cost(spec)


def test_a_simulation_runs_on_a_table_with_a_roofline_draft() -> None:
    spec = load_cost("table:llama-3.1-70b-artifact", "llama-160m")
    assert spec.draft is not None and "llama-160m" in spec.draft.name
    sched = SchedulerConfig(policy="adaserve")
    setup = SimSetup(spec, ParametricAcceptance(0.7, 0.95), sched)
    run = simulate(bench_requests(6, 0.2, slo=80.0), setup)
    assert len(run.records) == 6 and all(r.output_tokens == 24 for r in run.records)
    assert run.accepted_tokens > run.decode_iterations, "the draft speculated and was accepted"
