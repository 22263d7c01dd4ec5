"""Weights in: Hugging Face checkpoint dirs (one or sharded safetensors) and GGUF files.

A GGUF file is converted once into a checkpoint dir in the cache (dequantized weights as
safetensors, config.json, tokenizer files) and loaded from there like any other dir.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from adaserve.exec.model.llama import (
    SUPPORTED_ARCHITECTURES,
    LlamaArgs,
    LlamaForCausalLM,
    rope_inv_freq,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_root() -> Path:
    """`$ADASERVE_CACHE`, else ~/.cache/adaserve."""
    return Path(os.environ.get("ADASERVE_CACHE") or Path.home() / ".cache" / "adaserve")


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A checkpoint dir for `model`: None -> default model; .gguf -> its converted dir."""
    if model is None:
        from adaserve.exec.default_model import default_model_dir

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


def safetensor_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        missing = [n for n in names if not (path / n).exists()]
        if missing:
            raise FileNotFoundError(f"{path} is missing weight shards {missing}")
        return [path / n for n in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no *.safetensors weights")
    return files


def iter_safetensors(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


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


# ---------------------------------------------------------------------------- GGUF

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _gguf_hf_name(name: str) -> str:
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    blk, layer, part, kind = name.split(".")
    if blk != "blk" or part not in _GGUF_NAMES:
        raise ValueError(f"GGUF tensor {name!r} has no Llama-family meaning")
    return f"model.layers.{layer}.{_GGUF_NAMES[part]}.{kind}"


def _unpermute_rope(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    # llama.cpp stores q/k rows of each head interleaved (pairs of rotary dims side by side);
    # HF rotates halves. Undo: rows (head, dim/2, 2) -> (head, 2, dim/2).
    return (
        w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def read_gguf(file: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config dict, HF-named float32 tensors) from a Llama or Qwen2 GGUF file."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(file))

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"unsupported GGUF architecture {arch!r}; adaserve reads llama and qwen2")
    n_heads = field(f"{arch}.attention.head_count")
    n_kv = field(f"{arch}.attention.head_count_kv", n_heads)
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _gguf_hf_name(t.name)
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            w = _unpermute_rope(w, n_heads if "attn_q" in t.name else n_kv)
        tensors[name] = w
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    config = {
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": field(f"{arch}.embedding_length"),
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": field(f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "max_position_embeddings": field(f"{arch}.context_length"),
        "rms_norm_eps": field(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": field(f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": field("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    return config, tensors


def convert_gguf(file: Path, out_dir: Path | None = None) -> Path:
    """Convert a GGUF file once into a checkpoint dir under the cache; reuse it afterwards."""
    file = file.resolve()
    if out_dir is None:
        stat = file.stat()
        key = hashlib.sha1(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
        out_dir = cache_root() / "gguf" / f"{file.stem}-{key}"
    if (out_dir / "config.json").exists():
        return out_dir
    from transformers import AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config, tensors = read_gguf(file)
    save_file(tensors, str(tmp / "model.safetensors"))
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    # transformers builds a fast tokenizer (vocab, merges, chat template) from the GGUF metadata.
    AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name).save_pretrained(str(tmp))
    with open(tmp / GGUF_SOURCE, "w") as f:
        json.dump({"gguf": str(file)}, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


GGUF_SOURCE = "gguf_source.json"  # in a converted dir: which GGUF file it came from


def gguf_source(model: str | os.PathLike | None, path: Path) -> Path | None:
    """The GGUF file behind a model (None: none known): the model itself when it is a .gguf
    file, the default model's download, or the file a converted dir records."""
    if model is not None and Path(model).expanduser().suffix == ".gguf":
        return Path(model).expanduser().resolve()
    if model is None:
        from adaserve.exec.default_model import default_gguf_file

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
