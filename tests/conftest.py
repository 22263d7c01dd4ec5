"""Shared fixtures: tiny random Llama-family checkpoints built in tests, the default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def make_tokenizer(vocab_size: int):
    """A word-level tokenizer over tokens t0..t{V-1} (t0 <unk>, t1 <eos>), with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1")
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast


def make_tiny_checkpoint(
    path: Path,
    arch: str = "llama",
    vocab_size: int = 96,
    num_layers: int = 2,
    seed: int = 0,
    tie: bool = True,
    hidden: int = 64,
    **overrides,
) -> Path:
    """Save a randomly initialised HF model + tokenizer to `path`; returns `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=tie,
        initializer_range=0.25,
        eos_token_id=1,
        bos_token_id=None,
        pad_token_id=None,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if arch == "llama":
        common.setdefault(
            "rope_scaling",
            {
                "rope_type": "llama3",
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        raise ValueError(arch)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(vocab_size).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_qwen2"), "qwen2", tie=False)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The real default model (fetched and converted once into the cache)."""
    from adaserve.exec.default_model import default_model_dir as resolve

    return resolve()


def read_config(path: Path) -> dict:
    with open(path / "config.json") as f:
        return json.load(f)
