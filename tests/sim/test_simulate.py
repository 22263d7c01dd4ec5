"""`adaserve simulate`: the real scheduler on a virtual clock obeys what the real one does."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from adaserve.bench.trace import BenchRequest, TraceRequest
from adaserve.config import SchedulerConfig
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.control.profile import LatencyPoint, Profile
from adaserve.request_manager.policies import SpecShape
from adaserve.sim.acceptance import (
    PRIOR_WEIGHT,
    ParametricAcceptance,
    RecordedAcceptance,
    load_acceptance,
)
from adaserve.sim.cost import (
    GPUS,
    MODELS,
    CostModel,
    CostSpec,
    ForwardNoise,
    ProfileCost,
    RooflineCost,
    baseline_latency_ms,
    derive_sim_budget,
    load_cost,
)
from adaserve.sim.engine import SimRunner, VirtualClock
from adaserve.sim.run import SimSetup, simulate


class ConstantCost(CostModel):
    """Every forward takes the same time, whatever it holds (closed-form TPOT)."""

    name = "constant"

    def __init__(self, seconds: float) -> None:
        self.s = seconds

    def seconds(self, tokens, context, pairs, silent=0, silent_pairs=0, tree_pairs=0) -> float:
        return self.s


class LinearCost(CostModel):
    name = "linear"

    def __init__(self, base_s: float = 0.020) -> None:
        self.base_s = base_s

    def seconds(self, tokens, context, pairs, silent=0, silent_pairs=0, tree_pairs=0) -> float:
        return self.base_s + 0.0005 * tokens + 1e-7 * context


def bench_requests(
    n: int, gap_s: float, prompt_words: int = 40, out: int = 24, slo: float | None = None
) -> list[BenchRequest]:
    reqs = []
    for i in range(n):
        t = TraceRequest(i, 1000 * i * gap_s, "w " * prompt_words, prompt_words, out, 0.0)
        reqs.append(BenchRequest(t, i * gap_s, out, slo))
    return reqs


def setup(policy: str, cost: CostModel, draft: CostModel | None = None, **kw) -> SimSetup:
    sched_kw = {k: kw.pop(k) for k in list(kw) if k in SchedulerConfig.__dataclass_fields__}
    sched = SchedulerConfig(policy=policy, **sched_kw)
    acc = kw.pop("acceptance", ParametricAcceptance(0.7, 0.95))
    return SimSetup(CostSpec(cost, draft), acc, sched, **kw)


def test_incremental_with_a_constant_cost_reproduces_closed_form_latency() -> None:
    c = 0.030
    # Alone: one forward prefills the 40-token prompt and samples the first token, then
    # every forward adds one token: TTFT = c, TPOT = c, end = arrival + max_tokens x c.
    alone = simulate(bench_requests(1, 0.0), setup("incremental", ConstantCost(c)))
    (r,) = alone.records
    assert r.ttft_s == pytest.approx(c, abs=1e-12)
    assert r.tpot_ms == pytest.approx(1000 * c, abs=1e-9)
    assert r.end_s == pytest.approx(24 * c, abs=1e-12)
    # Eight overlapping requests: prefill chunks ride in the running forwards (chunked
    # prefill), a forward costs c whatever it holds, so every request still has TPOT = c.
    many = simulate(bench_requests(8, 0.05), setup("incremental", ConstantCost(c)))
    assert all(r.completed and r.output_tokens == 24 for r in many.records)
    assert [r.tpot_ms for r in many.records] == pytest.approx([1000 * c] * 8, abs=1e-9)


def test_host_overhead_is_added_per_iteration_and_seen_by_the_scheduler() -> None:
    c, h = 0.030, 0.012
    # Each iteration lasts its forward plus the server's host time: TPOT = c + h.
    run = simulate(bench_requests(1, 0.0), setup("incremental", ConstantCost(c), host_overhead_s=h))
    (r,) = run.records
    assert r.tpot_ms == pytest.approx(1000 * (c + h), abs=1e-9)
    seen = []
    simulate(
        bench_requests(2, 0.1),
        setup("incremental", ConstantCost(c), host_overhead_s=h),
        on_step=lambda sched: seen.append(sched.admission.host_s),
    )
    assert seen[-1] == pytest.approx(h), "the scheduler's own host-time estimate"


@pytest.mark.parametrize("policy", ["adaserve", "adaserve_paper", "global_greedy", "specinfer"])
def test_the_budget_and_the_kv_pool_bind_as_in_the_real_engine(policy: str) -> None:
    # 12 requests x (40 prompt + 48 output) tokens need 66 blocks of 16; the pool has 24,
    # so admission waits and decoding preempts, exactly through the real scheduler code.
    budget = 12
    s = setup(
        policy,
        LinearCost(),
        LinearCost(0.001),  # a draft step costs 1/20 of a target forward
        budget=budget,
        kv_tokens=24 * 16,
        drafter="model",
    )
    seen = {"decode": 0, "max_used": 0}

    def check(sched) -> None:
        st = sched.last_stats
        alloc = sched.engine.target.cache.allocator
        seen["max_used"] = max(seen["max_used"], alloc.num_used)
        assert alloc.num_used <= sched.engine.target.cache.num_blocks
        if st is not None and st.kind == "decode":
            seen["decode"] += 1
            if policy == "specinfer":  # budget-unaware by design: its fixed tree per request
                e = SchedulerConfig().specinfer_expansion
                tree = SpecShape(len(e), max(e), e).max_nodes
                assert st.num_tokens <= st.num_requests * tree
            else:
                assert st.num_tokens <= max(budget, st.num_requests), "verified more than B"

    run = simulate(bench_requests(12, 0.01, out=48), s, on_step=check)
    assert all(r.completed and r.output_tokens == 48 for r in run.records)
    assert run.preemptions > 0, "the small pool never forced a preemption"
    assert seen["max_used"] > 16, "the pool was never nearly full"
    assert run.accepted_tokens > 0, f"{policy} accepted nothing"


def test_only_adaserve_verifies_past_b_and_never_past_its_ceiling() -> None:
    # Tree tokens cost 0.5 ms on a 20 ms forward and the drafter's chains are usually right:
    # nodes pay, so the controlled policy takes more than B where its ceiling lets it; the
    # published algorithm and the greedy baselines stay within B.
    budget, ceiling = 8, 24
    most: dict[str, int] = {}
    for policy in ("adaserve", "adaserve_paper", "global_greedy"):
        s = setup(
            policy,
            LinearCost(),
            budget=budget,
            budget_ceiling=ceiling,
            drafter="suffix",
            acceptance=ParametricAcceptance(0.9, 0.98),
        )
        seen = [0]

        limit = ceiling if policy == "adaserve" else budget

        def check(sched, seen=seen, limit=limit) -> None:
            st = sched.last_stats
            if st is not None and st.kind == "decode":
                seen[0] = max(seen[0], st.num_tokens)
                assert st.num_tokens <= max(limit, st.num_requests), "verified past the limit"

        run = simulate(bench_requests(6, 0.01, out=48), s, on_step=check)
        assert all(r.completed and r.output_tokens == 48 for r in run.records)
        most[policy] = seen[0]
    assert most["adaserve"] > budget, f"the ceiling was never used: {most}"
    assert most["adaserve_paper"] <= budget and most["global_greedy"] <= budget, most


def test_simulate_gives_adaserve_the_servers_ceiling_unless_b_is_set() -> None:
    from adaserve.sim.run import add_arguments, setup_from_args

    def sched(*extra: str) -> SchedulerConfig:
        p = argparse.ArgumentParser()
        add_arguments(p)
        a = p.parse_args(
            ["--trace", "t.json", "--cost-model", "table:qwen2.5-32b-artifact", *extra]
        )
        return setup_from_args(a, "adaserve").sched

    cost = load_cost("table:qwen2.5-32b-artifact", None)
    default = sched()
    assert default.budget == derive_sim_budget(cost.target, 1.5)
    assert default.budget_ceiling == derive_sim_budget(cost.target, 6.0) > default.budget
    assert sched("--ceiling-factor", "3").budget_ceiling == derive_sim_budget(cost.target, 3.0)
    explicit = sched("--budget", "40")
    assert explicit.budget_ceiling is None and explicit.selection_budget == 40


def test_a_seed_makes_a_run_repeatable() -> None:
    def once(seed: int) -> list[list[float]]:
        s = setup("adaserve", LinearCost(), budget=16, seed=seed, drafter="suffix")
        return [r.token_times_s for r in simulate(bench_requests(6, 0.02), s).records]

    assert once(1) == once(1)
    assert once(1) != once(2)


def test_parametric_acceptance_accepts_at_its_rate() -> None:
    # One request, sequence policy with 1-token chains: each iteration verifies the root
    # and one drafted child, which is right with probability E[q] = alpha.
    alpha = 0.8
    s = setup(
        "sequence",
        LinearCost(),
        gamma=1,
        acceptance=ParametricAcceptance(alpha, 1.0, 4.0),
        drafter="suffix",
    )
    run = simulate(bench_requests(1, 0.0, out=600), s)
    rate = run.accepted_tokens / run.tree_tokens
    # ~330 trials: binomial sd ~0.022
    assert abs(rate - alpha) < 0.08, rate
    assert ParametricAcceptance(alpha, 0.5).expected_acceptance(2, random.Random(0)) == (
        pytest.approx(alpha * 0.5, abs=0.03)
    )


def test_recorded_acceptance_follows_the_log(tmp_path: Path) -> None:
    log = tmp_path / "acc.jsonl"
    rows = []
    # Root 0 with two children (q 0.9 and 0.05); child 1 has a child (q 0.5).
    for accepted in ([1, 3], [1], [1], []):
        rows.append({"p": [-1, 0, 0, 1], "q": [1.0, 0.9, 0.05, 0.5], "v": [1, 3], "a": accepted})
    log.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    model = load_acceptance(str(log))
    assert isinstance(model, RecordedAcceptance) and model.num_trees == 4
    # Depth 1, q 0.9: accepted 3 of 4, smoothed towards its mean q with PRIOR_WEIGHT.
    expect = (3 + PRIOR_WEIGHT * 0.9) / (4 + PRIOR_WEIGHT)
    assert model.p_correct(1, 0.9) == pytest.approx(expect)
    # Depth 2 was tested 3 times (its parent accepted 3 times) and accepted once.
    assert model.p_correct(2, 0.5) == pytest.approx((1 + PRIOR_WEIGHT * 0.5) / (3 + PRIOR_WEIGHT))
    # q by sibling rank: depth 1 rank 0 is always 0.9, rank 1 always 0.05.
    assert model.child_probs(1, 2, random.Random(0)) == [0.9, 0.05]
    with pytest.raises(ValueError, match="not a recorded tree"):
        (tmp_path / "bad.jsonl").write_text('{"x": 1}\n')
        load_acceptance(str(tmp_path / "bad.jsonl"))
    with pytest.raises(ValueError, match="param:alpha"):
        load_acceptance("param:beta=2")


def test_a_real_run_records_acceptance_the_simulator_reads(tiny_llama, tmp_path: Path) -> None:
    from adaserve import LLM, SamplingParams

    log = tmp_path / "acc.jsonl"
    llm = LLM(
        model=str(tiny_llama), policy="adaserve_paper", drafter="suffix", record_acceptance=log
    )
    prompt = list(range(5, 45)) * 3  # repeats: the suffix index has matches
    llm.generate([prompt], SamplingParams(max_tokens=48, temperature=0.0))
    llm.llm_engine.scheduler.acceptance_log.flush()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines, "no verified tree was recorded"
    for row in lines:
        assert set(row["a"]) <= set(row["v"]), "an accepted node that was not verified"
        # The accepted nodes form one path from the root.
        for v in row["a"]:
            assert row["p"][v] == 0 or row["p"][v] in row["a"]
    model = RecordedAcceptance(log)
    s = setup("adaserve_paper", LinearCost(), acceptance=model, drafter="suffix")
    run = simulate(bench_requests(3, 0.05), s)
    assert all(r.completed for r in run.records)


def test_a_servers_fitted_cost_model_is_a_profile_the_simulator_reads(
    tiny_llama, tmp_path: Path
) -> None:
    from adaserve import LLM, SamplingParams
    from adaserve.request_manager.control.profile import record_cost_model

    llm = LLM(model=str(tiny_llama), policy="incremental")
    llm.generate([list(range(5, 60))] * 4, SamplingParams(max_tokens=16, temperature=0.0))
    fitted = llm.llm_engine.scheduler.cost
    assert fitted is not None and fitted.num_observations > 0
    path = record_cost_model(llm.llm_engine.engine, fitted, 16, tmp_path / "served.json")
    loaded = load_cost(str(path)).target
    for tokens, context in ((1, 50), (4, 300), (16, 2000), (40, 100)):
        assert loaded.seconds(tokens, context, 0) == pytest.approx(
            fitted.predict(tokens, context), rel=1e-9
        ), f"T({tokens}, {context}) changed on the way"
    assert Profile.load(path).t_spec_s(16) > 0, "not a usable profile"
    n, _, sigma = fitted.prediction_error()
    assert n > 0, "the server scored none of its forwards against the prediction"
    noise = load_cost(str(path)).target.noise
    assert noise is not None and noise.sigma == pytest.approx(sigma), "noise not recorded"
    assert dict(noise.quantiles) == pytest.approx(dict(fitted.error_quantiles()))
    run = simulate(bench_requests(3, 0.05), SimSetup(load_cost(str(path)), None, SchedulerConfig()))
    assert all(r.completed for r in run.records)


def test_the_simulated_scheduler_starts_from_the_profiles_cost_model(tmp_path: Path) -> None:
    # A server given a profile (or its cached start-up profile, which the last server
    # refreshed) starts from its fitted coefficients, long-context slopes included; a
    # simulation of it must too, not from a start-up curve measured at one short context.
    g = {1: 0.010, 2: 0.012, 4: 0.015, 8: 0.020, 16: 0.030, 32: 0.050, 64: 0.090}
    model = ForwardCostModel.from_coefficients(g, 2e-5)
    from adaserve.exec.timing import NUM_SEQS, split_tokens

    # A point's context is per sequence; its n tokens are spread over up to NUM_SEQS of them.
    points = tuple(
        LatencyPoint(n, 256, 1000 * model.predict(n, 256 * len(split_tokens(n, NUM_SEQS))))
        for n in g
    )
    prof = Profile("cpu", "m", None, points, (), 16, 1.5, 256, 20.0)
    path = replace(prof, cost_model=json.loads(model.to_json())).save(tmp_path / "p.json")
    first = []
    simulate(
        bench_requests(2, 0.05),
        SimSetup(load_cost(str(path)), None, SchedulerConfig()),
        on_step=lambda sched: first or first.append(sched.cost.predict(4, 3000)),
    )
    assert first[0] == pytest.approx(model.predict(4, 3000), rel=0.02), "not the profile's"
    assert load_cost("roofline:llama-2-7b@a100-80g").target.scheduler_model(0.98) is None


class TreeCost(LinearCost):
    """LinearCost plus a price per tree pair: what a verified tree's nodes pay to attend."""

    name = "linear+tree"
    tree_pair_s = 3e-6

    def seconds(self, tokens, context, pairs, silent=0, silent_pairs=0, tree_pairs=0) -> float:
        return super().seconds(tokens, context, pairs) + self.tree_pair_s * tree_pairs


def test_a_simulated_server_measures_what_a_tree_pair_costs_when_it_speculates() -> None:
    # As a real server does at start-up (`timing.tree_pair_cost`): a tree on one sequence
    # against the cost curve's shape of as many tokens; the difference is h's prior.
    g = {1: 0.010, 4: 0.012, 16: 0.020}
    model = ForwardCostModel.from_coefficients(g, 1e-5, tree_pair_s=2e-6)
    runner = SimRunner(ProfileCost(model, "p"), 64, 4, VirtualClock())
    assert runner.tree_pair_cost() == pytest.approx(2e-6)
    for policy, h in (("adaserve", TreeCost.tree_pair_s), ("incremental", 0.0)):
        seen: list[float] = []

        def first_h(sched, seen=seen) -> None:
            seen or seen.append(sched.cost.coefficients()["tree_pair_s"])

        simulate(bench_requests(2, 0.05), setup(policy, TreeCost()), on_step=first_h)
        assert seen[0] == pytest.approx(h), f"{policy}: h {seen[0]}, measured {h}"


def test_a_prompt_chunk_costs_what_the_profile_says_silent_rows_cost() -> None:
    # Rows without logits (prompt chunks, padding) cost b less each, as on the real server.
    from adaserve.exec.batch import SequenceBatchBuilder

    g = {1: 0.010, 4: 0.012, 16: 0.020, 32: 0.030}
    model = ForwardCostModel.from_coefficients(g, 0.0, silent_row_s=0.0002)
    clock = VirtualClock()
    runner = SimRunner(ProfileCost(model, "p", "ggml"), 64, 4, clock)
    spent = {}
    for logits in ("all", "last"):
        builder = SequenceBatchBuilder()
        builder.add([5] * 4, [0, 1, 2, 3], 4, [], logits="all")  # four decoding rows
        builder.add([6] * 16, list(range(16)), 16, [], logits=logits)  # a prompt chunk
        start = clock()
        runner.forward(builder.batch)
        spent[logits] = clock() - start
    assert spent["all"] == pytest.approx(model.predict(20, 0))
    assert spent["all"] - spent["last"] == pytest.approx(15 * 0.0002)


def test_recorded_noise_is_drawn_with_its_shape_centered_on_its_median() -> None:
    # A server's forwards: mostly within a few percent, 2% of them hiccups at 2x. Drawn from
    # its quantiles, the hiccups stay 2% (a log-normal of the same sigma would spread them).
    rng = random.Random(3)
    errors = sorted(rng.gauss(0.01, 0.02) if rng.random() > 0.02 else 0.69 for _ in range(20000))
    levels = (0.0, 0.01, 0.05, 0.25, 0.5, 0.75, 0.95, 0.97, 0.975, 0.99, 1.0)
    noise = ForwardNoise(0.1, tuple((q, errors[round(q * (len(errors) - 1))]) for q in levels))
    draws = sorted(noise.factor(rng) for _ in range(20000))
    assert draws[10000] == pytest.approx(1.0, abs=0.005), "centered on the median"
    slow = sum(d > 1.5 for d in draws) / len(draws)
    assert 0.015 < slow < 0.035, f"{slow:.3f} of forwards were hiccups, recorded 0.02"
    lognormal = ForwardNoise(0.1)
    assert sum(lognormal.factor(rng) > 1.5 for _ in range(20000)) < 20, "no hiccups there"
    assert ForwardNoise().factor(rng) == 1.0


@pytest.mark.parametrize("backend", ["torch", "ggml"])
def test_a_profile_simulates_what_its_backend_does(tmp_path: Path, backend: str) -> None:
    # A ggml (llama.cpp) server pads no forward; a simulation from its profile must not
    # either, or it would simulate a different server. Both cache prefixes.
    points = tuple(LatencyPoint(n, 256, 5.0 + 2.0 * n) for n in (1, 2, 3, 4, 6, 8, 12, 16, 32, 64))
    prof = Profile("cpu", "m", None, points, (), 16, 2.0, 256, 40.0, backend=backend)
    path = prof.save(tmp_path / "p.json")
    assert Profile.load(path).backend == backend
    cost = load_cost(str(path))
    assert cost.target.backend == backend
    reqs = bench_requests(3, 0.05)
    seen = []

    def check(sched) -> None:
        seen.append((sched.engine.target.supports_padding, sched.engine.target_prefix))

    run = simulate(reqs, SimSetup(cost, None, SchedulerConfig(policy="incremental")), on_step=check)
    assert all(r.completed for r in run.records)
    padding, prefix = seen[-1]
    assert padding is (backend == "torch")
    assert prefix is not None, "prefix caching as on the real engine"


def test_roofline_matches_the_hardware_it_names() -> None:
    a100 = GPUS["a100-80g"]
    cost = RooflineCost(MODELS["llama-2-7b"], a100)
    # 13.5 GB of weights at 2 TB/s (70% efficiency) plus launches: about 10 ms (the paper
    # measured a 12.5 ms baseline for Llama-2-7B on an A100).
    one = cost.curve(1, 256, 8)
    assert 0.008 < one < 0.014
    assert cost.curve(64, 256, 8) < 1.1 * one, "memory bound: 64 tokens cost ~1 token"
    assert cost.curve(1024, 256, 8) > 2.5 * one, "compute bound at 1024 tokens"
    # B from the curve sits near peak FLOPs / bandwidth (312 T / 2 TB/s = 156 for fp16).
    assert 100 <= derive_sim_budget(cost, 1.5) <= 400
    assert 8 < baseline_latency_ms(cost) < 14
    # 70B needs 4 GPUs: tensor parallelism divides the time.
    seventy = load_cost("roofline:llama-2-70b@a100-80gx4").target
    assert seventy.kv_tokens > 100_000
    with pytest.raises(ValueError, match="does not fit"):
        load_cost("roofline:llama-2-70b@a100-80g")
    with pytest.raises(ValueError, match="unknown GPU"):
        load_cost("roofline:llama-2-7b@v100")


def write_mixed_trace(path: Path, n: int = 12) -> None:
    """n requests 250 ms apart, 30-token prompts, 32 output tokens, the three SLO classes."""
    trace = [
        {
            "emission_time_ms": 250.0 * i,
            "prompt": "word " * 30,
            "input_length": 30,
            "output_length": 32,
            "slo_ratio": [1.2, -50.0, -150.0][i % 3],
        }
        for i in range(n)
    ]
    path.write_text(json.dumps(trace))


def test_simulate_cli_writes_the_bench_report(tmp_path: Path, capsys) -> None:
    from adaserve.cli import main

    write_mixed_trace(tmp_path / "t.json")
    target = tuple(LatencyPoint(t, 256, 20.0 + 0.5 * t) for t in (1, 2, 4, 8, 16, 32, 64))
    draft = tuple(LatencyPoint(t, 256, 1.0 + 0.05 * t) for t in (1, 2, 4, 8, 16, 32, 64))
    prof = Profile("cpu", "m", "d", target, draft, 16, 1.5, 256, 20.5)
    # As a server records it: with how far its forwards strayed from the prediction.
    fitted = json.loads(prof.forward_cost_model().to_json())
    fitted["log_error"] = {
        "forwards": 500,
        "mean": 0.01,
        "sigma": 0.07,
        "quantiles": [[0.0, -0.2], [0.5, 0.0], [1.0, 0.3]],
    }
    replace(prof, cost_model=fitted).save(tmp_path / "p.json")
    out = tmp_path / "r.jsonl"
    rc = main(
        [
            "simulate",
            "--trace",
            str(tmp_path / "t.json"),
            "--policy",
            "incremental,adaserve",
            "--cost-model",
            str(tmp_path / "p.json"),
            "--acceptance",
            "param:alpha=0.6",
            "--rps",
            "2,8",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    results = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["label"], r["rps"]) for r in results] == [
        ("incremental (sim)", 2.0),
        ("adaserve (sim)", 2.0),
        ("incremental (sim)", 8.0),
        ("adaserve (sim)", 8.0),
    ]
    for r in results:
        assert r["requests"] == 12 and r["failed"] == 0
        assert set(r["per_category"]) == {"ratio=1.2", "abs=50ms", "abs=150ms"}
        assert r["simulation"]["noise"] == "measured (sigma 0.070, 3 quantiles)", "default"
        assert r["simulation"]["drafter"].startswith(
            "synthetic draft model" if r["label"].startswith("adaserve") else "none"
        )
    # The baseline latency (relative SLOs) came from the profile's own cost model.
    assert results[0]["options"]["baseline_latency_ms"] == pytest.approx(
        baseline_latency_ms(load_cost(str(tmp_path / "p.json")).target)
    )
    assert "| adaserve (sim) |" in capsys.readouterr().out
    per_request = (tmp_path / "r.requests.jsonl").read_text().splitlines()
    assert len(per_request) == 48


def test_simulate_records_each_points_iteration_timeline(tmp_path: Path, capsys) -> None:
    """--record-iterations: the simulated server's timeline, one file per point, in the
    server's format; it accounts for every prompt token and every token the report counts."""
    from adaserve.cli import main
    from adaserve.sim.run import timeline_path

    write_mixed_trace(tmp_path / "t.json")
    out, timeline = tmp_path / "r.jsonl", tmp_path / "it.jsonl"
    argv = ["simulate", "--trace", str(tmp_path / "t.json"), "--policy", "incremental,adaserve"]
    argv += ["--cost-model", "roofline:llama-2-7b@a100-80g", "--acceptance", "param:alpha=0.6"]
    argv += ["--rps", "2,8", "--out", str(out), "--no-progress"]
    assert main([*argv, "--record-iterations", str(timeline)]) == 0
    assert timeline_path(str(timeline), "adaserve", 0.5) == str(
        tmp_path / "it.adaserve.rps0.5.jsonl"
    )
    assert not timeline.exists(), "four points: four files, none under the plain name"
    for result in (json.loads(x) for x in out.read_text().splitlines()):
        policy = result["label"].removesuffix(" (sim)")
        rows = [json.loads(x) for x in open(timeline_path(str(timeline), policy, result["rps"]))]
        prompt: dict[str, int] = {}
        for row in rows:
            for rid, n in row["prompt_tokens"].items():
                prompt[rid] = prompt.get(rid, 0) + n
            assert row["forward_tokens"] == row["decode_rows"] + row["tree_tokens"] + sum(
                row["prompt_tokens"].values()
            )
        assert sorted(prompt.values()) == [30] * 12
        assert sum(row["emitted"] for row in rows) == result["output_tokens"] == 12 * 32
        assert [row["t"] for row in rows] == sorted(row["t"] for row in rows)
        assert rows[-1]["t"] <= result["duration_s"], "virtual seconds, not the host's"
    assert main([*argv, "--record-iterations", str(timeline), "--replicas", "2"]) != 0
    assert "records one replica's timeline; drop --replicas" in capsys.readouterr().err


def test_the_server_s_admission_margin_and_row_deferral_are_simulate_flags() -> None:
    import argparse

    from adaserve.sim.run import add_arguments, setup_from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    base = ["--trace", "t.json", "--policy", "adaserve"]
    base += ["--cost-model", "roofline:llama-2-70b@a100-80gx4"]
    default = setup_from_args(p.parse_args(base), "adaserve").sched
    assert default.slo_headroom == SchedulerConfig().slo_headroom and default.slo_defer_rows
    set_ = p.parse_args([*base, "--slo-headroom", "0.85", "--no-slo-defer-rows"])
    sched = setup_from_args(set_, "adaserve").sched
    assert sched.slo_headroom == 0.85, "--slo-headroom did not reach the scheduler"
    assert not sched.slo_defer_rows, "--no-slo-defer-rows did not reach the scheduler"
