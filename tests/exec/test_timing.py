"""Timing a runner's forwards (exec/timing.py): what a timed shape really runs, and that the
KV it borrows goes back.

The cost curve that seeds every engine's cost model is timed over sequences that hold a
context; on ggml the context has to be computed, and it is computed once per sequence, not
once per shape (it was per shape, ~20 s of every ggml engine's start on a 2-core CPU).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from adaserve.config import CacheConfig, ModelConfig
from adaserve.exec.batch import ForwardBatch
from adaserve.exec.engine import ExecutionEngine
from adaserve.exec.ggml import ggml_available
from adaserve.exec.timing import NUM_SEQS, ShapeTimer, forward_cost_points, split_tokens


def record_forwards(runner, monkeypatch) -> list[tuple[ForwardBatch, list[int]]]:
    """Every forward the runner makes, with the KV each of its sequences held before it
    (ggml: the cells llama.cpp holds; torch: the KV length the batch names minus its tokens)."""
    seen: list[tuple[ForwardBatch, list[int]]] = []
    real = runner.forward
    held_cells = getattr(runner, "llama", None)

    def forward(batch: ForwardBatch):
        if held_cells is not None:
            held = [
                runner.llama.seq_pos_max(runner.cache.seq_of(t)) + 1 for t in batch.block_tables
            ]
        else:
            held = [kv - q for kv, q in zip(batch.kv_lens, batch.query_lens)]
        seen.append((batch, held))
        return real(batch)

    monkeypatch.setattr(runner, "forward", forward)
    return seen


def test_shapes_are_timed_over_their_context_and_release_every_block(tiny_llama: Path, monkeypatch):
    engine = ExecutionEngine(
        ModelConfig(model=str(tiny_llama)),
        CacheConfig(block_size=16, num_blocks=64),
        need_draft=False,
    )
    runner = engine.target
    seen = record_forwards(runner, monkeypatch)
    with ShapeTimer(runner, 40) as timer:
        for tokens in (1, 3, 8, 20):
            samples = timer.samples(tokens, repeats=2)
            assert samples is not None and len(samples) == 2 and min(samples) > 0
        # The 8 sequences hold 3 blocks each (40 + up to 3 tokens); 200 more tokens each would
        # need 96 more blocks of the 40 left: the shape is refused, not half-run.
        assert timer.samples(8 * 200, repeats=1) is None
    assert runner.cache.allocator.num_used == 0, "timing leaked KV blocks"
    # torch's paged attention reads whatever the slots hold: no context forward, only timed ones.
    timed = seen
    assert [sum(b.query_lens) for b, _ in timed] == [1] * 3 + [3] * 3 + [8] * 3 + [20] * 3
    for batch, held in timed:
        assert batch.query_lens == split_tokens(sum(batch.query_lens), NUM_SEQS)
        assert held == [40] * len(held), "every timed token attends 40 cached ones"


@pytest.mark.slow
@pytest.mark.skipif(not ggml_available(), reason="the ggml backend needs the `cpu` extra")
def test_ggml_computes_each_sequences_context_once_and_times_over_it(monkeypatch):
    from adaserve.exec.default_model import default_gguf_file, default_model_dir
    from adaserve.exec.ggml import GgmlRunner

    runner = GgmlRunner(default_gguf_file(), default_model_dir(), 2048, 16, 512)
    try:
        ids = runner.cache.num_free_ids
        seen = record_forwards(runner, monkeypatch)
        points = forward_cost_points(runner, 16, context=32, repeats=1)
        assert [n for n, _, _ in points] == [1, 2, 3, 4, 6, 8, 12, 16]
        # The first forward allocates (1 token, no context); after it the context of each of
        # the 8 sequences is computed once: 1 + 1 + 1 + 1 + 2 + 2 sequences as the shapes widen.
        warm = [b for b, held in seen if b.logits_indices == []]
        assert sum(sum(b.query_lens) for b in warm) == NUM_SEQS * 32
        timed = [(b, held) for b, held in seen if b.logits_indices != [] and b.positions[0] == 32]
        assert len(timed) == 2 * len(points)
        for batch, held in timed:
            assert held == [32] * len(batch.query_lens), (
                "a timed forward saw other than its context"
            )
    finally:
        assert runner.cache.allocator.num_used == 0 and runner.cache.num_free_ids == ids
        runner.close()
