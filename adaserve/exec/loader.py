"""Weights in: Hugging Face checkpoint dirs (one or sharded safetensors), GGUF files, and
either of them by hub id (`hub.py`).

`locate_model` finds a model's files; `checkpoint_dir` gives the dir everything else reads.
A GGUF file gets a dir in the cache once (config.json and tokenizer from its metadata); its
weights are dequantized into it only for the torch backend (llama.cpp runs the file itself).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from adaserve.exec.checkpoint_files import (
    GGUF_SOURCE,
    TOKENIZER_ERROR,
    convert_gguf,
    gguf_embedding_and_head,
    has_weights,
    iter_safetensors,
    safetensor_files,
)
from adaserve.exec.default_model import default_gguf_file, default_model_dir
from adaserve.exec.hub import (
    download_checkpoint,
    download_gguf,
    download_tokenizer,
    looks_like_repo_id,
)
from adaserve.exec.model.llama import (
    SUPPORTED_ARCHITECTURES,
    LlamaArgs,
    LlamaForCausalLM,
    rope_inv_freq,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def locate_model(
    model: str | os.PathLike | None, revision: str | None = None, gguf_file: str | None = None
) -> Path:
    """Where a model's files are, nothing converted: a checkpoint dir or a .gguf file.

    None: the default model's dir. A local dir or .gguf file as it is (`gguf_file`: that file
    in the dir). Anything else must be a hub id (owner/name): its snapshot in the hub cache,
    downloaded first unless HF_HUB_OFFLINE is set.
    """
    if model is None:
        return default_model_dir()
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(
                f"revision {revision!r} picks a version of a hub model; {str(path)!r} is local"
            )
        return _local_model(path, gguf_file)
    name = str(model)
    if not looks_like_repo_id(name):
        raise FileNotFoundError(
            f"model path {name!r} does not exist, and it is not a Hugging Face hub id "
            "(owner/name); give a local checkpoint dir (config.json + *.safetensors), a .gguf "
            "file, or a hub id such as meta-llama/Llama-3.1-8B-Instruct"
        )
    if gguf_file is not None:
        return download_gguf(name, revision, gguf_file)
    return download_checkpoint(name, revision)


def _local_model(path: Path, gguf_file: str | None) -> Path:
    if gguf_file is not None:
        if not (path / gguf_file).is_file():
            found = sorted(p.name for p in path.glob("*.gguf")) if path.is_dir() else []
            raise FileNotFoundError(
                f"{str(path)!r} has no {gguf_file!r} (GGUF files there: {found or 'none'})"
            )
        return path / gguf_file
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir():
        raise ValueError(f"model path {str(path)!r} is neither a checkpoint dir nor a .gguf file")
    if not (path / "config.json").exists():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; to serve one of its GGUF files name it with gguf_file: {ggufs}" if ggufs else ""
        raise FileNotFoundError(
            f"{str(path)!r} has no config.json: not a Hugging Face checkpoint dir{hint}"
        )
    return path


def checkpoint_dir(source: Path, weights: bool = True) -> Path:
    """A checkpoint dir for a located model: a dir as it is; for a GGUF file, its dir in the
    cache (config and tokenizer; dequantized weights only with `weights`: torch needs them,
    llama.cpp reads the GGUF itself)."""
    if source.is_file():
        return convert_gguf(source, weights=weights)
    return source


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A checkpoint dir with weights for `model` (None: the default model; a .gguf file: its
    converted dir; a hub id: its snapshot)."""
    return checkpoint_dir(locate_model(model))


def locate_tokenizer(tokenizer: str) -> Path:
    """A dir holding the tokenizer a `tokenizer` override names: a local dir, or a hub id's
    tokenizer files (its default branch)."""
    path = Path(tokenizer).expanduser()
    if path.is_dir():
        return path
    if not looks_like_repo_id(tokenizer):
        raise FileNotFoundError(
            f"tokenizer {tokenizer!r} is neither a local dir nor a Hugging Face hub id (owner/name)"
        )
    return download_tokenizer(tokenizer)


def load_args(path: Path, trust_remote_code: bool = False) -> LlamaArgs:
    from transformers import AutoConfig

    with open(path / "config.json") as f:
        raw = json.load(f)
    archs = raw.get("architectures") or []
    if not archs and raw.get("gguf_architecture"):
        return gguf_only_args(raw)
    if archs and archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0]!r} in {path}; adaserve runs "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return LlamaArgs.from_hf_config(config)


def gguf_only_args(raw: dict) -> LlamaArgs:
    """The numbers a GGUF of an architecture only llama.cpp runs gives (context length, KV
    sizing, vocabulary): enough for the ggml backend, never for this package's model."""
    return LlamaArgs(
        architecture=f"gguf:{raw['gguf_architecture']}",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=raw["num_attention_heads"],
        num_kv_heads=raw["num_key_value_heads"],
        head_dim=raw["head_dim"],
        rms_norm_eps=raw["rms_norm_eps"],
        max_position_embeddings=raw["max_position_embeddings"],
        rope_theta=float(raw["rope_theta"]),
        rope_scaling=None,
        qkv_bias=False,
        tie_word_embeddings=raw["tie_word_embeddings"],
        # (llama.cpp applies a model's sliding window itself: no limit to impose here.)
        sliding_window=None,
    )


def load_model(
    path: Path, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False
) -> LlamaForCausalLM:
    """Build our model from a checkpoint dir and load its weights."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
    args = load_args(path, trust_remote_code)
    files = safetensor_files(path)
    with torch.device("meta"):
        model = LlamaForCausalLM(args)
    model = model.to_empty(device=device).to(DTYPES[dtype])
    # to_empty left the RoPE buffer uninitialised, and it must stay float32 whatever the dtype.
    model.inv_freq = rope_inv_freq(args).to(device)
    model.load_weights(iter_safetensors(files))
    return model.eval()


def load_tokenizer(path: Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    failed = path / TOKENIZER_ERROR
    if failed.exists():
        raise FileNotFoundError(
            f"transformers could not build a tokenizer from the GGUF file behind {path} "
            f"({failed.read_text().strip()}); name one with tokenizer (--tokenizer DIR_OR_HUB_ID)"
        )
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if (path / GGUF_SOURCE).exists() and getattr(tok, "clean_up_tokenization_spaces", False):
        # A GGUF's text is what llama.cpp detokenizes, with no clean-up of spaces before
        # punctuation; some transformers versions (5.17) turn it on for a tokenizer built from
        # GGUF metadata, which also forces whole-output decoding on every iteration
        # (request_manager/output.py streams only without it).
        tok.clean_up_tokenization_spaces = False
    return tok


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


def gguf_source(source: Path, is_default: bool = False) -> Path | None:
    """The GGUF file behind a located model (None: none known): the model itself when it is
    a .gguf file, the default model's download, or the file a converted dir records."""
    if source.is_file() and source.suffix == ".gguf":
        return source.absolute()
    if is_default:
        return default_gguf_file()
    marker = source / GGUF_SOURCE
    if marker.exists():
        with open(marker) as f:
            recorded = Path(json.load(f)["gguf"])
        return recorded if recorded.exists() else None
    return None


def load_embedding_and_head(path: Path):
    """Just a checkpoint's token embedding and LM head (float32, CPU), with its args: what an
    EAGLE head beside a target that torch does not run (ggml) borrows from the target."""
    from types import SimpleNamespace

    args = load_args(path)
    want = {"model.embed_tokens.weight", "lm_head.weight"}
    gguf = None if has_weights(path) else gguf_source(path)
    if gguf is not None:  # a GGUF dir without weights (ggml): dequantize just these two
        found = gguf_embedding_and_head(gguf)
    else:
        found = {n: t for n, t in iter_safetensors(safetensor_files(path)) if n in want}
    if "model.embed_tokens.weight" not in found:
        raise ValueError(f"{path} has no model.embed_tokens.weight")
    embed = torch.nn.Embedding.from_pretrained(found["model.embed_tokens.weight"].float())
    head = None
    if not args.tie_word_embeddings:
        head = torch.nn.Linear(args.hidden_size, args.vocab_size, bias=False)
        head.weight = torch.nn.Parameter(found["lm_head.weight"].float(), requires_grad=False)
    return SimpleNamespace(args=args, embed_tokens=embed, lm_head=head)
