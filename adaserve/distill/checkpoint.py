"""Files of a distillation run: resumable training checkpoints and the final draft dir.

The final draft is a standard Hugging Face checkpoint dir (config.json, bf16
model.safetensors with HF tensor names, the target's tokenizer files), so
`LLM(draft_model=DIR)`, `transformers` and any other runtime load it like any other model.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

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
    config["num_hidden_layers"] = model.config.num_hidden_layers
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


def record_step(
    entry: dict,
    history: list[dict],
    log: IO[str],
    bar: tqdm,
    save: Callable[[], object],
    total: int,
    save_every: int,
    stop_after: int | None,
    time_limit_s: float | None,
    started: float,
    postfix: dict[str, str],
) -> bool:
    """A trainer's bookkeeping after optimizer step `entry["step"]`: history, log line,
    progress bar, a checkpoint every `save_every` steps, at the end and when this call stops.
    Returns True when the call stops here early (`stop_after` / `time_limit_s`); the next
    call resumes from that checkpoint."""
    step = entry["step"]
    history.append(entry)
    log.write(json.dumps(entry) + "\n")
    log.flush()
    bar.update(1)
    bar.set_postfix(**postfix)
    interrupted = (stop_after is not None and step >= stop_after) or (
        time_limit_s is not None and time.monotonic() - started > time_limit_s
    )
    if step % save_every == 0 or step == total or interrupted:
        save()
    return interrupted and step < total
