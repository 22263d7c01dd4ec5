"""Checkpoint files on disk: the cache directory, safetensors shards, and a GGUF file's
checkpoint dir (config.json and tokenizer from its metadata; dequantized weights as
safetensors only when the torch backend runs it: llama.cpp reads the GGUF itself).

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


# GGUF architectures whose weights the torch backend's model runs (llama.cpp runs any).
CONVERTIBLE_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _per_layer_max(value):
    # Some architectures give a head count per layer; KV sizing needs the largest.
    return max(value) if isinstance(value, list) else value


def gguf_config(reader) -> dict:
    """An HF-style config dict from a GGUF's metadata alone: no tensor is read. Keys as
    transformers names them; `gguf_architecture` keeps the file's own architecture."""
    arch = _field(reader, "general.architecture")
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ValueError(f"GGUF architecture {arch!r} has no token_embd.weight: not a text LM")
    n_heads = _per_layer_max(_field(reader, f"{arch}.attention.head_count"))
    n_kv = _per_layer_max(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    hidden = _field(reader, f"{arch}.embedding_length")
    config = {
        "architectures": [CONVERTIBLE_ARCHITECTURES[arch]]
        if arch in CONVERTIBLE_ARCHITECTURES
        else [],
        "model_type": arch,
        "gguf_architecture": arch,
        # (ggml dims are innermost first: token_embd is [hidden, vocab].)
        "vocab_size": int(names["token_embd.weight"].shape[-1]),
        "hidden_size": hidden,
        "intermediate_size": _per_layer_max(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": _field(reader, f"{arch}.block_count"),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": _field(reader, f"{arch}.attention.key_length", hidden // n_heads),
        "max_position_embeddings": _field(reader, f"{arch}.context_length"),
        "rms_norm_eps": _field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": _field(reader, f"{arch}.rope.freq_base", 10000.0),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    return config


def gguf_tensors(reader, config: dict, only: set[str] | None = None) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors of a Llama-family GGUF (`only`: just these HF names)."""
    from gguf.quants import dequantize

    arch = config["gguf_architecture"]
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _gguf_hf_name(t.name)
        if only is not None and name not in only:
            continue
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        if arch == "llama" and t.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = config["num_attention_heads" if "attn_q" in t.name else "num_key_value_heads"]
            w = _unpermute_rope(w, heads)
        tensors[name] = w
    return tensors


def gguf_embedding_and_head(file: Path) -> dict[str, torch.Tensor]:
    """Only a GGUF's token embedding and LM head (if untied), HF-named, float32: what an EAGLE
    head borrows from a target llama.cpp runs, without dequantizing any other tensor."""
    import gguf
    from gguf.quants import dequantize

    names = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}
    return {
        names[t.name]: torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        for t in gguf.GGUFReader(str(file)).tensors
        if t.name in names
    }


def read_gguf(file: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(HF config dict, HF-named float32 tensors) from a Llama or Qwen2 GGUF file."""
    import gguf

    reader = gguf.GGUFReader(str(file))
    config = gguf_config(reader)
    _check_convertible(config["gguf_architecture"], file)
    return config, gguf_tensors(reader, config)


def _check_convertible(arch: str, file: Path) -> None:
    if arch not in CONVERTIBLE_ARCHITECTURES:
        raise ValueError(
            f"{file.name}: the torch backend runs {' and '.join(CONVERTIBLE_ARCHITECTURES)} GGUF "
            f"files, not {arch!r}; serve it with backend 'ggml' (llama.cpp, the `cpu` extra)"
        )


def gguf_dir(file: Path) -> Path:
    """Where a GGUF file's config, tokenizer (and, for torch, its weights) are kept."""
    # (absolute, not resolved: a hub snapshot's file is a link to a blob named by its hash)
    file = file.absolute()
    stat = file.stat()
    key = hashlib.sha1(f"{file}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{file.stem}-{key}"


def has_weights(path: Path) -> bool:
    return (path / "model.safetensors.index.json").exists() or any(path.glob("*.safetensors"))


def convert_gguf(file: Path, out_dir: Path | None = None, weights: bool = True) -> Path:
    """A checkpoint dir for a GGUF file under the cache, made once and reused: config.json,
    tokenizer files and the source marker; with `weights`, also every tensor dequantized to
    float32 safetensors (what the torch backend loads; llama.cpp reads the GGUF itself)."""
    file = file.absolute()
    out_dir = out_dir or gguf_dir(file)
    if not (out_dir / "config.json").exists():
        _write_gguf_metadata(file, out_dir)
    if weights and not has_weights(out_dir):
        _write_gguf_weights(file, out_dir)
    return out_dir


def _write_gguf_metadata(file: Path, out_dir: Path) -> None:
    import gguf
    from transformers import AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = gguf_config(gguf.GGUFReader(str(file)))
    with open(tmp / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    try:
        # transformers builds a fast tokenizer (vocab, merges, chat template) from the metadata.
        tok = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
        tok.save_pretrained(str(tmp))
    except Exception as exc:  # an architecture transformers cannot read: no tokenizer here
        with open(tmp / TOKENIZER_ERROR, "w") as f:
            f.write(f"{type(exc).__name__}: {exc}\n")
    with open(tmp / GGUF_SOURCE, "w") as f:
        json.dump({"gguf": str(file)}, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)


def _write_gguf_weights(file: Path, out_dir: Path) -> None:
    _, tensors = read_gguf(file)
    part = out_dir / f"model.safetensors.tmp{os.getpid()}"
    save_file(tensors, str(part))
    os.replace(part, out_dir / "model.safetensors")  # atomic: a reader sees all or nothing


GGUF_SOURCE = "gguf_source.json"  # in a converted dir: which GGUF file it came from
# In a GGUF's dir when transformers could not build a tokenizer from the file: why.
TOKENIZER_ERROR = "tokenizer_error.txt"
