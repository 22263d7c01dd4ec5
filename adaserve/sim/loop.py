"""The simulation loop: requests through N real schedulers, each on its own virtual clock.

One replica is one `Scheduler` over a `SimEngine` with its own KV cache, cost model and clock.
The loop is a discrete-event simulation: the next event is either the next arrival or the
next iteration of the busy replica whose clock is earliest, so replicas run in parallel in
virtual time while every scheduler sees only its own clock. An arrival is routed
(`adaserve.cluster.router`) on the stats the replicas last published, then asked by its
replica's admission (`--admission slo`) as the real server would ask it.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from tqdm import tqdm

from adaserve.bench.report import RequestRecord
from adaserve.bench.trace import BenchRequest
from adaserve.cluster.router import Router, replica_stats
from adaserve.config import CacheConfig, SchedulerConfig
from adaserve.request_manager.admission import Refusal
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.request import Request, SamplingParams
from adaserve.request_manager.scheduler import Scheduler
from adaserve.request_manager.stats import IterationStats
from adaserve.sim.acceptance import AcceptanceModel, SyntheticDrafter
from adaserve.sim.cost import CostSpec, ForwardNoise
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
    # Replicas behind a router (adaserve.cluster.router): each a whole server of this setup.
    replicas: int = 1
    router: str = "round_robin"
    # How old the stats the router ranks by may get (0: fresh at every arrival).
    router_stats_period_s: float = 0.0


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


@dataclass
class _Replica:
    clock: VirtualClock
    engine: SimEngine
    sched: Scheduler
    drafter: str
    last: IterationStats | None = None  # the last iteration's stats (progress check)
    stuck: int = 0


def _replica(setup: SimSetup, rng: random.Random, num_blocks: int) -> _Replica:
    cfg = setup.sched
    clock = VirtualClock(setup.host_time)
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
        setup.prefix_caching,  # (both real backends cache prefixes)
        clock,
        setup.noise,
        setup.seed,
    )
    drafter: SyntheticDrafter | str = "auto"
    if cfg.speculative:
        if setup.acceptance is None:
            raise ValueError(f"policy {cfg.policy} speculates: give --acceptance")
        drafter = SyntheticDrafter(engine, setup.acceptance, rng, costly=use_model)
    cost = setup.cost.target.scheduler_model(cfg.cost_forget)
    if cost is None:
        cost = ForwardCostModel(forget=cfg.cost_forget)
        cost.seed_measured(engine.target, max(cfg.budget, 64), cfg.speculative)
    sched = Scheduler(cfg, engine, drafter, cost)
    return _Replica(clock, engine, sched, getattr(drafter, "name", "none"))


def simulate(
    reqs: Sequence[BenchRequest],
    setup: SimSetup,
    progress: bool = False,
    desc: str = "sim",
    on_step: Callable[[Scheduler], None] | None = None,
) -> SimRun:
    """Run `reqs` (arriving at their send times) to completion; one record per request.

    `on_step(scheduler)` runs after every iteration (tests check invariants there)."""
    if setup.replicas < 1:
        raise ValueError(f"replicas must be >= 1, got {setup.replicas}")
    kv_tokens = setup.kv_tokens or setup.cost.target.kv_tokens or DEFAULT_KV_TOKENS
    num_blocks = max(1, kv_tokens // setup.block_size)
    # Replica 0 draws prompts and drafts from one generator (a one-replica run is what it
    # always was); the others draft from their own.
    rng = random.Random(setup.seed)
    reps = [
        _replica(setup, rng if k == 0 else random.Random(setup.seed + k), num_blocks)
        for k in range(setup.replicas)
    ]
    cfg = setup.sched
    router = Router(
        setup.router, len(reps), cfg.slo_headroom, setup.seed, cfg.default_ttft_floor_ms / 1000
    )
    refresh_at = -math.inf
    pending = sorted(reqs, key=lambda r: r.send_time_s)
    live: list[tuple[BenchRequest, Request]] = []
    refused: list[RequestRecord] = []
    # Refused for their TPOT, waiting for room on a replica: (request, index, replica).
    held: list[tuple[BenchRequest, int, int]] = []
    stats = SimRun([], 0, 0, 0, 0, 0, 0, 0, num_blocks * len(reps), 0.0, reps[0].drafter)
    bar = tqdm(total=len(pending), desc=desc, unit="req", disable=not progress, leave=False)
    start, i = time.perf_counter(), 0
    while True:
        busy = [r for r in reps if r.sched.has_unfinished()]
        if i >= len(pending) and not busy:
            break
        soonest = min(busy, key=lambda r: r.clock(), default=None)
        if i < len(pending) and (soonest is None or pending[i].send_time_s <= soonest.clock()):
            b = pending[i]
            if b.send_time_s >= refresh_at:
                router.refresh([replica_stats(r.sched.admission) for r in reps])
                refresh_at = b.send_time_s + setup.router_stats_period_s
            where, why, why_at = _route(router, reps, b, setup)
            if where is not None:
                live.append((b, _admit(reps[where], b, i, rng, b.send_time_s)))
                router.routed(where)
            elif why is not None and _holds(reps[why_at], b, why, 0.0):
                held.append((b, i, why_at))
            elif why is not None and _best_effort(reps[why_at], b, why, 0.0):
                live.append((b, _admit(reps[why_at], b, i, rng, b.send_time_s, True)))
                router.routed(why_at)
            else:
                refused.append(_refused(b, why.message if why else "no replica"))
                bar.update(1)
            i += 1
            continue
        assert soonest is not None
        bar.update(_iterate(soonest, setup, stats, on_step))
        if progress:
            # Nothing finishes for the first simulated seconds of a large run: the clock shows
            # that it moves.
            bar.set_postfix_str(f"{soonest.clock():.1f} s simulated", refresh=False)
        # Held requests are looked at again after every iteration of their replica, as
        # its engine thread does (api/async_engine.py): admitted, refused, or held on.
        still = []
        for b, j, k in held:
            rep = reps[k]
            if rep is not soonest:
                still.append((b, j, k))
                continue
            waited = max(0.0, rep.clock() - b.send_time_s)
            why = rep.sched.admission.judge(
                b.slo_tpot_ms,
                _prompt_len(rep.sched, b),
                max_tokens=b.max_tokens,
                waited_s=waited,
                key=b.trace.index,
            )
            if why is None:
                live.append((b, _add(rep.sched, b, j, rng)))
                router.routed(k)
            elif _holds(rep, b, why, waited):
                still.append((b, j, k))
            elif _best_effort(rep, b, why, waited):
                live.append((b, _add(rep.sched, b, j, rng, True)))
                router.routed(k)
            else:
                refused.append(_refused(b, why.message))
                bar.update(1)
        held = still
    # Held on a replica that went idle and got nothing more to run: no load ended for them.
    refused += [_refused(b, "held until the replay ended") for b, _, _ in held]
    bar.update(len(held))
    bar.close()
    stats.wall_s = time.perf_counter() - start
    for r in reps:
        if r.sched.timeline is not None:
            r.sched.timeline.close()
    stats.preemptions = sum(r.sched.num_preemptions for r in reps)
    stats.records = sorted([*(_record(b, r) for b, r in live), *refused], key=lambda r: r.index)
    return stats


def _route(
    router: Router, reps: list[_Replica], b: BenchRequest, setup: SimSetup
) -> tuple[int | None, Refusal | None, int]:
    """The replica that takes `b` (else None, why it was refused, and the replica that
    refused it first, where it may be held). The SLO router tries its feasible replicas in
    order (the ingress moves on after a 429), else its fallback; the others send the request
    to their first choice, whose admission alone decides."""
    ranked = router.rank(b.slo_tpot_ms)
    if setup.admission != "slo":
        return (ranked[0] if ranked else router.fallback()), None, 0
    # No replica feasible by the router's stats: the one with the shortest backlog gets it,
    # and its own admission answers (holds or refuses), as on Ray Serve.
    tries = (ranked if setup.router == "slo" else ranked[:1]) or [router.fallback()]
    first: Refusal | None = None
    for k in tries:
        why = reps[k].sched.admission.judge(
            b.slo_tpot_ms, _prompt_len(reps[k].sched, b), max_tokens=b.max_tokens, key=b.trace.index
        )
        if why is None:
            return k, None, 0
        first = first or why
    return None, first, tries[0]


def _holds(rep: _Replica, b: BenchRequest, why: Refusal, waited: float) -> bool:
    """A request refused for its TPOT stays held on `rep` while its hold lasts
    (`Admission.hold_s`), as that server's engine thread would hold it."""
    hold = rep.sched.admission.hold_s(b.slo_tpot_ms, _prompt_len(rep.sched, b), None)
    return not why.first_token and waited < hold


def _best_effort(rep: _Replica, b: BenchRequest, why: Refusal, waited: float) -> bool:
    """A request refused for its TPOT once its hold is over or for its first token (not for
    its work) is served best effort on `rep` when its admission allows
    (`Admission.best_effort_refusal`), as that server's engine thread would."""
    adm = rep.sched.admission
    return not why.work and (
        adm.best_effort_refusal(b.slo_tpot_ms, _prompt_len(rep.sched, b), None, waited) is None
    )


def _admit(
    rep: _Replica,
    b: BenchRequest,
    i: int,
    rng: random.Random,
    now: float,
    best_effort: bool = False,
) -> Request:
    if not rep.sched.has_unfinished():
        rep.clock.jump_to(now)
    return _add(rep.sched, b, i, rng, best_effort)


def _iterate(
    rep: _Replica,
    setup: SimSetup,
    stats: SimRun,
    on_step: Callable[[Scheduler], None] | None,
) -> int:
    """One iteration of one replica, as a real server runs it; returns requests finished."""
    sched = rep.sched
    plan = sched.schedule()  # the plan a real server would run, on the virtual clock
    changed = sched.commit(plan, rep.engine.run(plan))
    st = sched.last_stats
    if setup.host_overhead_s and st is not None and st is not rep.last:
        rep.clock.advance(setup.host_overhead_s)
    if on_step is not None:
        on_step(sched)
    if st is None or st is rep.last:
        rep.stuck += 1
        if rep.stuck > MAX_IDLE_STEPS:
            raise RuntimeError(
                f"the scheduler made no progress in {rep.stuck} iterations with "
                f"{len(sched.waiting)} requests waiting; give the simulation more KV"
            )
    else:
        rep.stuck, rep.last = 0, st
        stats.iterations += 1
        stats.max_forward_tokens = max(stats.max_forward_tokens, st.num_tokens)
        if st.kind == "decode":
            stats.decode_iterations += 1
            stats.accepted_tokens += st.accepted_tokens
            stats.tree_tokens += st.tree_tokens
    used = rep.engine.target.cache.allocator.num_used
    stats.max_blocks_used = max(stats.max_blocks_used, used)
    return sum(1 for r in changed if r.finished)


def _prompt_len(sched: Scheduler, b: BenchRequest) -> int:
    # The trace gives prompt text in another tokenizer: its length in words stands in.
    n = max(1, b.trace.input_length or len(b.trace.prompt.split()))
    return max(1, min(n, sched.engine.max_model_len - b.max_tokens - 1))


def _add(
    sched: Scheduler, b: BenchRequest, i: int, rng: random.Random, best_effort: bool = False
) -> Request:
    n = _prompt_len(sched, b)
    params = SamplingParams(
        max_tokens=b.max_tokens, temperature=0.0, ignore_eos=True, slo_tpot_ms=b.slo_tpot_ms
    )
    prompt = [rng.randrange(SIM_VOCAB) for _ in range(max(1, n))]
    req = Request(f"sim-{i}", prompt, params, arrival_time=b.send_time_s)
    req.best_effort = req.prefill_yields = best_effort
    sched.add(req)
    return req


def _refused(b: BenchRequest, why: str) -> RequestRecord:
    # As the bench records a real server's 429: sent, no tokens, counted as missed.
    return replace(_sent(b), error=f"HTTP 429: {why}")


def _sent(b: BenchRequest) -> RequestRecord:
    """The record of `b` sent at its arrival time, before anything came back."""
    return RequestRecord(
        index=b.trace.index,
        slo_category=b.slo_category,
        slo_tpot_ms=b.slo_tpot_ms,
        max_tokens=b.max_tokens,
        scheduled_s=b.send_time_s,
        sent_s=b.send_time_s,
    )


def _record(b: BenchRequest, r: Request) -> RequestRecord:
    m = r.metrics
    return replace(
        _sent(b),
        token_times_s=list(m.token_times),
        output_tokens=len(r.output_token_ids),
        end_s=m.finish_time,
        finish_reason=r.finish_reason,
        error=None if r.finished else "not finished",
        prompt_tokens=len(r.prompt_token_ids),
        # The objective the simulated server scheduled for (its default from the prompt).
        slo_ttft_ms=r.ttft_objective_ms,
        best_effort=r.best_effort,  # as the server's response header would say
    )
