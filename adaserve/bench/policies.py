"""Policy vs policy on one machine and model: tokens/s, accepted tokens per iteration, time split.

    python -m adaserve.bench.policies [--concurrency 1 4 16] [--max-tokens 32]

Every policy gets the same prompts, greedy, in the same run, `--repeats` rounds at each
concurrency; requests carry mixed TPOT SLOs (--slos, ms; 0 = none); the time runs from
submission to the last token, prefill included. By default (`--schedule interleaved`) the
policies' engines serve side by side each round, their steps alternating one by one, each
timed on its own steps, and each policy reports its totals over the rounds ("per round": the
range of the rounds' ratios to the first policy): a slow moment of this shared machine then
falls on every policy alike. `--schedule sequential` runs one pass after another and reports
the median pass. By default
(`--scenario new`) every pass runs on a fresh engine that has never seen the prompts
(`bench/passes.py`); `--scenario repeated` keeps one engine per policy for the whole run, so
what it learns from traffic (calibration, the cost model, a suffix index of earlier answers)
carries over as in a server whose traffic repeats. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.passes import SCENARIOS, EnginePool, add_totals, own_clock, turns
from adaserve.bench.prompts import prompts
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from adaserve.exec.model.llama import Linear
from adaserve.exec.torch_runner import ModelRunner
from adaserve.heap import frozen_heap

# (label, SchedulerConfig overrides)
CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("incremental", {"policy": "incremental"}),
    ("sequence γ=2", {"policy": "sequence", "gamma": 2}),
    ("sequence γ=4", {"policy": "sequence", "gamma": 4}),
    ("specinfer", {"policy": "specinfer"}),
    ("global_greedy", {"policy": "global_greedy"}),
    ("adaserve_paper", {"policy": "adaserve_paper"}),
    ("adaserve", {"policy": "adaserve"}),
]


@dataclass
class Result:
    """Totals of one or more passes of one policy (each pass: one engine, one batch)."""

    tokens: int = 0
    seconds: float = 0.0  # time in the engine's own steps, submission to the last token
    decode_iterations: int = 0
    request_iterations: int = 0  # decode iterations x the requests in each
    accepted: int = 0
    total_s: float = 0.0
    draft_s: float = 0.0
    select_s: float = 0.0
    verify_s: float = 0.0
    slo_met: int = 0
    with_slo: int = 0

    def add(self, other: Result) -> None:
        add_totals(self, other)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)

    @property
    def accepted_per_iter(self) -> float:  # accepted draft tokens per request per iteration
        return self.accepted / max(1, self.request_iterations)

    def per_iter_ms(self, seconds: float) -> float:
        return 1000.0 * seconds / max(1, self.decode_iterations)

    @property
    def slo_attained(self) -> float:
        return self.slo_met / max(1, self.with_slo)

    def summary(self) -> dict[str, float]:
        """The table's figures: tokens/s, accepted tokens per request per iteration, ms per
        decode iteration (total, draft, select, verify), the fraction of SLOs met."""
        return {
            "tokens_per_s": self.tokens_per_s,
            "accepted_per_iter": self.accepted_per_iter,
            "iter_ms": self.per_iter_ms(self.total_s),
            "draft_ms": self.per_iter_ms(self.draft_s),
            "select_ms": self.per_iter_ms(self.select_s),
            "verify_ms": self.per_iter_ms(self.verify_s),
            "slo_attained": self.slo_attained,
        }


class Pass:
    """One engine serving one batch of prompts, all submitted at once, a step at a time; its
    seconds are those of its own steps."""

    def __init__(
        self, engine: LLMEngine, batch: list[str], max_tokens: int, slos: list[float | None]
    ) -> None:
        self.engine, self.result = engine, Result()
        self.clock = own_clock(engine)  # the engine's time: its own steps only
        for i, p in enumerate(batch):
            engine.add_request(
                p,
                SamplingParams(
                    max_tokens=max_tokens,
                    temperature=0.0,
                    ignore_eos=True,
                    slo_tpot_ms=slos[i % len(slos)],
                ),
            )

    @property
    def done(self) -> bool:
        return not self.engine.has_unfinished()

    def step(self) -> None:
        r = self.result
        with self.clock.running():
            start = time.perf_counter()
            outs = self.engine.step()
            r.seconds += time.perf_counter() - start
        for out in outs:
            r.tokens += len(out.delta_token_ids)
            if out.finished and out.metrics.slo_attained is not None:
                r.with_slo += 1
                r.slo_met += bool(out.metrics.slo_attained)
        s = self.engine.last_stats
        if s is not None and s.kind == "decode":
            r.decode_iterations += 1
            r.request_iterations += s.num_requests
            r.accepted += s.accepted_tokens
            r.total_s += s.total_s
            r.draft_s += s.draft_s
            r.select_s += s.select_s
            r.verify_s += s.verify_s


def serve_side_by_side(
    engines: list[LLMEngine], batch: list[str], max_tokens: int, slos: list[float | None]
) -> list[Result]:
    """Each engine serves `batch`, their steps interleaved one by one, each charged only its
    own steps and reading a clock that runs only during them (`passes.OwnClock`: its SLO
    paces and attainment are those of serving alone): a slow moment of the machine falls
    on every policy alike. (Passes one after
    another on a fresh engine each moved by 10-20% here: one request's decode took 12-17 ms
    per token in four passes of the same configuration; `--schedule sequential`.)"""
    passes = [Pass(e, batch, max_tokens, slos) for e in engines]
    with frozen_heap():  # as in a server: full collector passes skip what start-up built
        while not all(p.done for p in passes):
            for p in passes:
                if not p.done:
                    p.step()
    return [p.result for p in passes]


def run(engine: LLMEngine, batch: list[str], max_tokens: int, slos: list[float | None]) -> Result:
    """One pass on its own."""
    return serve_side_by_side([engine], batch, max_tokens, slos)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None, help="default: the default model's draft")
    ap.add_argument(
        "--drafter",
        default="model",
        help="model, eagle, suffix, model+suffix or eagle+suffix (model or eagle without "
        "--draft-model: the default draft or the shipped head)",
    )
    ap.add_argument(
        "--quantize-draft",
        action="store_true",
        help="int8 dynamic quantization of the draft's linear layers (e.g. with --draft-model "
        "set to the target itself: the int8 target as its own draft)",
    )
    ap.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "torch", "ggml"),
        help="who runs the target (auto: ggml for a GGUF model when installed)",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds per point (the policies' order rotates by one each round: a multiple of "
        "the policy count gives each policy each slot equally often)",
    )
    ap.add_argument(
        "--schedule",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved: each round the policies' engines serve side by side, steps "
        "alternating, and each reports its totals over the rounds; sequential: one pass "
        "after another, the median pass reported",
    )
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--budget", type=int, default=SchedulerConfig.budget)
    ap.add_argument("--slos", type=float, nargs="+", default=[150.0, 400.0, 0.0])
    ap.add_argument("--policies", nargs="+", default=None, help="labels to run (default: all)")
    ap.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="new",
        help="new: a fresh engine per pass, prompts it has never seen; repeated: one engine per "
        "policy for the whole run (traffic that repeats)",
    )
    ap.add_argument(
        "--record-iterations",
        metavar="DIR",
        default=None,
        help="append each policy's iteration timelines to DIR/<policy>.jsonl (every pass of "
        "it; see request_manager/timeline.py)",
    )
    args = ap.parse_args()
    slos = [s or None for s in args.slos]
    print(
        f"budget {args.budget}, {args.max_tokens} tokens/request, greedy, SLOs {slos} ms, "
        f"drafter {args.drafter} {args.draft_model or ''}, backend {args.backend}, "
        f"scenario {args.scenario}, {args.repeats} rounds, {args.schedule}\n"
    )
    print(
        "| policy | concurrent | tok/s | vs incremental | per round | accepted/iter | iter ms "
        "| draft ms | select ms | verify ms | SLO attained |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def factory(label: str, overrides: dict) -> Callable[[], LLMEngine]:
        timeline = None
        if args.record_iterations:
            name = label.replace(" ", "_").replace("γ=", "g")
            timeline = str(Path(args.record_iterations) / f"{name}.jsonl")

        def build() -> LLMEngine:
            engine = LLMEngine(
                ModelConfig(
                    model=args.model,
                    draft_model=args.draft_model,
                    drafter=args.drafter,
                    backend=args.backend,
                ),
                CacheConfig(),
                SchedulerConfig(
                    budget=args.budget,
                    max_num_seqs=max(args.concurrency),
                    record_iterations=timeline,
                    **overrides,
                ),
            )
            draft = engine.engine.draft
            if args.quantize_draft and draft is not None:
                assert isinstance(draft, ModelRunner), "--quantize-draft needs a torch draft model"
                torch.ao.quantization.quantize_dynamic(
                    draft.model, {torch.nn.Linear, Linear}, dtype=torch.qint8, inplace=True
                )
                engine.apply_profile(args.budget, engine.sched_cfg.t_spec_init_s)  # re-measure
            return engine

        return build

    chosen = [
        (label, overrides)
        for label, overrides in CONFIGS
        if not args.policies or label in args.policies or overrides["policy"] in args.policies
    ]
    pool = EnginePool(args.scenario, {label: factory(label, o) for label, o in chosen})
    # Policies take turns at every concurrency, `--repeats` times. Interleaved (default): each
    # round the policies' fresh engines serve side by side, and each reports its totals over
    # the rounds. Sequential: one pass after another, the median pass reported, so a
    # disturbance of the machine hits one run of one policy, not a whole column.
    for c in args.concurrency:
        runs: dict[str, list[Result]] = {label: [] for label in pool.labels}
        for i in range(args.repeats):
            order = turns(pool.labels, i)  # no configuration always runs (steps) first
            if args.schedule == "interleaved":
                engines = [pool.engine(label) for label in order]
                served = serve_side_by_side(engines, prompts(c), args.max_tokens, slos)
                del engines
            else:
                served = [
                    run(pool.engine(label), prompts(c), args.max_tokens, slos) for label in order
                ]
            for label, r in zip(order, served):
                runs[label].append(r)
        shown: dict[str, Result] = {}
        for label, results in runs.items():
            if args.schedule == "interleaved":
                shown[label] = Result()
                for r in results:
                    shown[label].add(r)
            else:
                shown[label] = sorted(results, key=lambda x: x.tokens_per_s)[len(results) // 2]
        base = shown[pool.labels[0]].tokens_per_s
        first = runs[pool.labels[0]]
        for label, r in shown.items():
            ratios = [x.tokens_per_s / b.tokens_per_s for x, b in zip(runs[label], first)]
            print(
                f"| {label} | {c} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base:.2f}x "
                f"| {min(ratios):.2f}-{max(ratios):.2f} | {r.accepted_per_iter:.2f} "
                f"| {r.per_iter_ms(r.total_s):.0f} | {r.per_iter_ms(r.draft_s):.0f} "
                f"| {r.per_iter_ms(r.select_s):.1f} | {r.per_iter_ms(r.verify_s):.0f} "
                f"| {100 * r.slo_attained:.0f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
