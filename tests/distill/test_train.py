"""Distillation training: the loss falls, agreement rises, resume is exact, the output serves."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open

from adaserve import LLM, SamplingParams
from adaserve.distill.cli import main as distill_main
from adaserve.distill.evaluate import load_causal_lm, model_agreement, top1_agreement
from adaserve.distill.train import TrainConfig, build_draft, train
from adaserve.exec.loader import check_draft_compatible

CFG = TrainConfig(num_layers=1, max_steps=30, batch_size=8, lr=3e-3, warmup_steps=3, save_every=10)


@pytest.fixture(scope="module")
def trained(tiny_target, tiny_data, tmp_path_factory):
    _, train_seqs, held = tiny_data
    work = tmp_path_factory.mktemp("work")
    res = train(tiny_target, train_seqs, work, work / "draft", CFG, held, progress=False)
    return res, work / "draft"


def test_training_reduces_kl_and_raises_agreement(tiny_target, tiny_data, trained) -> None:
    _, _, held = tiny_data
    res, _ = trained
    assert res.finished and res.step == CFG.max_steps, f"stopped at {res.step}/{CFG.max_steps}"
    first = sum(h["loss"] for h in res.history[:3]) / 3
    last = sum(h["loss"] for h in res.history[-3:]) / 3
    assert last < 0.6 * first, f"KL fell only from {first:.3f} to {last:.3f} in {res.step} steps"
    target = load_causal_lm(tiny_target)
    before = model_agreement(target, build_draft(target, CFG), held, "cpu")
    assert res.eval_agreement is not None and res.eval_agreement > before + 0.1, (
        f"held-out top-1 agreement went from {before:.3f} to {res.eval_agreement} only"
    )


def test_resume_continues_the_same_run(tiny_target, tiny_data, trained, tmp_path) -> None:
    train_seqs = tiny_data[1]
    straight, _ = trained
    first = train(
        tiny_target, train_seqs, tmp_path, tmp_path / "d", CFG, stop_after=12, progress=False
    )
    assert not first.finished and first.step == 12, "stop_after must end the call at step 12"
    assert not (tmp_path / "d").exists(), "an unfinished run must not write a draft dir"
    resumed = train(tiny_target, train_seqs, tmp_path, tmp_path / "d", CFG, progress=False)
    assert resumed.finished and [h["step"] for h in resumed.history] == list(range(1, 31)), (
        "the resumed run must continue from step 13, not restart or skip"
    )
    got = torch.tensor([h["loss"] for h in resumed.history])
    want = torch.tensor([h["loss"] for h in straight.history])
    assert torch.allclose(got, want, rtol=1e-4), (
        f"resumed loss curve diverges from the uninterrupted one at step "
        f"{int((~torch.isclose(got, want, rtol=1e-4)).nonzero()[0]) + 1}: optimizer or data "
        "order not restored"
    )
    with pytest.raises(ValueError, match="lr"):
        train(
            tiny_target, train_seqs, tmp_path, tmp_path / "d", replace(CFG, lr=1e-3), progress=False
        )


def test_draft_dir_is_a_standard_bf16_checkpoint(tiny_target, trained, tiny_data) -> None:
    _, draft = trained
    config = json.loads((draft / "config.json").read_text())
    assert config["num_hidden_layers"] == CFG.num_layers and config["torch_dtype"] == "bfloat16"
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert all(f.get_tensor(n).dtype == torch.bfloat16 for n in names), "weights not bf16"
    assert "model.layers.0.self_attn.q_proj.weight" in names, (
        f"not HF tensor names: {sorted(names)[:4]}"
    )
    assert "lm_head.weight" not in names, "tied embeddings must not be stored twice"
    check_draft_compatible(tiny_target, draft)  # raises if the tokenizer differs
    # The saved bf16 file scores what the trained model scored, up to bf16 rounding.
    saved = top1_agreement(tiny_target, draft, tiny_data[2])
    assert abs(saved - trained[0].eval_agreement) < 0.1, "saved draft differs from the trained one"


def test_distilled_draft_serves_losslessly(tiny_target, trained, tiny_data) -> None:
    _, draft = trained
    _, _, held = tiny_data
    prompts = [t[:p].tolist() for t, p in zip(held.tokens, held.prompt_lens)][:4]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    spec = LLM(str(tiny_target), draft_model=str(draft), policy="adaserve", budget=8)
    inc = LLM(str(tiny_target), policy="incremental")
    got = [o.outputs[0].token_ids for o in spec.generate(prompts, params)]
    want = [o.outputs[0].token_ids for o in inc.generate(prompts, params)]
    assert got == want, "greedy output with the distilled draft differs from incremental"


def test_cli_runs_every_phase(tiny_target, tmp_path, capsys) -> None:
    args = [str(tiny_target), "--work-dir", str(tmp_path / "w"), "--out", str(tmp_path / "d")]
    args += ["--num-prompts", "2", "--eval-prompts", "2", "--max-new-tokens", "8"]
    args += ["--max-steps", "3", "--draft-layers", "1", "--speed-prompts", "1", "--no-progress"]
    assert distill_main(args) == 0, "adaserve distill failed on a tiny target"
    report = json.loads((tmp_path / "w" / "eval.json").read_text())
    for key in ("top1_agreement", "accepted_per_iteration", "speedup"):
        assert key in report, f"eval report lacks {key}: {sorted(report)}"
    assert (tmp_path / "d" / "config.json").exists(), "no draft dir written"
    assert distill_main(args + ["--lr", "1"]) == 2, "a resume with another lr must be refused"
    assert "other settings" in capsys.readouterr().err


def test_layers_file_rebuilds_the_same_draft(tiny_target, trained, tmp_path) -> None:
    from adaserve.distill.ship import assemble_draft, export_layers

    _, draft = trained
    ship = export_layers(draft, tiny_target, tmp_path / "draft.layers.safetensors")
    with safe_open(str(ship), "pt") as f:
        assert "model.embed_tokens.weight" not in f.keys(), (
            "the layers file must omit the embedding"
        )
    rebuilt = assemble_draft(ship, tiny_target, tmp_path / "rebuilt")
    with safe_open(str(draft / "model.safetensors"), "pt") as a:
        with safe_open(str(rebuilt / "model.safetensors"), "pt") as b:
            assert set(a.keys()) == set(b.keys()), "rebuilt draft has other tensors"
            for n in a.keys():
                assert torch.equal(a.get_tensor(n), b.get_tensor(n)), f"{n} differs after rebuild"
    assert (rebuilt / "config.json").read_text() == (draft / "config.json").read_text()
    check_draft_compatible(tiny_target, rebuilt)
