"""EAGLE head training: the unrolled training forward is what serving computes, the loss
falls and held-out agreement rises, a resumed run continues the same curve, the CLI."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from adaserve import LLM, SamplingParams
from adaserve.distill.cli import main as distill_main
from adaserve.distill.eagle import (
    EagleConfig,
    causal_hidden,
    held_out_agreement,
    target_features,
    train_eagle,
    unrolled_outputs,
)
from adaserve.exec.attention.torch_ref import TorchAttentionBackend
from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.kv_cache import KVCache
from adaserve.exec.loader import load_model
from adaserve.exec.model.eagle import head_from_target, is_eagle_head, load_eagle_head
from adaserve.exec.torch_runner import EagleRunner

CFG = EagleConfig(max_steps=30, batch_size=8, lr=3e-3, warmup_steps=3, save_every=10, max_len=64)


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def feats(target, tiny_data):
    _, train_seqs, held = tiny_data
    with torch.no_grad():
        return target_features(target, train_seqs, 64), target_features(target, held, 64)


@pytest.fixture(scope="module")
def trained(target, tiny_data, feats, tmp_path_factory):
    _, train_seqs, held = tiny_data
    work = tmp_path_factory.mktemp("eagle_work")
    res = train_eagle(
        target, None, train_seqs, feats[0], work, work / "head", CFG, (held, feats[1]),
        progress=False,
    )  # fmt: skip
    return res, work / "head"


def test_features_are_the_models_final_hidden_states(target, tiny_data) -> None:
    seqs = tiny_data[1]
    with torch.no_grad():
        got = target_features(target, seqs, 64)
        for i in (0, len(seqs) - 1):
            ids = seqs.tokens[i][:64][None].long()
            want = causal_hidden(target, ids)[0]
            assert torch.allclose(got[i].float(), want, atol=1e-2), f"sequence {i}"


def test_the_unrolled_training_forward_is_what_drafting_computes(target) -> None:
    """Step s's row t in training equals the serving head's depth-s row after the committed
    rows 0..t-s+1, fed through its paged KV exactly as the drafter does."""
    torch.manual_seed(0)
    head = head_from_target(target)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(2, 90, (1, 12))
    f = torch.randn(1, 12, target.args.hidden_size)
    with torch.no_grad():
        outs = unrolled_outputs(head, ids, f, steps=3)
    a = head.args
    cache = KVCache(1, 16, 4, a.num_kv_heads, a.head_dim, torch.float32, torch.device("cpu"))
    runner = EagleRunner(head, cache, TorchAttentionBackend(cache))
    for t in (3, 6, 10):
        for s in (1, 2, 3):
            c = t - s + 1  # last committed row
            table: list[int] = []
            cache.reserve(table, t + 1)
            b = SequenceBatchBuilder()
            b.add(ids[0, 1 : c + 2].tolist(), list(range(c + 1)), c + 1, table)
            b.batch.features = f[0, : c + 1]
            runner.forward(b.batch)
            h = runner.last_hidden[-1]
            for depth in range(2, s + 1):  # each drafted row reads its parent's output
                row = c + depth - 1
                b = SequenceBatchBuilder()
                b.add([int(ids[0, row + 1])], [row], row + 1, table)
                b.batch.features = h[None]
                runner.forward(b.batch)
                h = runner.last_hidden[-1]
            cache.release(table)
            assert torch.allclose(h, outs[s - 1][0, t], atol=1e-4), f"row {t}, step {s}"


def test_training_lowers_the_loss_and_raises_held_out_agreement(
    target, tiny_data, feats, trained
) -> None:
    res, head_dir = trained
    assert res.finished and res.step == CFG.max_steps
    first = sum(h["loss"] for h in res.history[:3]) / 3
    last = sum(h["loss"] for h in res.history[-3:]) / 3
    assert last < 0.85 * first, f"loss fell only from {first:.3f} to {last:.3f}"
    held = tiny_data[2]
    before = held_out_agreement(head_from_target(target), held, feats[1], 64)
    assert res.agreement is not None and res.agreement[0] > before[0] + 0.1, (
        f"depth-1 agreement {before[0]:.3f} -> {res.agreement[0]:.3f}"
    )
    assert is_eagle_head(head_dir)
    loaded = load_eagle_head(head_dir, target)
    assert sum(p.numel() for p in loaded.parameters()) < sum(
        p.numel() for p in target.parameters()
    ), "the head stores more than its own tensors"


def test_a_resumed_run_continues_the_same_loss_curve(
    target, tiny_data, feats, trained, tmp_path
) -> None:
    train_seqs = tiny_data[1]
    straight, _ = trained
    first = train_eagle(
        target, None, train_seqs, feats[0], tmp_path, tmp_path / "h", CFG, stop_after=12,
        progress=False,
    )  # fmt: skip
    assert not first.finished and first.step == 12
    assert not (tmp_path / "h").exists(), "an unfinished run must not write a head"
    resumed = train_eagle(
        target, None, train_seqs, feats[0], tmp_path, tmp_path / "h", CFG, progress=False
    )
    assert [h["step"] for h in resumed.history] == list(range(1, 31))
    got = torch.tensor([h["loss"] for h in resumed.history])
    want = torch.tensor([h["loss"] for h in straight.history])
    assert torch.allclose(got, want, rtol=1e-4), "resumed loss curve diverges"
    with pytest.raises(ValueError, match="lr"):
        train_eagle(
            target, None, train_seqs, feats[0], tmp_path, tmp_path / "h", replace(CFG, lr=1e-2),
            progress=False,
        )  # fmt: skip


def test_the_trained_head_serves_losslessly(tiny_target, trained, tiny_data) -> None:
    _, head_dir = trained
    prompts = [t[:p].tolist() for t, p in zip(tiny_data[2].tokens, tiny_data[2].prompt_lens)]
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ref = LLM(model=str(tiny_target), policy="incremental").generate(prompts, sp)
    llm = LLM(model=str(tiny_target), draft_model=str(head_dir), policy="adaserve_paper", budget=8)
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    assert accepted > 0, "the trained head got nothing accepted"


def test_cli_trains_a_head(tiny_target, tiny_data, tmp_path, capsys) -> None:
    data_dir = tiny_data[0]
    args = [str(tiny_target), "--method", "eagle", "--phase", "train", "--no-progress"]
    args += ["--data-dir", str(data_dir), "--work-dir", str(tmp_path / "w")]
    args += ["--out", str(tmp_path / "h"), "--max-steps", "3", "--max-len", "64"]
    assert distill_main(args) == 0
    assert is_eagle_head(tmp_path / "h")
    config = json.loads((tmp_path / "h" / "config.json").read_text())
    assert config["adaserve_eagle_training"]["steps"] == 3
    assert "agreement at depth 1..4" in capsys.readouterr().out
    ev = [a if a != "train" else "eval" for a in args] + ["--speed-prompts", "2"]
    ev += ["--speed-max-tokens", "8", "--budget", "16"]
    assert distill_main(ev) == 0
    report = json.loads((tmp_path / "w" / "eagle_eval.json").read_text())
    assert len(report["top1_agreement_by_depth"]) == 4
    for key in ("accepted_per_iteration_b8", "accepted_per_iteration_b16", "speedup"):
        assert key in report, sorted(report)
