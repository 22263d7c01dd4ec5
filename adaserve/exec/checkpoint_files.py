"""Checkpoint files on disk: the cache directory, safetensors shards, and the conversion of a
GGUF file into a checkpoint dir (dequantized weights as safetensors, config.json, tokenizer).

Below `loader.py` (which resolves a model name and builds the model) and `default_model.py`
(which fetches the default model): both read and write checkpoints through this module.
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


def cache_root() -> Path:
    """`$ADASERVE_CACHE`, else ~/.cache/adaserve."""
    return Path(os.environ.get("ADASERVE_CACHE") or Path.home() / ".cache" / "adaserve")


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
