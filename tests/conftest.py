"""Shared fixtures: tiny random Llama-family checkpoints built in tests, the default model."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

_TEST_CACHE: Path | None = None
# The user's cache as it was before the tests redirected ADASERVE_CACHE.
REAL_CACHE: Path | None = None


def pytest_configure(config) -> None:
    """Run every test against a throw-away cache; only the downloaded default model is shared.

    Tests must leave nothing in the user's cache that changes what `adaserve serve` does (a
    profile measured under the test run's load would be trusted by the next server start).
    """
    global _TEST_CACHE, REAL_CACHE
    from adaserve.exec.checkpoint_files import cache_root
    from adaserve.exec.default_model import MODEL_NAME, default_model_dir

    if _TEST_CACHE is not None:
        return
    real = REAL_CACHE = cache_root()
    # An offline GPU machine runs only the CUDA test files, which build tiny checkpoints:
    # bench/gpu_check.sh sets this when the default model's GGUF was not carried there.
    with_default = os.environ.get("ADASERVE_TESTS_WITHOUT_DEFAULT_MODEL") != "1"
    if with_default:
        default_model_dir()  # fetched and converted once into the user's cache, as `serve` would
    _TEST_CACHE = Path(tempfile.mkdtemp(prefix="adaserve-test-cache-"))
    (_TEST_CACHE / "models").mkdir()
    if with_default:
        (_TEST_CACHE / "downloads").symlink_to(real / "downloads", target_is_directory=True)
        (_TEST_CACHE / "models" / MODEL_NAME).symlink_to(
            real / "models" / MODEL_NAME, target_is_directory=True
        )
    os.environ["ADASERVE_CACHE"] = str(_TEST_CACHE)  # server subprocesses inherit it


def pytest_unconfigure(config) -> None:
    if _TEST_CACHE is not None:
        shutil.rmtree(_TEST_CACHE, ignore_errors=True)


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
