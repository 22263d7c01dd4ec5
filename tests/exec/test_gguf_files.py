"""GGUF files: what is read of them, and what is written for them (ggml never expands one).

The ggml tests run the default model's own GGUF file (SmolLM2-135M-Instruct Q4_1) and skip
without llama-cpp-python; the metadata tests write small GGUF files with the gguf package.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from adaserve.exec.checkpoint_files import (
    TOKENIZER_ERROR,
    convert_gguf,
    gguf_dir,
    gguf_embedding_and_head,
    iter_safetensors,
    safetensor_files,
)
from adaserve.exec.ggml import ggml_available
from adaserve.exec.loader import load_args, load_tokenizer
from tests.hub_cache import add_snapshot

needs_ggml = pytest.mark.skipif(not ggml_available(), reason="the ggml backend needs `cpu`")
# Same cache size for every run compared (llama.cpp's logits depend on where KV cells sit),
# and no cost curve measured at start (minutes on a loaded CPU; incremental needs none).
GGML = dict(backend="ggml", num_blocks=64, chunked_prefill=False)
PROMPTS = ["The capital of France is", "Write a python function that sorts a list."]


def write_gguf(path: Path, arch: str, vocab: int = 32, hidden: int = 16) -> Path:
    """A GGUF file with an architecture's metadata and an embedding, no tokenizer."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(2)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(4 * hidden)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(8)  # head_dim other than hidden / heads, as qwen3 has
    w.add_layer_norm_rms_eps(1e-6)
    w.add_tensor("token_embd.weight", np.ones((vocab, hidden), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def fresh_cache(tmp_path: Path, monkeypatch) -> Path:
    """A fresh adaserve cache from now on: whatever is converted lands here and nowhere else
    (the default model stays in the tests' cache: ask for it before)."""
    monkeypatch.setenv("ADASERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    return fresh_cache(tmp_path, monkeypatch)


def safetensors_in(*roots: Path) -> list[Path]:
    return [p for root in roots for p in root.rglob("*.safetensors")]


@pytest.mark.parametrize("arch", ["qwen3", "phi3"])
def test_an_architecture_only_llama_cpp_runs_is_read_from_metadata(cache, tmp_path, arch):
    """ggml serves any architecture llama.cpp knows: the metadata gives what the engine needs
    (context, vocabulary, KV sizes); only converting it for torch is refused, saying why."""
    file = write_gguf(tmp_path / f"{arch}.gguf", arch)
    path = convert_gguf(file, weights=False)
    assert safetensors_in(cache) == []
    args = load_args(path)
    assert (args.architecture, args.vocab_size, args.max_position_embeddings) == (
        f"gguf:{arch}",
        32,
        4096,
    )
    assert (args.num_layers, args.num_kv_heads, args.head_dim) == (2, 2, 8)
    # (No tokenizer in this file: transformers has none to build, and the error says so.)
    assert (path / TOKENIZER_ERROR).exists()
    with pytest.raises(FileNotFoundError, match="--tokenizer"):
        load_tokenizer(path)
    with pytest.raises(ValueError, match=f"not '{arch}'; serve it with backend 'ggml'"):
        convert_gguf(file)


@needs_ggml
def test_ggml_serves_a_gguf_file_without_expanding_it(tmp_path, monkeypatch):
    """The GGUF as the model (and out of a hub repo with gguf_file): the same greedy tokens as
    the default model on ggml, and no dequantized weights anywhere. torch then expands it."""
    from adaserve import LLM, SamplingParams
    from adaserve.exec.default_model import GGUF_NAME, default_gguf_file

    gguf = default_gguf_file()
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)

    def greedy(**kw) -> list[list[int]]:
        llm = LLM(**GGML, **kw)
        assert llm.llm_engine.engine.backend == "ggml"
        return [llm.generate([p], params)[0].outputs[0].token_ids for p in PROMPTS]

    want = greedy()  # the default model: its converted dir, the same GGUF file on llama.cpp
    cache = fresh_cache(tmp_path, monkeypatch)
    assert greedy(model=str(gguf)) == want, "the GGUF as the model differs from the default"
    hub = tmp_path / "hf" / "hub"
    add_snapshot(hub, "acme/SmolLM2-GGUF", {GGUF_NAME: gguf}, link=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert greedy(model="acme/SmolLM2-GGUF", gguf_file=GGUF_NAME) == want
    assert safetensors_in(cache, hub) == [], "ggml expanded a GGUF file"
    meta = gguf_dir(gguf)  # where the GGUF file's config and tokenizer went
    config = json.loads((meta / "config.json").read_text())
    llm = LLM(model=str(gguf), backend="torch", num_blocks=64)
    assert llm.llm_engine.engine.target_path == meta, "torch converted into another dir"
    assert json.loads((meta / "config.json").read_text()) == config
    assert [p.name for p in safetensors_in(cache)] == ["model.safetensors"]


@needs_ggml
def test_an_eagle_head_beside_a_gguf_target_borrows_only_its_embedding(tmp_path, monkeypatch):
    """The head needs the target's embedding (tied LM head): dequantized from the GGUF alone,
    equal to the converted checkpoint's, and its drafts are accepted."""
    from adaserve import LLM, SamplingParams
    from adaserve.exec.default_model import default_gguf_file, default_model_dir, shipped_head

    head = shipped_head()
    assert head is not None
    gguf = default_gguf_file()
    borrowed = gguf_embedding_and_head(gguf)
    assert set(borrowed) == {"model.embed_tokens.weight"}, "SmolLM2 ties its LM head"
    converted = dict(iter_safetensors(safetensor_files(default_model_dir())))
    cache = fresh_cache(tmp_path, monkeypatch)
    assert torch.equal(
        borrowed["model.embed_tokens.weight"], converted["model.embed_tokens.weight"]
    )
    llm = LLM(
        model=str(gguf),
        drafter="eagle",
        draft_model=str(head),
        policy="adaserve_paper",
        budget=16,
        **GGML,
    )
    out = llm.generate(
        [PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    )[0]
    assert len(out.outputs[0].token_ids) == 40
    assert out.metrics.num_accepted_tokens >= 10, out.metrics
    assert safetensors_in(cache) == [], "the head's target was expanded"


@pytest.mark.parametrize("from_gguf", [True, False])
def test_a_gguf_tokenizer_decodes_as_llama_cpp_without_space_clean_up(tmp_path, from_gguf):
    """transformers 5.17 turns clean_up_tokenization_spaces on for a tokenizer it builds from
    GGUF metadata: text unlike llama.cpp's (" ." kept as "."), and whole-output decoding on
    every iteration instead of streaming. A GGUF's tokenizer loads with it off; a checkpoint
    that asks for it keeps it."""
    from adaserve.exec.checkpoint_files import GGUF_SOURCE
    from adaserve.request_manager.output import OutputProcessor
    from tests.conftest import make_tokenizer

    make_tokenizer(16).save_pretrained(tmp_path)
    config = tmp_path / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data["clean_up_tokenization_spaces"] = True
    config.write_text(json.dumps(data))
    if from_gguf:
        (tmp_path / GGUF_SOURCE).write_text(json.dumps({"gguf": "model.gguf"}))
    tok = load_tokenizer(tmp_path)
    assert tok.clean_up_tokenization_spaces is (not from_gguf)
    streams = OutputProcessor(tok, max_model_len=64).backend is not None
    assert streams is from_gguf, "a GGUF's text streams; a clean-up checkpoint decodes whole"
