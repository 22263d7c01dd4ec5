"""A draft's reduced vocabulary: the target's most frequent output tokens, measured.

A draft step's cost on a CPU is mostly its LM head (SmolLM2: 49,152 rows x 576). Restricting
the head to the K tokens the target actually writes most often cuts that cost by V/K; a
token outside them can never be proposed, which costs acceptance only as often as the target
writes one, and never correctness (the target verifies every proposal).

    adaserve draft-vocab [MODEL] --out FILE [--prompts N] [--max-tokens T] [--k K]

generates greedy answers with the target to the distillation grid's training prompts, counts
their tokens, and writes the ranking; held-out (eval-topic) prompts measure the coverage
(share of the target's output tokens inside the top K) for several K.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Sequence

from adaserve.exec.draft_vocab import coverage, rank_tokens, save_ranking


def count_outputs(engine, prompts: Sequence[list[dict]], max_tokens: int) -> Counter[int]:
    """Token counts of the target's greedy answers to chat prompts (one batched run)."""
    from adaserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(engine.apply_chat_template(m), params).request_id for m in prompts]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return Counter(t for i in ids for t in done[i])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--out", required=True, help="where to write the ranking (JSON)")
    p.add_argument("--prompts", type=int, default=192, help="training prompts to answer")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts (coverage)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")


def run(a: argparse.Namespace) -> int:
    from adaserve import LLMEngine
    from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from adaserve.distill.prompts import PromptGrid

    engine = LLMEngine(ModelConfig(model=a.model), CacheConfig(), SchedulerConfig(max_num_seqs=64))
    grid = PromptGrid()
    train = [p.messages for p in grid.split("train")[: a.prompts]]
    held_out = [p.messages for p in grid.split("eval")[: a.eval_prompts]]
    counts = count_outputs(engine, train, a.max_tokens)
    eval_counts = count_outputs(engine, held_out, a.max_tokens)
    ranking = rank_tokens(counts, engine.engine.vocab_size)
    cov = {k: coverage(ranking, k, eval_counts) for k in (1024, 2048, 4096, 8192, 16384)}
    save_ranking(
        a.out,
        ranking,
        {
            "model": engine.engine.target_path.name,
            "train_tokens": sum(counts.values()),
            "held_out_tokens": sum(eval_counts.values()),
            "held_out_coverage": cov,
        },
        keep=len(counts),  # the tokens seen; the rest follow in id order
    )
    for k, c in cov.items():
        print(f"top {k:>5}: {100 * c:.2f}% of held-out output tokens")
    print(f"wrote {a.out} ({sum(counts.values())} counted tokens)")
    return 0
