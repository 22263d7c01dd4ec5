"""Policy vs policy on one machine and model: tokens/s, accepted tokens per iteration, time split.

    python -m adaserve.bench.policies [--concurrency 1 4 16] [--max-tokens 32]

Every policy gets the same prompts, greedy, in the same run, taking turns at each concurrency
(--repeats runs each, the median reported); requests carry mixed TPOT SLOs (--slos, ms;
0 = none); the time runs from submission to the last token, prefill included. By default
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
from typing import Any

import torch

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.passes import SCENARIOS, EnginePool, turns
from adaserve.bench.prompts import prompts
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from adaserve.exec.torch_runner import ModelRunner

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
    tokens_per_s: float
    accepted_per_iter: float  # mean accepted draft tokens per request per iteration
    iter_ms: float
    draft_ms: float
    select_ms: float
    verify_ms: float
    slo_attained: float


def run(engine: LLMEngine, batch: list[str], max_tokens: int, slos: list[float | None]) -> Result:
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
    start = time.perf_counter()
    tokens, decode, finished = 0, [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.delta_token_ids)
            if out.finished:
                finished.append(out.metrics)
        if engine.last_stats.kind == "decode":
            decode.append(engine.last_stats)
    elapsed = time.perf_counter() - start
    n = max(1, len(decode))
    req_iters = max(1, sum(s.num_requests for s in decode))
    with_slo = [m for m in finished if m.slo_attained is not None]
    return Result(
        tokens / elapsed,
        sum(s.accepted_tokens for s in decode) / req_iters,
        1000 * sum(s.total_s for s in decode) / n,
        1000 * sum(s.draft_s for s in decode) / n,
        1000 * sum(s.select_s for s in decode) / n,
        1000 * sum(s.verify_s for s in decode) / n,
        sum(bool(m.slo_attained) for m in with_slo) / max(1, len(with_slo)),
    )


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
        help="runs per point; the median counts (the policies' order rotates by one each "
        "repeat: a multiple of the policy count gives each policy each slot equally often)",
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
    args = ap.parse_args()
    slos = [s or None for s in args.slos]
    print(
        f"budget {args.budget}, {args.max_tokens} tokens/request, greedy, SLOs {slos} ms, "
        f"drafter {args.drafter} {args.draft_model or ''}, backend {args.backend}, "
        f"scenario {args.scenario}\n"
    )
    print(
        "| policy | concurrent | tok/s | vs incremental | accepted/iter | iter ms | draft ms "
        "| select ms | verify ms | SLO attained |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def factory(overrides: dict) -> Callable[[], LLMEngine]:
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
                    budget=args.budget, max_num_seqs=max(args.concurrency), **overrides
                ),
            )
            draft = engine.engine.draft
            if args.quantize_draft and draft is not None:
                assert isinstance(draft, ModelRunner), "--quantize-draft needs a torch draft model"
                torch.ao.quantization.quantize_dynamic(
                    draft.model, {torch.nn.Linear}, dtype=torch.qint8, inplace=True
                )
                engine.apply_profile(args.budget, engine.sched_cfg.t_spec_init_s)  # re-measure
            return engine

        return build

    chosen = [
        (label, overrides)
        for label, overrides in CONFIGS
        if not args.policies or label in args.policies or overrides["policy"] in args.policies
    ]
    pool = EnginePool(args.scenario, {label: factory(o) for label, o in chosen})
    # Policies take turns at every concurrency, `--repeats` times; the median run is reported,
    # so a disturbance of the machine hits one run of one policy, not a whole column.
    for c in args.concurrency:
        runs: dict[str, list[Result]] = {label: [] for label in pool.labels}
        for i in range(args.repeats):
            for label in turns(pool.labels, i):  # no configuration always runs first
                runs[label].append(run(pool.engine(label), prompts(c), args.max_tokens, slos))
        base = None
        for label, results in runs.items():
            r = sorted(results, key=lambda x: x.tokens_per_s)[len(results) // 2]
            base = base or r.tokens_per_s
            print(
                f"| {label} | {c} | {r.tokens_per_s:.1f} | {r.tokens_per_s / base:.2f}x "
                f"| {r.accepted_per_iter:.2f} | {r.iter_ms:.0f} | {r.draft_ms:.0f} "
                f"| {r.select_ms:.1f} | {r.verify_ms:.0f} | {100 * r.slo_attained:.0f}% |",
                flush=True,
            )


if __name__ == "__main__":
    main()
