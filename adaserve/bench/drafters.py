"""Drafters on real text: incremental vs speculative policies per trace category, same run.

    python -m adaserve.bench.drafters [--trace T] [--concurrency 1 4] [--per-category 4]
        [--categories summarization code]

Prompts are the first `--per-category` x concurrency summarization, code and instruction
requests of the shared trace, sent through the chat template, greedy, stopping at EOS or
`--max-tokens`. Every configuration serves the same prompts in the same process, one after
another, `--rounds` times alternating (each configuration keeps its fastest round: a
slow moment of the machine then hits every configuration alike), so the ratios compare like
with like. By default (`--scenario new`) each pass runs
on a fresh engine that has never seen its prompts or their answers (`bench/passes.py`), and
the ratio to incremental is end to end, from submission to the last token, prefill included:
what a new user's traffic meets. `--scenario repeated` keeps one engine per configuration for
the whole run (traffic that repeats: the suffix index then holds earlier answers). Prints a
markdown table: end-to-end and decode tokens/s, the end-to-end ratio to incremental, accepted
tokens and draft time per decode iteration.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.passes import SCENARIOS, EnginePool
from adaserve.bench.trace import load_trace
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/workloads/mixed_rps3.0_ol256.json"
)
CATEGORIES = ("summarization", "code", "instruction")


def category(prompt: str) -> str:
    """The trace's three sources: CNN/DailyMail, HumanEval, Alpaca-style instructions."""
    if prompt.startswith("Please generate a summarization"):
        return "summarization"
    if "def " in prompt and ('"""' in prompt or "'''" in prompt):
        return "code"
    return "instruction"


@dataclass
class Result:
    tokens: int
    seconds: float
    decode_tokens: int
    decode_s: float
    decode_iterations: int
    accepted: int
    draft_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_s, 1e-9)


def serve(engine: LLMEngine, prompts: list[list[int]], concurrency: int, max_tokens: int) -> Result:
    """Serve `prompts` keeping `concurrency` in flight; greedy."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    pending = list(prompts)
    r = Result(0, 0.0, 0, 0.0, 0, 0, 0.0)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while (
            pending and len(engine.scheduler.running) + len(engine.scheduler.waiting) < concurrency
        ):
            engine.add_request(pending.pop(0), params)
        outs = engine.step()
        emitted = sum(len(o.delta_token_ids) for o in outs)
        r.tokens += emitted
        s = engine.last_stats
        if s is not None and s.kind == "decode":
            r.decode_tokens += s.emitted_tokens
            r.decode_s += s.total_s
            r.decode_iterations += s.num_requests
            r.accepted += s.accepted_tokens
            r.draft_s += s.draft_s
    r.seconds = time.perf_counter() - start
    return r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--budget", type=int, default=SchedulerConfig.budget)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["incremental", "adaserve:suffix", "adaserve_paper:suffix"],
        help="policy[:drafter] entries; the first is the baseline",
    )
    ap.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="new",
        help="new: a fresh engine per pass, prompts it has never seen; repeated: one engine per "
        "configuration for the whole run (traffic that repeats)",
    )
    ap.add_argument(
        "--categories",
        nargs="+",
        choices=CATEGORIES,
        default=list(CATEGORIES),
        help="trace categories to serve, in this order",
    )
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "ggml"))
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds over the configurations, alternating; each keeps its fastest round",
    )
    args = ap.parse_args()
    trace = load_trace(args.trace)

    def factory(policy: str, drafter: str) -> Callable[[], LLMEngine]:
        return lambda: LLMEngine(
            ModelConfig(model=args.model, drafter=drafter or "auto", backend=args.backend),
            CacheConfig(),
            SchedulerConfig(policy=policy, budget=args.budget, max_num_seqs=max(args.concurrency)),
        )

    factories = {}
    for entry in args.configs:
        policy, _, drafter = entry.partition(":")
        factories[entry] = factory(policy, drafter)
    pool = EnginePool(args.scenario, factories)
    tok = pool.engine(args.configs[0])  # any engine tokenizes; it serves nothing measured
    by_cat: dict[str, list[list[int]]] = {c: [] for c in CATEGORIES}
    for req in trace:
        bucket = by_cat[category(req.prompt)]
        if len(bucket) < args.per_category * max(args.concurrency):
            bucket.append(tok.apply_chat_template([{"role": "user", "content": req.prompt}]))
    print(
        f"budget {args.budget}, greedy, up to {args.max_tokens} tokens, "
        f"{args.per_category} x concurrency prompts per category, scenario {args.scenario}, "
        f"backend {args.backend}, best of {args.rounds} alternating rounds\n"
    )
    print(
        "| category | concurrent | config | tok/s | decode tok/s | vs incremental "
        "| accepted/iter | draft ms/iter |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    for cat in args.categories:
        for c in args.concurrency:
            prompts = by_cat[cat][: args.per_category * c]
            best: dict[str, Result] = {}
            for _ in range(args.rounds):
                for entry in pool.labels:
                    r = serve(pool.engine(entry), prompts, c, args.max_tokens)
                    if entry not in best or r.seconds < best[entry].seconds:
                        best[entry] = r
            base = best[pool.labels[0]].tokens_per_s
            for entry, r in best.items():
                iters = max(1, r.decode_iterations)
                print(
                    f"| {cat} | {c} | {entry} | {r.tokens_per_s:.1f} | {r.decode_tokens_per_s:.1f} "
                    f"| {r.tokens_per_s / base:.2f}x | {r.accepted / iters:.2f} "
                    f"| {1000 * r.draft_s / iters:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
