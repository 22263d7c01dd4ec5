"""The iteration timeline records what each iteration ran, as the scheduler counted it."""

from __future__ import annotations

import json

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.timeline import plot_timeline, summarize_timeline
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig


def test_timeline_lines_equal_the_scheduler_stats_and_plot(tiny_llama, tmp_path) -> None:
    path = tmp_path / "iterations.jsonl"
    engine = LLMEngine(
        ModelConfig(model=str(tiny_llama)),
        CacheConfig(block_size=4, num_blocks=512),
        SchedulerConfig(
            policy="adaserve",
            budget=12,
            max_prefill_chunk=8,
            min_prefill_chunk=4,
            record_iterations=str(path),
        ),
    )
    prompts = [[5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 5, 9, 13], [3, 4, 5, 3, 4, 5, 3, 4]]
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        engine.add_request(p, params, request_id=f"r{i}")
    seen = []
    while engine.has_unfinished():
        before = engine.last_stats
        engine.step()
        if engine.last_stats is not before:
            seen.append(engine.last_stats)
    engine.scheduler.timeline.flush()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == len(seen), "one line per iteration that ran"
    for row, s in zip(rows, seen):
        assert row["tree_tokens"] == s.tree_tokens and row["accepted"] == s.accepted_tokens
        assert row["emitted"] == s.emitted_tokens and row["padded_tokens"] == s.padded_tokens
        assert sum(row["prompt_tokens"].values()) == s.prefill_tokens
        assert row["forward_s"] == s.forward_s and row["total_s"] == s.total_s
        assert row["predicted_forward_s"] is not None and row["predicted_forward_s"] > 0
        decoding = s.num_requests if s.kind == "decode" else 0
        assert row["decode_rows"] == decoding
        cost = row["cost_inputs"]  # what the cost model observed
        assert cost["tokens"] == row["padded_tokens"] and 0 <= cost["silent"] <= cost["tokens"]
        assert (cost["tree_pairs"] > 0) == (row["tree_tokens"] > 0), "tree nodes past a root"
        if cost["silent_pairs"]:
            assert row["prompt_tokens"], "pairs of silent tokens without a prompt chunk"
    assert sum(sum(r["prompt_tokens"].values()) for r in rows) == sum(map(len, prompts))
    summary = summarize_timeline(rows)
    assert summary["iterations"] == len(rows) and 0 <= summary["host_share"] < 1
    out = plot_timeline(rows, tmp_path / "t.png")
    assert out.stat().st_size > 10_000, "no figure written"
