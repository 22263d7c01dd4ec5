"""Files of a distillation run: resumable training checkpoints and the final draft dir.

The final draft is a standard Hugging Face checkpoint dir (config.json, bf16
model.safetensors with HF tensor names, the target's tokenizer files), so
`LLM(draft_model=DIR)`, `transformers` and any other runtime load it like any other model.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import IO, Any

import torch
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)
KEEP_CHECKPOINTS = 2


def latest_checkpoint(ckpt_dir: Path) -> Path | None:
    files = sorted(ckpt_dir.glob("step-*.pt"))
    return files[-1] if files else None


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Weights that training changes; frozen ones are rebuilt from the target on resume."""
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in model.state_dict().items() if n in names}


def save_checkpoint(
    ckpt_dir: Path,
    step: int,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    config: dict,
    history: list[dict],
) -> Path:
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    path = ckpt_dir / f"step-{step:07d}.pt"
    state = {
        "step": step,
        "model": trainable_state(model),
        "optimizer": opt.state_dict(),
        "scheduler": sched.state_dict(),
        "config": config,
        "history": history,
    }
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    tmp.rename(path)  # atomic: an interrupted save leaves the previous checkpoint as the latest
    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-KEEP_CHECKPOINTS]:
        old.unlink()
    return path


def load_checkpoint(
    path: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    sched: torch.optim.lr_scheduler.LRScheduler,
    config: dict,
    may_change: tuple[str, ...],
) -> dict:
    """Restore model/optimizer/schedule in place; refuse a checkpoint of another config."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    old = state["config"]
    diff = sorted(
        k for k in set(old) | set(config) if k not in may_change and old.get(k) != config.get(k)
    )
    if diff:
        raise ValueError(
            f"checkpoint {path} was trained with other settings ({', '.join(diff)}: "
            f"{[old.get(k) for k in diff]} vs {[config.get(k) for k in diff]}); "
            "use another --work-dir to start a new run"
        )
    missing = model.load_state_dict(state["model"], strict=False).missing_keys
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    if trainable & set(missing):
        raise ValueError(
            f"checkpoint {path} lacks trainable weights {sorted(trainable & set(missing))[:3]}"
        )
    opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])
    return state


def save_draft(model: nn.Module, target_dir: Path, out_dir: Path, meta: dict) -> Path:
    """Write `model` as a bf16 HF checkpoint dir with the target's tokenizer files."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    hf_config: Any = model.config  # a transformers config: its fields are not typed
    config["num_hidden_layers"] = hf_config.num_hidden_layers
    config["torch_dtype"] = "bfloat16"
    tied = bool(config.get("tie_word_embeddings", False))
    tensors = {
        name: t.detach().to("cpu", torch.bfloat16).contiguous()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight") and "rotary_emb" not in name
    }
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "distill.json").write_text(json.dumps(meta, indent=2))
    for name in TOKENIZER_FILES:
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


class TrainingRun:
    """The bookkeeping a trainer shares: resume from the latest checkpoint in `ckpt_dir`, then
    per optimizer step append the log line, move the progress bar and checkpoint every
    `save_every` steps, at the last one and when this call stops early (`stop_after` steps,
    `time_limit_s` seconds); the next call resumes from there."""

    def __init__(
        self,
        work_dir: Path,
        ckpt_dir: Path,
        log_name: str,
        desc: str,
        model: nn.Module,
        opt: torch.optim.Optimizer,
        sched: torch.optim.lr_scheduler.LRScheduler,
        config: dict,
        may_change: tuple[str, ...],
        total: int,
        save_every: int,
        stop_after: int | None,
        time_limit_s: float | None,
        progress: bool,
    ) -> None:
        self.ckpt_dir, self.model, self.opt, self.sched = ckpt_dir, model, opt, sched
        self.config, self.total, self.save_every = config, total, save_every
        self.stop_after, self.time_limit_s = stop_after, time_limit_s
        self.step, self.history = 0, []
        last = latest_checkpoint(ckpt_dir)
        if last is not None:
            state = load_checkpoint(last, model, opt, sched, config, may_change)
            self.step, self.history = state["step"], state["history"]
        work_dir.mkdir(parents=True, exist_ok=True)
        self.log: IO[str] = (work_dir / log_name).open("a")
        self.bar = tqdm(
            total=total, initial=self.step, unit="step", desc=desc, disable=not progress
        )
        self.started = time.monotonic()

    @property
    def finished(self) -> bool:
        return self.step >= self.total

    def record(self, entry: dict, **postfix: str) -> bool:
        """Book optimizer step `entry["step"]`; True when this call stops here early."""
        self.step = entry["step"]
        self.history.append(entry)
        self.log.write(json.dumps(entry) + "\n")
        self.log.flush()
        self.bar.update(1)
        self.bar.set_postfix(**postfix)
        interrupted = (self.stop_after is not None and self.step >= self.stop_after) or (
            self.time_limit_s is not None and time.monotonic() - self.started > self.time_limit_s
        )
        if self.step % self.save_every == 0 or self.step == self.total or interrupted:
            save_checkpoint(
                self.ckpt_dir,
                self.step,
                self.model,
                self.opt,
                self.sched,
                self.config,
                self.history,
            )
        return interrupted and not self.finished

    def close(self) -> None:
        self.bar.close()
        self.log.close()
