"""How good is a draft: top-1 agreement with the target, and what it buys under adaserve.

Agreement is counted at the positions that predict completion tokens (the last prompt token
through the second-to-last token), because those are the positions a draft proposes at while
serving; prompt positions are prefill and never drafted.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from adaserve.distill.data import Sequences


def load_causal_lm(
    path: Path, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> nn.Module:
    """A Hugging Face *ForCausalLM in eval mode (training-side view of a checkpoint dir)."""
    from transformers import AutoModelForCausalLM

    model: nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def autocast(device: str):
    """bf16 autocast on CUDA (tensor cores); CPU runs float32 as it is."""
    if device.startswith("cuda"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def pad_batch(
    tokens: list[torch.Tensor], device: str, max_len: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] int64 and a mask [B, T] bool of real tokens.

    Right padding needs no attention mask under a causal model: a real token never sees the
    pads, which all come after it.
    """
    tokens = [t[:max_len] if max_len else t for t in tokens]
    width = max(len(t) for t in tokens)
    ids = torch.zeros(len(tokens), width, dtype=torch.long)
    mask = torch.zeros(len(tokens), width, dtype=torch.bool)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = t
        mask[i, : len(t)] = True
    return ids.to(device), mask.to(device)


def logits_at(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Logits [N, vocab] at the N masked positions only (no LM-head work on padding)."""
    body, lm_head = model.get_submodule("model"), model.get_submodule("lm_head")
    hidden = body(input_ids=ids, use_cache=False).last_hidden_state  # [B, T, H]
    return lm_head(hidden[mask])


@torch.no_grad()
def model_agreement(
    target: nn.Module, draft: nn.Module, seqs: Sequences, device: str, batch_size: int = 8
) -> float:
    """Fraction of completion-predicting positions where argmax draft == argmax target."""
    was_training = draft.training
    draft.eval()
    agree = total = 0
    for i in range(0, len(seqs), batch_size):
        toks = seqs.tokens[i : i + batch_size]
        ids, mask = pad_batch(toks, device)
        scored = torch.zeros_like(mask)
        for row, (t, p) in enumerate(zip(toks, seqs.prompt_lens[i : i + batch_size])):
            scored[row, max(p - 1, 0) : len(t) - 1] = True
        if not scored.any():
            continue
        with autocast(device):
            t_top = logits_at(target, ids, scored).argmax(-1)
            d_top = logits_at(draft, ids, scored).argmax(-1)
        agree += int((t_top == d_top).sum())
        total += len(t_top)
    draft.train(was_training)
    if total == 0:
        raise ValueError("no completion tokens to score: the held-out sequences are all prompt")
    return agree / total


def top1_agreement(
    target_dir: Path, draft_dir: Path, held_out: Sequences, device: str = "cpu"
) -> float:
    """Top-1 agreement of two checkpoint dirs on held-out sequences (see `model_agreement`)."""
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    target = load_causal_lm(target_dir, device, dtype)
    draft = load_causal_lm(draft_dir, device, dtype)
    return model_agreement(target, draft, held_out, device)


def speculation_stats(
    target_dir: Path | None,
    draft_dir: Path,
    prompts: list[list[int]],
    budget: int = 8,
    max_tokens: int = 64,
    device: str = "cpu",
    repeats: int = 1,
    policy: str = "adaserve",
) -> dict[str, float]:
    """`policy` (budget B, one request at a time, greedy) against incremental on `prompts`.

    Returns accepted tokens per iteration (draft tokens only, the bonus token not counted),
    tokens per iteration (with it), and output tokens/s of both policies. The two policies
    run alternately `repeats` times and the best run of each counts, so a passing load on a
    shared machine hurts both alike.
    """
    from adaserve.llm import LLM
    from adaserve.request_manager.request import SamplingParams

    model = None if target_dir is None else str(target_dir)
    spec = LLM(model, draft_model=str(draft_dir), policy=policy, budget=budget, device=device)
    inc = LLM(model, policy="incremental", device=device)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    spec.generate(prompts[0], SamplingParams(max_tokens=4))  # warm-up
    inc.generate(prompts[0], SamplingParams(max_tokens=4))
    best = {"adaserve": 0.0, "incremental": 0.0}
    accepted = iterations = emitted = 0
    for rep in range(repeats):
        for name, llm in (("incremental", inc), ("adaserve", spec)):
            tokens, start = 0, time.perf_counter()
            for p in prompts:  # one request at a time: the 1-concurrent-request case
                out = llm.generate([p], params)[0]
                tokens += len(out.outputs[0].token_ids)
                if name == "adaserve" and rep == 0:
                    accepted += out.metrics.num_accepted_tokens
                    iterations += out.metrics.num_iterations
                    emitted += len(out.outputs[0].token_ids) - 1  # first token is prefill's
            best[name] = max(best[name], tokens / (time.perf_counter() - start))
    return {
        "accepted_per_iteration": accepted / max(iterations, 1),
        "tokens_per_iteration": emitted / max(iterations, 1),
        "adaserve_tokens_per_s": best["adaserve"],
        "incremental_tokens_per_s": best["incremental"],
        "speedup": best["adaserve"] / best["incremental"],
    }
