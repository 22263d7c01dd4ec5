"""Distil the target into a small draft of the same family that shares its tokenizer.

    loss = (1 / N) * sum_i KL(p_target(. | x_<=i) || p_draft(. | x_<=i)),   temperature 1,

over every real (non-padding) position i of every sequence. Target logits are computed on the
fly (no KV cache, full sequences). The draft keeps the target's hidden size so it can share the
embedding/LM head, which is most of a small model's parameters and is frozen by default.

Resumable: every `save_every` steps a checkpoint (trainable weights, AdamW and LR-schedule
state, history) goes to `work_dir/checkpoints`; the data order is a pure function of
(seed, epoch), so a resumed run sees exactly the micro-batches the uninterrupted one would.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.distill.checkpoint import TrainingRun, save_draft
from adaserve.distill.data import Sequences
from adaserve.distill.evaluate import (
    autocast,
    load_causal_lm,
    logits_at,
    model_agreement,
    pad_batch,
)

# Settings that do not change the training trajectory: a resume may change them.
_RESUMABLE_CHANGES = ("save_every", "eval_every", "device")


@dataclass(frozen=True)
class TrainConfig:
    num_layers: int = 2
    # Target layers copied into the draft's layers; None: `default_init_layers`; (): random init.
    init_layers: tuple[int, ...] | None = None
    freeze_embeddings: bool = True
    epochs: float = 1.0
    max_steps: int | None = None  # optimizer steps; overrides epochs
    batch_size: int = 8  # sequences per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    lr: float = 3e-4
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_len: int = 512  # longer sequences are truncated
    seed: int = 0
    save_every: int = 100
    eval_every: int = 0  # held-out agreement every N steps (0: only at the end)
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "batch_size", "grad_accum", "max_len", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(
                f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, {self.min_lr_ratio}"
            )
        if self.init_layers and len(self.init_layers) != self.num_layers:
            raise ValueError(
                f"init_layers names {len(self.init_layers)} target layers for a "
                f"{self.num_layers}-layer draft; give exactly {self.num_layers} (or none)"
            )


@dataclass
class TrainResult:
    step: int
    total_steps: int
    finished: bool
    history: list[dict] = field(default_factory=list)  # one entry per optimizer step
    eval_agreement: float | None = None


def default_init_layers(num_target_layers: int, num_layers: int) -> tuple[int, ...]:
    """The target's first `num_layers` layers."""
    # Measured on SmolLM2-135M before training: layers (0,) and (0, 1) agree with the target on
    # 6% and 4% of held-out tokens, any choice with its last layer on under 1% (that layer
    # expects the residual stream after 29 layers, not after one).
    return tuple(range(min(num_layers, num_target_layers)))


def build_draft(target: nn.Module, cfg: TrainConfig) -> nn.Module:
    """A `cfg.num_layers` copy of the target's architecture, initialised from the target."""
    from transformers import AutoModelForCausalLM

    # A transformers *ForCausalLM: its config and submodules are attributes mypy cannot see.
    hf: Any = target
    n_target = hf.config.num_hidden_layers
    init = cfg.init_layers
    if init is None:
        init = default_init_layers(n_target, cfg.num_layers)
    if any(not 0 <= i < n_target for i in init):
        raise ValueError(f"init_layers {init} out of range: the target has {n_target} layers")
    config = replace_config(hf.config, num_hidden_layers=cfg.num_layers)
    torch.manual_seed(cfg.seed)
    draft = AutoModelForCausalLM.from_config(config).to(torch.float32)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(hf.model.embed_tokens.weight)
        draft.model.norm.load_state_dict(hf.model.norm.state_dict())
        if not config.tie_word_embeddings:
            draft.lm_head.weight.copy_(hf.lm_head.weight)
        for mine, theirs in zip(draft.model.layers, init):
            mine.load_state_dict(hf.model.layers[theirs].state_dict())
    if cfg.freeze_embeddings:
        draft.model.embed_tokens.weight.requires_grad_(False)
        draft.lm_head.weight.requires_grad_(False)
    return draft.to(cfg.device).train()


def replace_config(config, **changes):
    new = config.__class__.from_dict(config.to_dict())
    for k, v in changes.items():
        setattr(new, k, v)
    return new


def epoch_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """Micro-batches of sequence indices for one epoch: shuffled, similar lengths together."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(lengths), generator=g).tolist()
    window = batch_size * 32  # sort within windows: little padding, order still random
    batches = []
    for i in range(0, len(perm), window):
        chunk = sorted(perm[i : i + window], key=lambda j: lengths[j])
        batches += [chunk[k : k + batch_size] for k in range(0, len(chunk), batch_size)]
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def kl_loss(
    target: nn.Module, draft: nn.Module, ids: torch.Tensor, mask: torch.Tensor, device: str
) -> tuple[torch.Tensor, int, int]:
    """(sum over real positions of KL(target || draft), positions, top-1 agreements)."""
    with torch.no_grad(), autocast(device):
        t_logp = F.log_softmax(logits_at(target, ids, mask).float(), dim=-1)  # [N, V]
    with autocast(device):
        d_logits = logits_at(draft, ids, mask)
    d_logp = F.log_softmax(d_logits.float(), dim=-1)  # [N, V]
    # kl_div(input=log q, target=log p) = sum p * (log p - log q): KL(p || q), p the target.
    loss = F.kl_div(d_logp, t_logp, log_target=True, reduction="sum")
    agree = int((t_logp.argmax(-1) == d_logp.argmax(-1)).sum())
    return loss, len(t_logp), agree


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


class OrderConfig(Protocol):
    """What EpochOrder reads of a run's config (TrainConfig, or eagle.py's EagleConfig)."""

    @property
    def batch_size(self) -> int: ...

    @property
    def max_len(self) -> int: ...

    @property
    def seed(self) -> int: ...


class EpochOrder:
    """Micro-batch `m` of the run (over all epochs) as sequence indices; keeps one epoch."""

    def __init__(self, data: Sequences, cfg: OrderConfig) -> None:
        self.lengths = [min(len(t), cfg.max_len) for t in data.tokens]
        self.cfg, self.per_epoch = cfg, math.ceil(len(data) / cfg.batch_size)
        self.epoch, self.batches = -1, [[0]]

    def __getitem__(self, micro: int) -> list[int]:
        epoch, i = divmod(micro, self.per_epoch)
        if epoch != self.epoch:
            self.epoch = epoch
            self.batches = epoch_batches(self.lengths, self.cfg.batch_size, self.cfg.seed, epoch)
        return self.batches[i]


def _optimizer_step(
    target: nn.Module,
    draft: nn.Module,
    data: Sequences,
    order: EpochOrder,
    step: int,
    cfg: TrainConfig,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
) -> dict:
    """Accumulate `grad_accum` micro-batches, clip, step; returns the step's log entry."""
    t0, loss_sum, n_pos, n_agree = time.monotonic(), 0.0, 0, 0
    for k in range(cfg.grad_accum):
        seqs = [data.tokens[j] for j in order[step * cfg.grad_accum + k]]
        ids, mask = pad_batch(seqs, cfg.device, cfg.max_len)
        loss, n, agree = kl_loss(target, draft, ids, mask, cfg.device)
        (loss / n / cfg.grad_accum).backward()  # mean KL per position within a micro-batch
        loss_sum, n_pos, n_agree = loss_sum + float(loss.detach()), n_pos + n, n_agree + agree
    params = [p for p in draft.parameters() if p.requires_grad]
    torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    return {
        "step": step + 1,
        "loss": loss_sum / n_pos,
        "agreement": n_agree / n_pos,
        "lr": sched.get_last_lr()[0],
        "tokens_per_s": n_pos / (time.monotonic() - t0),
    }


def train(
    target_dir: Path,
    data: Sequences,
    work_dir: Path,
    out_dir: Path,
    cfg: TrainConfig,
    held_out: Sequences | None = None,
    stop_after: int | None = None,
    time_limit_s: float | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train (or resume) and write the draft to `out_dir` once all steps are done.

    `stop_after` / `time_limit_s` end this call early with a checkpoint, as an interruption
    would; the next call resumes. Neither changes the schedule.
    """
    if len(data) == 0:
        raise ValueError("no training sequences: run `adaserve distill --phase generate` first")
    dev = cfg.device
    if dev.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
    target = load_causal_lm(
        target_dir, dev, torch.bfloat16 if dev.startswith("cuda") else torch.float32
    )
    target.requires_grad_(False)
    draft = build_draft(target, cfg)
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(data) / cfg.batch_size)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch / cfg.grad_accum))
    # The data set is part of the run: a resume over other data would silently change it.
    run_config = {**asdict(cfg), "data_sequences": len(data), "data_tokens": data.num_tokens}
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total, cfg.warmup_steps, cfg.min_lr_ratio)
    )
    run = TrainingRun(
        work_dir,
        work_dir / "checkpoints",
        "train_log.jsonl",
        "distill",
        draft,
        opt,
        sched,
        run_config,
        _RESUMABLE_CHANGES,
        total,
        cfg.save_every,
        stop_after,
        time_limit_s,
        progress,
    )
    result = TrainResult(step=run.step, total_steps=total, finished=False, history=run.history)
    order = EpochOrder(data, cfg)
    while not run.finished:
        entry = _optimizer_step(target, draft, data, order, run.step, cfg, opt, sched)
        if held_out is not None and cfg.eval_every and entry["step"] % cfg.eval_every == 0:
            entry["eval_agreement"] = model_agreement(target, draft, held_out, dev)
        if run.record(entry, loss=f"{entry['loss']:.3f}", agree=f"{entry['agreement']:.2f}"):
            break
    run.close()
    result.step = run.step
    result.finished = result.step >= total
    if result.finished:
        if held_out is not None:
            result.eval_agreement = model_agreement(target, draft, held_out, dev)
        meta = {
            "target": Path(target_dir).name,
            "steps": result.step,
            "train_config": asdict(cfg),
            "final_loss": result.history[-1]["loss"] if result.history else None,
            "eval_agreement": result.eval_agreement,
        }
        save_draft(draft, target_dir, out_dir, meta)
    return result
