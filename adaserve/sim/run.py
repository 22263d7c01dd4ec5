"""`adaserve simulate`: replay a trace through the real scheduler on a virtual clock.

    adaserve simulate --trace T.json --policy adaserve,incremental --rps 1,2,4 \\
        --cost-model profile.json --acceptance accept.jsonl
    adaserve simulate --trace T.json --policy adaserve \\
        --cost-model roofline:llama-2-70b@a100-80gx4 --draft-cost-model llama-160m \\
        --acceptance param:alpha=0.7,decay=0.95

Same trace options and the same report as `adaserve bench` (result lines, per-request lines,
table, plot); result labels end in "(sim)" so real and simulated runs share a plot.
"""

from __future__ import annotations

import argparse
import datetime
import random
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from adaserve.bench.report import RequestRecord
from adaserve.bench.trace import BenchRequest
from adaserve.bench.workload import (
    add_workload_arguments,
    append_jsonl,
    append_requests,
    finish_report,
    load_trace_arg,
    one_line,
    prepare_point,
    result_line,
)
from adaserve.config import POLICIES, CacheConfig, SchedulerConfig
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.control.profile import DEFAULT_BUDGET_FACTOR
from adaserve.request_manager.request import Request, SamplingParams
from adaserve.request_manager.scheduler import Scheduler
from adaserve.sim.acceptance import AcceptanceModel, SyntheticDrafter, load_acceptance
from adaserve.sim.cost import (
    DEFAULT_EFFICIENCY,
    CostSpec,
    ForwardNoise,
    baseline_latency_ms,
    derive_sim_budget,
    load_cost,
)
from adaserve.sim.engine import SIM_VOCAB, SimEngine, VirtualClock

DEFAULT_MAX_MODEL_LEN = 8192
# KV of a simulated deployment whose cost model does not say (a measured profile).
DEFAULT_KV_TOKENS = 262_144
MAX_IDLE_STEPS = 1000


@dataclass(frozen=True)
class SimSetup:
    """Everything a simulated run needs besides the requests."""

    cost: CostSpec
    acceptance: AcceptanceModel | None  # None: only incremental can run
    sched: SchedulerConfig
    block_size: int = CacheConfig.block_size
    kv_tokens: int | None = None  # None: the cost model's, else DEFAULT_KV_TOKENS
    max_model_len: int = DEFAULT_MAX_MODEL_LEN
    prefix_caching: bool = True
    host_time: bool = False
    host_overhead_s: float = 0.0  # added after every iteration (the server's host time)
    noise: ForwardNoise | None = None
    seed: int = 0
    drafter: str = "auto"  # model | suffix | auto (model when a draft cost exists)
    # "queue": every request is served (the paper's systems); "slo": what `adaserve serve`
    # does by default, a request its SLO cannot be met for is refused at arrival (a 429).
    admission: str = "queue"


@dataclass
class SimRun:
    records: list[RequestRecord]
    iterations: int
    accepted_tokens: int
    tree_tokens: int
    decode_iterations: int
    preemptions: int
    max_forward_tokens: int
    max_blocks_used: int
    num_blocks: int
    wall_s: float
    drafter: str

    def counters(self) -> dict:
        """The server-metric deltas a real replay reports, for the same table."""
        it = self.decode_iterations
        return {
            "iterations": self.iterations,
            "decode_iterations": it,
            "mean_accepted_tokens_per_iteration": self.accepted_tokens / it if it else None,
            "tree_tokens": self.tree_tokens,
            "accepted_tokens": self.accepted_tokens,
            "preemptions": self.preemptions,
        }


def simulate(
    reqs: Sequence[BenchRequest],
    setup: SimSetup,
    progress: bool = False,
    desc: str = "sim",
    on_step: Callable[[Scheduler], None] | None = None,
) -> SimRun:
    """Run `reqs` (arriving at their send times) to completion; one record per request.

    `on_step(scheduler)` runs after every iteration (tests check invariants there)."""
    cfg = setup.sched
    clock = VirtualClock(setup.host_time)
    kv_tokens = setup.kv_tokens or setup.cost.target.kv_tokens or DEFAULT_KV_TOKENS
    num_blocks = max(1, kv_tokens // setup.block_size)
    use_model = setup.drafter == "model" or (
        setup.drafter == "auto" and setup.cost.draft is not None
    )
    if use_model and setup.cost.draft is None:
        raise ValueError("the model drafter needs a draft cost (--draft-cost-model)")
    engine = SimEngine(
        setup.cost.target,
        setup.cost.draft if use_model and cfg.speculative else None,
        num_blocks,
        setup.block_size,
        setup.max_model_len,
        setup.prefix_caching and setup.cost.target.backend == "torch",  # as the real engine
        clock,
        setup.noise,
        setup.seed,
    )
    rng = random.Random(setup.seed)
    drafter: SyntheticDrafter | str = "auto"
    if cfg.speculative:
        if setup.acceptance is None:
            raise ValueError(f"policy {cfg.policy} speculates: give --acceptance")
        drafter = SyntheticDrafter(engine, setup.acceptance, rng, costly=use_model)
    cost = setup.cost.target.scheduler_model(cfg.cost_forget)
    if cost is None:
        cost = ForwardCostModel(forget=cfg.cost_forget)
        cost.seed(engine.target.cost_points(max(cfg.budget, 64)))
    sched = Scheduler(cfg, engine, drafter, cost)
    pending = sorted(reqs, key=lambda r: r.send_time_s)
    live: list[tuple[BenchRequest, Request]] = []
    refused: list[RequestRecord] = []
    stats = SimRun([], 0, 0, 0, 0, 0, 0, 0, num_blocks, 0.0, getattr(drafter, "name", "none"))
    bar = tqdm(total=len(pending), desc=desc, unit="req", disable=not progress, leave=False)
    start, i, done, stuck, last = time.perf_counter(), 0, 0, 0, None
    while i < len(pending) or sched.has_unfinished():
        if not sched.has_unfinished():
            clock.jump_to(pending[i].send_time_s)
        now = clock()
        while i < len(pending) and pending[i].send_time_s <= now:
            why = (
                sched.admission.refusal(pending[i].slo_tpot_ms)
                if setup.admission == "slo"
                else None
            )
            if why is not None:
                refused.append(_refused(pending[i], why))
            else:
                live.append((pending[i], _add(sched, pending[i], i, rng)))
            i += 1
        plan = sched.schedule()  # the plan a real server would run, on the virtual clock
        changed = sched.commit(plan, engine.run(plan))
        if setup.host_overhead_s and sched.last_stats is not None and sched.last_stats is not last:
            clock.advance(setup.host_overhead_s)
        if on_step is not None:
            on_step(sched)
        st = sched.last_stats
        if st is None or st is last:
            stuck += 1
            if stuck > MAX_IDLE_STEPS:
                raise RuntimeError(
                    f"the scheduler made no progress in {stuck} iterations with "
                    f"{len(sched.waiting)} requests waiting; give the simulation more KV"
                )
        else:
            stuck, last = 0, st
            stats.iterations += 1
            stats.max_forward_tokens = max(stats.max_forward_tokens, st.num_tokens)
            if st.kind == "decode":
                stats.decode_iterations += 1
                stats.accepted_tokens += st.accepted_tokens
                stats.tree_tokens += st.tree_tokens
        used = engine.target.cache.allocator.num_used
        stats.max_blocks_used = max(stats.max_blocks_used, used)
        finished = sum(1 for r in changed if r.finished)
        if finished:
            done += finished
            bar.update(finished)
    bar.close()
    stats.wall_s = time.perf_counter() - start
    stats.preemptions = sched.num_preemptions
    stats.records = sorted([*(_record(b, r) for b, r in live), *refused], key=lambda r: r.index)
    return stats


def _add(sched: Scheduler, b: BenchRequest, i: int, rng: random.Random) -> Request:
    # The trace gives prompt text in another tokenizer: its length in words stands in.
    n = max(1, b.trace.input_length or len(b.trace.prompt.split()))
    n = min(n, sched.engine.max_model_len - b.max_tokens - 1)
    params = SamplingParams(
        max_tokens=b.max_tokens, temperature=0.0, ignore_eos=True, slo_tpot_ms=b.slo_tpot_ms
    )
    prompt = [rng.randrange(SIM_VOCAB) for _ in range(max(1, n))]
    req = Request(f"sim-{i}", prompt, params, arrival_time=b.send_time_s)
    sched.add(req)
    return req


def _refused(b: BenchRequest, why: str) -> RequestRecord:
    # As the bench records a real server's 429: sent, no tokens, counted as missed.
    return RequestRecord(
        index=b.trace.index,
        slo_category=b.slo_category,
        slo_tpot_ms=b.slo_tpot_ms,
        max_tokens=b.max_tokens,
        scheduled_s=b.send_time_s,
        sent_s=b.send_time_s,
        error=f"HTTP 429: {why}",
    )


def _record(b: BenchRequest, r: Request) -> RequestRecord:
    m = r.metrics
    return RequestRecord(
        index=b.trace.index,
        slo_category=b.slo_category,
        slo_tpot_ms=b.slo_tpot_ms,
        max_tokens=b.max_tokens,
        scheduled_s=b.send_time_s,
        sent_s=b.send_time_s,
        token_times_s=list(m.token_times),
        output_tokens=len(r.output_token_ids),
        end_s=m.finish_time,
        finish_reason=r.finish_reason,
        error=None if r.finished else "not finished",
        prompt_tokens=len(r.prompt_token_ids),
        # The objective the simulated server scheduled for (its default from the prompt).
        slo_ttft_ms=r.ttft_objective_ms,
    )


# ---------------------------------------------------------------------------- command line
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policy",
        default="adaserve",
        help=f"comma list of policies to simulate ({', '.join(POLICIES)})",
    )
    p.add_argument(
        "--cost-model",
        required=True,
        help="a profile JSON (`adaserve profile`, or a server's start-up profile), "
        "roofline:MODEL@GPU[xTP] (e.g. roofline:llama-2-70b@a100-80gx4), or a measured "
        "table table:TOKENS:MS,...@MODEL@GPU[xTP] (the roofline prices the context) or "
        "table:llama-3.1-70b-artifact / table:qwen2.5-32b-artifact",
    )
    p.add_argument(
        "--draft-cost-model",
        default=None,
        help="the draft model's cost: a profile JSON, roofline:..., or a model name run on one "
        "GPU of the target's kind (e.g. llama-160m); default: the profile's draft curve",
    )
    p.add_argument(
        "--acceptance",
        default=None,
        help="a --record-acceptance JSONL file, or param:alpha=A[,decay=D][,kappa=K]",
    )
    p.add_argument(
        "--drafter",
        choices=("auto", "model", "suffix"),
        default="auto",
        help="what the synthetic drafter costs like: a draft model (a forward per step) or the "
        "suffix index (microseconds); auto: model when a draft cost is known",
    )
    p.add_argument("--efficiency", type=float, default=DEFAULT_EFFICIENCY, help="roofline")
    p.add_argument("--budget", type=int, default=None, help="B (default: from the cost model)")
    p.add_argument(
        "--budget-factor",
        type=float,
        default=DEFAULT_BUDGET_FACTOR,
        help="B = largest count whose forward costs <= this x a 1-token forward",
    )
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument(
        "--kv-tokens", type=int, default=None, help="KV capacity (default: from the cost model)"
    )
    p.add_argument("--max-model-len", type=int, default=DEFAULT_MAX_MODEL_LEN)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument(
        "--host-time",
        action="store_true",
        help="count this machine's scheduling time too (only when simulating this machine)",
    )
    p.add_argument(
        "--host-overhead-ms",
        type=float,
        default=0.0,
        help="wall time per iteration outside model forwards, as a real server spends it "
        "streaming and scheduling (`adaserve bench` reports the server's own as "
        "server_metrics.mean_host_overhead_ms)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=None,
        help="log-normal sigma of forward times around the cost model (default: draw from "
        "the prediction errors a server measured, when `serve --record-cost-model` recorded "
        "the cost model; else none)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--admission",
        choices=("queue", "slo"),
        default="queue",
        help="queue: serve every request (the paper's systems); slo: refuse at arrival what "
        "the load cannot serve within its TPOT SLO, as `adaserve serve` does by default",
    )
    p.add_argument("--label-suffix", default=" (sim)", help="appended to the policy in labels")
    add_workload_arguments(p, simulated=True)


def setup_from_args(a: argparse.Namespace, policy: str) -> SimSetup:
    cost = load_cost(a.cost_model, a.draft_cost_model, a.efficiency)
    budget = a.budget if a.budget is not None else derive_sim_budget(cost.target, a.budget_factor)
    sched = SchedulerConfig(
        policy=policy,
        budget=budget,
        max_num_seqs=a.max_num_seqs,
        chunked_prefill=not a.no_chunked_prefill,
        t_spec_init_s=cost.target.curve(budget, 256, 8),
    )
    acceptance = load_acceptance(a.acceptance) if a.acceptance else None
    return SimSetup(
        cost,
        acceptance,
        sched,
        kv_tokens=a.kv_tokens,
        max_model_len=a.max_model_len,
        prefix_caching=not a.no_prefix_caching,
        host_time=a.host_time,
        host_overhead_s=a.host_overhead_ms / 1000.0,
        noise=ForwardNoise(a.noise) if a.noise is not None else cost.target.noise,
        seed=a.seed,
        drafter=a.drafter,
        admission=a.admission,
    )


def run(a: argparse.Namespace) -> int:
    policies = [p.strip() for p in a.policy.split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            raise ValueError(f"unknown policy {p!r}; one of {', '.join(POLICIES)}")
    trace = load_trace_arg(a)
    setups = {p: setup_from_args(a, p) for p in policies}
    first = next(iter(setups.values()))
    if a.baseline_latency_ms is None and a.profile is None:
        # Relative SLOs need the machine's baseline latency: the cost model's own.
        a.baseline_latency_ms = baseline_latency_ms(first.cost.target)
    print(
        f"cost model: {first.cost.target.name}; draft: "
        f"{first.cost.draft.name if first.cost.draft else 'none'}; B = {first.sched.budget}; "
        f"baseline latency {a.baseline_latency_ms or 0:.2f} ms; acceptance: "
        f"{first.acceptance.name if first.acceptance else 'none'}; forward-time noise: "
        f"{first.noise.describe() if first.noise else 'none'}",
        file=sys.stderr,
    )
    results = []
    for rps in a.rps or [None]:
        reqs = prepare_point(a, trace, rps)
        for policy, setup in setups.items():
            label = f"{policy}{a.label_suffix}"
            sim = simulate(reqs, setup, progress=not a.no_progress, desc=f"{label} @ {rps}")
            result = _result(a, trace, reqs, rps, label, sim, setup)
            append_jsonl(Path(a.out), [result])
            append_requests(a, result, sim.records)
            print(f"{one_line(result)} ({sim.wall_s:.1f} s to simulate)", flush=True)
            results.append(result)
    finish_report(a, results)
    return 0


def _result(a, trace, reqs, rps, label, sim: SimRun, setup: SimSetup) -> dict:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = result_line(
        a, trace, reqs, rps, label, None, setup.cost.target.name, sim.records, started
    )
    result["server_metrics"] = sim.counters()
    result["simulation"] = {
        "cost_model": setup.cost.target.name,
        "draft_cost_model": setup.cost.draft.name if setup.cost.draft else None,
        "acceptance": setup.acceptance.name if setup.acceptance else None,
        "drafter": sim.drafter,
        "budget": setup.sched.budget,
        "num_blocks": sim.num_blocks,
        "max_blocks_used": sim.max_blocks_used,
        "seed": setup.seed,
        "noise": setup.noise.describe() if setup.noise else "none",
        "host_time": setup.host_time,
        "host_overhead_ms": 1000.0 * setup.host_overhead_s,
        "admission": setup.admission,
        "wall_s": sim.wall_s,
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from adaserve.entry import standalone_main

    doc = __doc__.split("\n\n")[0]
    return standalone_main("adaserve simulate", doc, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
