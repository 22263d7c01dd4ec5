"""A draft's reduced-vocabulary head: same logits on its columns, only its tokens proposed,
output still the target's."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from adaserve import LLMEngine, SamplingParams
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from adaserve.exec.draft_vocab import (
    coverage,
    draft_vocab_ids,
    load_ranking,
    rank_tokens,
    save_ranking,
)
from adaserve.exec.loader import load_model
from tests.request_manager.test_speculative import run


def test_ranking_orders_by_count_then_id_and_covers_every_token(tmp_path):
    ranking = rank_tokens(Counter({7: 5, 3: 5, 9: 1}), 12)
    assert ranking[:3] == [3, 7, 9], "most frequent first, ties by id"
    assert sorted(ranking) == list(range(12)), "every id exactly once"
    assert coverage(ranking, 2, Counter({3: 5, 7: 5, 9: 1})) == pytest.approx(10 / 11)
    path = save_ranking(tmp_path / "r.json", ranking, {"model": "x"}, keep=3)
    assert load_ranking(path) == [3, 7, 9], "only the counted tokens are stored"
    assert draft_vocab_ids("x", 12, 3, path) == [3, 7, 9]
    assert draft_vocab_ids("x", 12, 5, path) == [0, 1, 3, 7, 9], "then id order"
    assert draft_vocab_ids("unknown-model", 12, 3) == [0, 1, 2], "no ranking: id order"
    with pytest.raises(ValueError, match="draft vocabulary size"):
        draft_vocab_ids("x", 12, 13)
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ValueError, match="adaserve draft-vocab"):
        load_ranking(tmp_path / "bad.json")


def test_restricted_head_gives_the_full_heads_logits_for_its_tokens(tiny_llama):
    model = load_model(tiny_llama, "float32", "cpu")
    hidden = torch.randn(5, model.args.hidden_size)
    full = model.compute_logits(hidden)
    ids = torch.tensor([2, 5, 11, 40, 95])
    model.restrict_head(ids)
    assert torch.allclose(model.compute_logits(hidden), full[:, ids], atol=1e-6)
    model.restrict_head(None)
    assert torch.equal(model.compute_logits(hidden), full)


def test_a_draft_with_a_reduced_head_proposes_only_its_tokens_and_stays_lossless(tiny_llama):
    prompts = [[5, 6, 7, 8], [9, 10, 11], [3, 4]]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 3

    def engine(policy: str, k: int | None) -> LLMEngine:
        return LLMEngine(
            ModelConfig(model=str(tiny_llama), draft_model=str(tiny_llama), draft_vocab_size=k),
            CacheConfig(block_size=4, num_blocks=128),
            SchedulerConfig(policy=policy),
        )

    def generate(e: LLMEngine) -> list[list[int]]:
        return run(e, prompts, params)[0]

    ref = generate(engine("incremental", None))
    spec = engine("adaserve_paper", 32)
    head = spec.engine.draft.model.head_token_ids
    assert head is not None and head.tolist() == list(range(32)), "the first 32 ids (no ranking)"
    proposed: set[int] = set()
    drafter = spec.scheduler.drafter
    real_propose = drafter.propose

    def spy(requests, shape, keep_going=None):
        trees = real_propose(requests, shape, keep_going)
        proposed.update(t for tree in trees for t in tree.tokens[1:])
        return trees

    drafter.propose = spy
    assert generate(spec) == ref, "a reduced draft head changed the output"
    assert proposed and proposed <= set(range(32)), f"tokens outside the head: {proposed}"
