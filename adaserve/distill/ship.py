"""Ship a distilled draft small: its own layers in the repository, the embedding from the target.

A draft trained with frozen (tied) embeddings carries the target's embedding matrix unchanged,
and for SmolLM2-135M that matrix alone is 49152 x 576 bf16 = 57 MB, more than the 32 MB a
repository should hold. `export_layers` writes every other tensor (decoder layers, final norm)
plus the config into one safetensors file (about 7 MB per layer); `assemble_draft` rebuilds the
full checkpoint dir from it and the target in seconds, bit for bit what training wrote.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adaserve.distill.checkpoint import TOKENIZER_FILES
from adaserve.exec.checkpoint_files import iter_safetensors, safetensor_files

SHARED = ("model.embed_tokens.weight", "lm_head.weight")


def _read(path: Path) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(safetensor_files(path)))


def export_layers(draft_dir: Path, target_dir: Path, out_file: Path) -> Path:
    """Write the draft minus the tensors it shares with the target; raise if it shares none."""
    draft, target = _read(draft_dir), _read(target_dir)
    for name in SHARED:
        if name in draft and not torch.equal(draft[name], target[name].to(draft[name].dtype)):
            raise ValueError(
                f"{name} of {draft_dir} differs from the target's (trained with "
                "--train-embeddings?); ship the whole draft dir instead"
            )
    own = {n: t.contiguous() for n, t in draft.items() if n not in SHARED}
    meta = {
        "config": (draft_dir / "config.json").read_text(),
        "target": Path(target_dir).name,
        "shared": json.dumps([n for n in SHARED if n in draft]),
        "dtype": str(next(iter(own.values())).dtype).removeprefix("torch."),
    }
    if (draft_dir / "distill.json").exists():
        meta["distill"] = (draft_dir / "distill.json").read_text()
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(own, str(out_file), metadata=meta)
    return out_file


def assemble_draft(layers_file: Path, target_dir: Path, out_dir: Path) -> Path:
    """Rebuild the draft checkpoint dir from an `export_layers` file and the target."""
    with safe_open(str(layers_file), framework="pt") as f:
        meta = f.metadata() or {}
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    if "config" not in meta:
        raise ValueError(f"{layers_file} was not written by export_layers (no config metadata)")
    dtype = getattr(torch, meta["dtype"])
    target = dict(iter_safetensors(safetensor_files(target_dir)))
    for name in json.loads(meta["shared"]):
        if name not in target:
            raise ValueError(f"target {target_dir} has no {name}: not the draft's target")
        tensors[name] = target[name].to(dtype).contiguous()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    (tmp / "config.json").write_text(meta["config"])
    if "distill" in meta:
        (tmp / "distill.json").write_text(meta["distill"])
    for name in TOKENIZER_FILES:
        if (Path(target_dir) / name).exists():
            shutil.copy(Path(target_dir) / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir
