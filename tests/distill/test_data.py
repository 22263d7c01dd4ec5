"""Training-text generation: the grid split, shard contents, resuming without redoing work."""

from __future__ import annotations

import shutil
from dataclasses import replace

import pytest
import torch

import adaserve.distill.data as data_mod
from adaserve.distill.data import generate_shards, load_sequences, make_jobs
from adaserve.distill.prompts import PromptGrid
from adaserve.exec.loader import load_tokenizer
from tests.distill.conftest import TINY_GEN, TINY_GRID


def test_grid_holds_out_whole_topics() -> None:
    grid = PromptGrid()
    train, held = grid.split("train"), grid.split("eval")
    assert len(train) + len(held) == len(grid.all_prompts()), "the two splits must cover the grid"
    overlap = {p.topic for p in train} & {p.topic for p in held}
    assert not overlap, f"held-out topics {overlap} also appear in training prompts"
    assert [p.index for p in grid.split("train")] == [p.index for p in train], "split not stable"
    assert held[0].format == "", "held-out prompts should start with plain (unformatted) ones"


def test_jobs_cover_every_temperature_with_greedy_once() -> None:
    cfg = replace(TINY_GEN, samples_per_temperature=3, num_prompts=2)
    jobs = make_jobs(cfg, TINY_GRID, "train")
    assert len(jobs) == 2 * (1 + 3 + 3), (
        f"expected greedy once + 3 samples at 2 temps, got {len(jobs)}"
    )
    assert len({j.seed for j in jobs if j.temperature > 0}) == 2 * 6, "sample seeds must differ"
    assert all(j.temperature == 0.0 for j in make_jobs(cfg, TINY_GRID, "eval")), (
        "held-out prompts must be decoded greedily"
    )


def test_shards_hold_chat_prompt_plus_completion(tiny_target, tiny_data) -> None:
    _, train, held = tiny_data
    tok = load_tokenizer(tiny_target)
    n_train = len(make_jobs(TINY_GEN, TINY_GRID, "train"))
    assert len(train) == n_train, f"{len(train)} training sequences for {n_train} jobs"
    assert len(held) == TINY_GEN.eval_prompts
    first = TINY_GRID.split("train", TINY_GEN.seed)[0]
    want = tok.apply_chat_template(first.messages, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert train.tokens[0][: train.prompt_lens[0]].tolist() == want, (
        "prompt is not the chat template"
    )
    for t, p in zip(train.tokens, train.prompt_lens):
        assert p < len(t) <= p + TINY_GEN.max_new_tokens, "completion missing or over max tokens"


def test_generation_resumes_without_redoing_shards(tiny_target, tiny_data, tmp_path, monkeypatch):
    src, _, _ = tiny_data
    shutil.copytree(src, tmp_path / "data")
    files = sorted((tmp_path / "data").glob("*.pt"))
    assert len(files) >= 3, "the test needs several shards"
    before = {f.name: f.read_bytes() for f in files}
    files[1].unlink()  # as if the run had died while writing it

    generated = []
    real = data_mod._run_chunk

    def counting(llm, chunk, max_new_tokens):
        generated.append(len(chunk))
        yield from real(llm, chunk, max_new_tokens)

    monkeypatch.setattr(data_mod, "_run_chunk", counting)
    generate_shards(tiny_target, tmp_path / "data", TINY_GEN, TINY_GRID, progress=False)
    assert len(generated) == 1, f"resume regenerated {len(generated)} shards, expected only 1"
    redone = torch.load(files[1], weights_only=True)
    original = torch.load(src / files[1].name, weights_only=True)
    assert torch.equal(redone["tokens"], original["tokens"]), (
        "a regenerated shard differs: per-job seeds must make generation repeatable"
    )
    for f in files:
        if f != files[1]:
            assert f.read_bytes() == before[f.name], f"{f.name} was rewritten on resume"
    assert len(load_sequences(tmp_path / "data", "train")) == len(load_sequences(src, "train"))


def test_resume_with_other_settings_is_refused(tiny_target, tiny_data, tmp_path) -> None:
    src, _, _ = tiny_data
    shutil.copytree(src, tmp_path / "data")
    other = replace(TINY_GEN, max_new_tokens=TINY_GEN.max_new_tokens + 1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate_shards(tiny_target, tmp_path / "data", other, TINY_GRID, progress=False)
    faster = replace(TINY_GEN, batch_size=3)  # speed-only settings may change
    generate_shards(tiny_target, tmp_path / "data", faster, TINY_GRID, progress=False)


def test_time_limit_stops_between_shards(tiny_target, tmp_path) -> None:
    done = generate_shards(tiny_target, tmp_path, TINY_GEN, TINY_GRID, False, time_limit_s=0.0)
    assert not done and not list(tmp_path.glob("*.pt")), "a spent time limit must write no shard"
    assert generate_shards(tiny_target, tmp_path, TINY_GEN, TINY_GRID, False), "no limit: done"
