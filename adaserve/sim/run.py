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
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

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
from adaserve.cluster.router import ROUTERS
from adaserve.config import POLICIES, SchedulerConfig
from adaserve.request_manager.control.profile import CEILING_FACTOR, DEFAULT_BUDGET_FACTOR
from adaserve.sim.acceptance import load_acceptance
from adaserve.sim.cost import (
    DEFAULT_EFFICIENCY,
    ForwardNoise,
    baseline_latency_ms,
    derive_sim_budget,
    load_cost,
)
from adaserve.sim.loop import DEFAULT_MAX_MODEL_LEN, SimRun, SimSetup, simulate

__all__ = ["SimRun", "SimSetup", "add_arguments", "main", "run", "simulate"]


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
    p.add_argument(
        "--ceiling-factor",
        type=float,
        default=CEILING_FACTOR,
        help="policy adaserve's budget ceiling by the same rule (what `adaserve serve` "
        "derives from its profile; with --budget, the ceiling is B, as on the server)",
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
    p.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="simulate N replicas of this server behind a router (capacity planning)",
    )
    p.add_argument(
        "--router",
        default="round_robin",
        help=f"comma list of routers to compare ({', '.join(ROUTERS)}); each gets its own "
        "result line per policy and rate",
    )
    p.add_argument(
        "--router-stats-period",
        type=float,
        default=0.0,
        help="seconds between the replicas' stats refreshes the router ranks by (0: fresh "
        "at every arrival); in between it counts what it routed as reservations",
    )
    p.add_argument(
        "--no-slo-defer-rows",
        action="store_true",
        help="keep every running stream in every iteration (the server's --no-slo-defer-rows): "
        "by default a stream far ahead of its pace sits out an iteration a tighter one needs",
    )
    p.add_argument(
        "--slo-headroom",
        type=float,
        default=SchedulerConfig.slo_headroom,
        help="with --admission slo: admit while the predicted TPOT and first token are within "
        "this share of their objectives (the server's --slo-headroom)",
    )
    p.add_argument(
        "--admission-best-effort",
        type=int,
        default=SchedulerConfig.admission_best_effort,
        metavar="N",
        help="with --admission slo: serve a request it still refuses (its TPOT once its hold "
        "runs out, its first token, its work) best effort, while fewer than N are (the "
        "server's --admission-best-effort; 0 refuses it)",
    )
    p.add_argument(
        "--admission-best-effort-wait",
        type=float,
        default=SchedulerConfig.admission_best_effort_wait,
        metavar="FACTOR",
        help="serve best effort only a request whose first token, its prompt last, is "
        "predicted within FACTOR x its TTFT objective (the server's flag)",
    )
    p.add_argument(
        "--find-rate",
        type=float,
        default=None,
        metavar="ATTAINMENT",
        help="capacity planning: for each policy and router, search the highest request rate "
        "between the lowest and highest --rps whose SLO attainment (first token counted) is "
        ">= ATTAINMENT (e.g. 0.95), by bisection; every probe is a result line, and a table of "
        "the rates found ends the run",
    )
    p.add_argument(
        "--rate-tolerance",
        type=float,
        default=0.05,
        help="with --find-rate: stop when the highest rate that met the target and the lowest "
        "that missed it are within this fraction of each other",
    )
    p.add_argument(
        "--rate-ceiling",
        type=float,
        default=None,
        metavar="ATTAINMENT",
        help="capacity planning: the rate no router can sustain at ATTAINMENT on --replicas "
        "replicas. One replica serves the cheapest ATTAINMENT share of the trace's requests "
        "(fewest prompt plus output tokens), SLOs dropped and every request queued, offered at "
        "the highest --rps (it must keep the replica backlogged); the requests it completes a "
        "second while backlogged, x replicas / ATTAINMENT, is the ceiling. A second line keeps "
        "the SLOs (what a replica given the whole mix completes while pacing it)",
    )
    p.add_argument(
        "--record-iterations",
        default=None,
        metavar="FILE",
        help="the simulated server's iteration timeline, as `adaserve serve --record-iterations` "
        "writes it (virtual seconds), to set beside a real server's: FILE for one point, else "
        "one file per point (FILE's name with .POLICY.rpsRATE before its suffix); one replica",
    )
    p.add_argument("--label-suffix", default=" (sim)", help="appended to the policy in labels")
    add_workload_arguments(p, simulated=True)


def timeline_path(path: str, policy: str, rps: float | None) -> str:
    """One point's timeline file among many: FILE's name with .POLICY.rpsRATE before its
    suffix (`it.jsonl` -> `it.adaserve.rps0.5.jsonl`)."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.{policy}.rps{rps if rps is not None else 'trace'}{p.suffix}"))


def setup_from_args(a: argparse.Namespace, policy: str) -> SimSetup:
    cost = load_cost(a.cost_model, a.draft_cost_model, a.efficiency)
    budget = a.budget if a.budget is not None else derive_sim_budget(cost.target, a.budget_factor)
    # An explicit B is B for every policy; otherwise adaserve's ceiling by the server's rule.
    ceiling = None if a.budget is not None else derive_sim_budget(cost.target, a.ceiling_factor)
    sched = SchedulerConfig(
        policy=policy,
        budget=budget,
        budget_ceiling=ceiling,
        max_num_seqs=a.max_num_seqs,
        chunked_prefill=not a.no_chunked_prefill,
        t_spec_init_s=cost.target.curve(budget, 256, 8),
        slo_defer_rows=not a.no_slo_defer_rows,
        slo_headroom=a.slo_headroom,
        admission_best_effort=a.admission_best_effort,
        admission_best_effort_wait=a.admission_best_effort_wait,
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
        replicas=a.replicas,
        router_stats_period_s=a.router_stats_period,
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
        f"{first.cost.draft.name if first.cost.draft else 'none'}; B = {first.sched.budget} "
        f"(adaserve's ceiling {first.sched.budget_ceiling or first.sched.budget}); "
        f"baseline latency {a.baseline_latency_ms or 0:.2f} ms; acceptance: "
        f"{first.acceptance.name if first.acceptance else 'none'}; forward-time noise: "
        f"{first.noise.describe() if first.noise else 'none'}",
        file=sys.stderr,
    )
    routers = [r.strip() for r in a.router.split(",") if r.strip()]
    for r in routers:
        if r not in ROUTERS:
            raise ValueError(f"unknown router {r!r}; one of {', '.join(ROUTERS)}")
    results = []
    if a.record_iterations and a.replicas > 1:
        raise ValueError("--record-iterations records one replica's timeline; drop --replicas")
    many_points = a.find_rate is not None or len(a.rps or [None]) * len(policies) * len(routers) > 1

    def point(rps: float | None, policy: str, router: str) -> dict:
        setup = replace(setups[policy], router=router)
        if a.record_iterations:
            path = timeline_path(a.record_iterations, policy, rps) if many_points else None
            sched = replace(setup.sched, record_iterations=path or a.record_iterations)
            setup = replace(setup, sched=sched)
        # Labels name the router only when there is a choice of one.
        via = f" x{setup.replicas} {router}" if setup.replicas > 1 or len(routers) > 1 else ""
        label = f"{policy}{via}{a.label_suffix}"
        reqs = prepare_point(a, trace, rps)
        sim = simulate(reqs, setup, progress=not a.no_progress, desc=f"{label} @ {rps}")
        result = _result(a, trace, reqs, rps, label, sim, setup)
        append_jsonl(Path(a.out), [result])
        append_requests(a, result, sim.records)
        print(f"{one_line(result)} ({sim.wall_s:.1f} s to simulate)", flush=True)
        results.append(result)
        return result

    if a.rate_ceiling is not None:
        return _rate_ceilings(a, trace, setups)
    if a.find_rate is not None:
        return _capacity(a, policies, routers, point)
    for rps in a.rps or [None]:
        for policy, router in ((p, r) for p in policies for r in routers):
            point(rps, policy, router)
    finish_report(a, results)
    return 0


@dataclass(frozen=True)
class RateFound:
    """What a capacity search found: `met` the highest rate probed whose attainment reached
    the target (None: not even the lowest), `missed` the lowest above it that fell short (None:
    not even the highest did); `probes` every (rate, attainment) in the order run."""

    met: float | None
    missed: float | None
    probes: tuple[tuple[float, float], ...]


def find_rate(
    attainment_at: Callable[[float], float],
    target: float,
    low: float,
    high: float,
    tolerance: float = 0.05,
) -> RateFound:
    """The highest request rate in [low, high] whose attainment is >= `target`, by bisection
    (geometric: rates span orders of magnitude) until the rate that met and the one that missed
    are within `tolerance` of each other. Attainment falls with the rate only on average (a
    simulation's noise, a trace's bursts): what is returned is a bracket the probes saw, not a
    proof that every rate under `met` meets the target."""
    if not 0 < low <= high:
        raise ValueError(f"rates to search need 0 < low <= high, got {low} and {high}")
    if not 0 < target <= 1:
        raise ValueError(f"the target attainment is a fraction in (0, 1], got {target}")
    if tolerance <= 0:
        raise ValueError(f"--rate-tolerance must be > 0, got {tolerance}")
    probes: list[tuple[float, float]] = []

    def meets(rps: float) -> bool:
        att = attainment_at(rps)
        probes.append((rps, att))
        return att >= target

    if not meets(low):
        return RateFound(None, low, tuple(probes))
    if high == low or meets(high):
        return RateFound(high if high > low else low, None, tuple(probes))
    met, missed = low, high
    while missed > met * (1.0 + tolerance):
        mid = float(f"{math.sqrt(met * missed):.3g}")  # 3 significant figures
        if not met < mid < missed:
            break
        if meets(mid):
            met = mid
        else:
            missed = mid
    return RateFound(met, missed, tuple(probes))


def _capacity(
    a: argparse.Namespace,
    policies: Sequence[str],
    routers: Sequence[str],
    point: Callable[[float, str, str], dict],
) -> int:
    if not a.rps:
        raise ValueError("--find-rate searches between the lowest and highest --rps: give both")
    low, high = min(a.rps), max(a.rps)

    def attainment(policy: str, router: str) -> Callable[[float], float]:
        return lambda rps: point(rps, policy, router)["slo_attainment"] or 0.0

    rows = []
    for policy, router in ((p, r) for p in policies for r in routers):
        found = find_rate(attainment(policy, router), a.find_rate, low, high, a.rate_tolerance)
        rows.append((policy, router, found))
    print(format_capacity(a.find_rate, a.replicas, rows))
    print(f"results appended to {a.out}", file=sys.stderr)
    return 0


def format_capacity(target: float, replicas: int, rows) -> str:
    """The capacity table: per policy and router, the rate that met the target and the one
    above it that did not (the rate sustained lies between)."""
    lines = [
        f"| policy | router | replicas | rate at >= {100 * target:.0f}% (met) | "
        "first rate missed | probes (rps: attainment) |",
        "|---|---|---|---|---|---|",
    ]
    for policy, router, f in rows:
        met = "< lowest probed" if f.met is None else f"{f.met:g}"
        missed = "> highest probed" if f.missed is None else f"{f.missed:g}"
        probes = ", ".join(f"{r:g}: {100 * att:.1f}%" for r, att in sorted(f.probes))
        lines.append(f"| {policy} | {router} | {replicas} | {met} | {missed} | {probes} |")
    return "\n".join(lines)


@dataclass(frozen=True)
class Saturation:
    """One replica kept backlogged: `rate` the requests it completed a second from `start_s`
    to `end_s` (the last arrival), a stretch during which a request always waited behind a
    full batch; None when no such stretch covers a quarter of the arrivals (offer more)."""

    rate: float | None
    start_s: float | None
    end_s: float
    served: int  # requests offered (the cheapest share)


def cheapest_share(
    reqs: Sequence[BenchRequest], share: float, keep_slos: bool = False
) -> list[BenchRequest]:
    """The `share` of `reqs` with the fewest prompt plus output tokens, in arrival order, the
    least work that share of the requests can be; their SLOs dropped unless `keep_slos`."""
    if not 0 < share <= 1:
        raise ValueError(f"the attainment is a fraction in (0, 1], got {share}")

    def work(b: BenchRequest) -> int:
        return max(1, b.trace.input_length or len(b.trace.prompt.split())) + b.max_tokens

    keep = max(1, math.ceil(share * len(reqs)))
    chosen = set(sorted(range(len(reqs)), key=lambda i: (work(reqs[i]), i))[:keep])
    return [
        b if keep_slos else replace(b, slo_tpot_ms=None) for i, b in enumerate(reqs) if i in chosen
    ]


def saturation(records: Sequence[RequestRecord], batch: int, served: int) -> Saturation:
    """The completion rate of a replica over the stretch before the last arrival during which
    more than `batch` requests were in it throughout (sent and not finished: a full batch
    and a queue), from its first completion; None when that is under a quarter of the
    arrivals' span."""
    sent = sorted(r.sent_s for r in records if r.sent_s is not None)
    ends = sorted(r.end_s for r in records if r.completed and r.end_s is not None)
    first, last = sent[0], sent[-1]
    # At equal times an arrival first: a request that arrives as another ends kept the queue.
    events = sorted([(t, 1) for t in sent] + [(t, -1) for t in ends], key=lambda e: (e[0], -e[1]))
    held, start = 0, None
    for t, d in events:
        if t >= last:
            break
        held += d
        if held <= batch:
            start = None  # the queue ran dry: what completed was what arrived
        elif start is None:
            start = t
    if start is not None:
        # From the first completion on: before it the batch was still filling, not finishing.
        start = next((t for t in ends if t > start), None)
    if start is None or last - start < (last - first) / 4:
        return Saturation(None, None, last, served)
    done = sum(start < t <= last for t in ends)
    return Saturation(done / (last - start), start, last, served)


def _rate_ceilings(a: argparse.Namespace, trace, setups: dict[str, SimSetup]) -> int:
    if not a.rps:
        raise ValueError("--rate-ceiling needs --rps: a rate that keeps one replica backlogged")
    rps = max(a.rps)
    offered = prepare_point(a, trace, rps)
    lines = [
        f"| policy | SLOs | requests (the cheapest {100 * a.rate_ceiling:g}%) | offered rps | "
        "completed a second, backlogged (window s) | "
        f"rate at {100 * a.rate_ceiling:g}% on {a.replicas} replica(s) |",
        "|---|---|---|---|---|---|",
    ]
    # SLOs dropped: the most any router gets from these replicas. Kept: what one replica
    # completes while keeping the mix's paces (a router that sorts the classes apart could
    # do better than a replica given all of them, so not a bound).
    for policy, setup in setups.items():
        one = replace(setup, admission="queue", replicas=1)
        for keep in (False, True):
            reqs = cheapest_share(offered, a.rate_ceiling, keep_slos=keep)
            desc = f"{policy} ceiling ({'SLOs kept' if keep else 'no SLOs'}) @ {rps}"
            sim = simulate(reqs, one, progress=not a.no_progress, desc=desc)
            sat = saturation(sim.records, setup.sched.max_num_seqs, len(reqs))
            if sat.rate is None:
                got, cap = f"not backlogged long enough: offer more than {rps:g} rps", "-"
            else:
                assert sat.start_s is not None
                got = f"{sat.rate:.3g} ({sat.start_s:.0f}-{sat.end_s:.0f})"
                cap = f"{a.replicas * sat.rate / a.rate_ceiling:.4g} rps"
                cap = cap if keep else f"**{cap}** (ceiling)"
            slos = "kept" if keep else "dropped"
            lines.append(f"| {policy} | {slos} | {sat.served} | {rps:g} | {got} | {cap} |")
    print("\n".join(lines))
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
        "replicas": setup.replicas,
        "router": setup.router,
        "router_stats_period_s": setup.router_stats_period_s,
        "wall_s": sim.wall_s,
    }
    return result


def main(argv: Sequence[str] | None = None) -> int:
    from adaserve.entry import standalone_main

    doc = __doc__.split("\n\n")[0]
    return standalone_main("adaserve simulate", doc, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
