"""Weights in: Hugging Face checkpoint dirs (one or sharded safetensors) and GGUF files.

A GGUF file is converted once into a checkpoint dir in the cache (dequantized weights as
safetensors, config.json, tokenizer files) and loaded from there like any other dir.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from adaserve.exec.checkpoint_files import (
    GGUF_SOURCE,
    convert_gguf,
    iter_safetensors,
    safetensor_files,
)
from adaserve.exec.default_model import default_gguf_file, default_model_dir
from adaserve.exec.model.llama import (
    SUPPORTED_ARCHITECTURES,
    LlamaArgs,
    LlamaForCausalLM,
    rope_inv_freq,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A checkpoint dir for `model`: None -> default model; .gguf -> its converted dir."""
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path)
    if not path.exists():
        raise FileNotFoundError(
            f"model path {str(path)!r} does not exist; give a local Hugging Face checkpoint dir "
            "(config.json + *.safetensors) or a .gguf file (adaserve does not download from a hub)"
        )
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is neither a checkpoint dir nor a .gguf file")
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{str(path)!r} has no config.json: not a Hugging Face checkpoint dir"
        )
    return path


def load_args(path: Path) -> LlamaArgs:
    from transformers import AutoConfig

    with open(path / "config.json") as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0]!r} in {path}; adaserve runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return LlamaArgs.from_hf_config(AutoConfig.from_pretrained(path))


def load_model(path: Path, dtype: str = "float32", device: str = "cpu") -> LlamaForCausalLM:
    """Build our model from a checkpoint dir and load its weights."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    args = load_args(path)
    files = safetensor_files(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model = model.to_empty(device=device).to(DTYPES[dtype])
    # to_empty left the RoPE buffer uninitialised, and it must stay float32 whatever the dtype.
    model.inv_freq = rope_inv_freq(args).to(device)
    model.load_weights(iter_safetensors(files))
    return model.eval()


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def generation_eos_ids(path: Path) -> tuple[int, ...]:
    """The end-of-sequence ids a checkpoint's generation_config.json names, as transformers'
    `generate()` stops on them (Llama 3 Instruct ends a turn with <|eot_id|>, which is not the
    tokenizer's eos_token); () without the file."""
    if not (path / "generation_config.json").is_file():
        return ()
    from transformers import GenerationConfig

    eos = GenerationConfig.from_pretrained(path).eos_token_id
    if eos is None:
        return ()
    return (int(eos),) if isinstance(eos, int) else tuple(int(t) for t in eos)


def check_draft_compatible(target_path: Path, draft_path: Path) -> None:
    """The draft must share the target's vocabulary, or its tokens mean something else."""
    t_args, d_args = load_args(target_path), load_args(draft_path)
    if t_args.vocab_size != d_args.vocab_size:
        raise ValueError(
            f"draft vocabulary size {d_args.vocab_size} differs from the target's "
            f"{t_args.vocab_size}; the draft must use the target's tokenizer"
        )
    has_tok = [
        any((p / n).exists() for n in ("tokenizer.json", "tokenizer.model"))
        for p in (target_path, draft_path)
    ]
    if (
        all(has_tok)
        and load_tokenizer(target_path).get_vocab() != load_tokenizer(draft_path).get_vocab()
    ):
        raise ValueError(
            f"draft tokenizer at {draft_path} differs from the target's at {target_path}"
        )


def gguf_source(model: str | os.PathLike | None, path: Path) -> Path | None:
    """The GGUF file behind a model (None: none known): the model itself when it is a .gguf
    file, the default model's download, or the file a converted dir records."""
    if model is not None and Path(model).expanduser().suffix == ".gguf":
        return Path(model).expanduser().resolve()
    if model is None:
        return default_gguf_file()
    marker = path / GGUF_SOURCE
    if marker.exists():
        with open(marker) as f:
            source = Path(json.load(f)["gguf"])
        return source if source.exists() else None
    return None


def load_embedding_and_head(path: Path):
    """Just a checkpoint's token embedding and LM head (float32, CPU), with its args: what an
    EAGLE head beside a target that torch does not run (ggml) borrows from the target."""
    from types import SimpleNamespace

    args = load_args(path)
    want = {"model.embed_tokens.weight", "lm_head.weight"}
    found = {n: t for n, t in iter_safetensors(safetensor_files(path)) if n in want}
    if "model.embed_tokens.weight" not in found:
        raise ValueError(f"{path} has no model.embed_tokens.weight")
    embed = torch.nn.Embedding.from_pretrained(found["model.embed_tokens.weight"].float())
    head = None
    if not args.tie_word_embeddings:
        head = torch.nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        head.weight = torch.nn.Parameter(found["lm_head.weight"].float(), requires_grad=False)
    return SimpleNamespace(args=args, embed_tokens=embed, lm_head=head)
