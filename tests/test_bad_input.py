"""Bad input raises errors that say what was wrong and what to do."""

from __future__ import annotations

import json

import pytest

from adaserve import LLM, SamplingParams
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from tests.conftest import make_tiny_checkpoint


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"max_tokens": 0}, "max_tokens must be an integer > 0"),
        ({"temperature": -0.5}, "temperature must be >= 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k must be -1"),
        ({"slo_tpot_ms": -3}, "slo_tpot_ms must be > 0, got -3"),
        ({"stop": [""]}, "stop strings must be non-empty"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "cls, kwargs, message",
    [
        (SchedulerConfig, {"policy": "fastest"}, "policy must be one of"),
        (SchedulerConfig, {"budget": 0}, "budget must be > 0"),
        (ModelConfig, {"dtype": "int8"}, "dtype must be one of"),
        (CacheConfig, {"block_size": 0}, "block_size must be > 0"),
    ],
)
def test_invalid_config_names_the_field(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_unknown_architecture_is_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(model=str(path))


def test_missing_weights_and_paths_are_named(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no \\*.safetensors weights"):
        LLM(model=str(path))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(model=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        LLM(model=str(tmp_path / "empty"))


def test_draft_with_another_vocabulary_is_refused(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "t", vocab_size=96)
    draft = make_tiny_checkpoint(tmp_path / "d", vocab_size=80)
    with pytest.raises(ValueError, match="draft vocabulary size 80 differs from the target's 96"):
        LLM(model=str(target), draft_model=str(draft), policy="adaserve")


def test_prompt_longer_than_max_model_len_is_refused_and_nothing_is_queued(tiny_llama):
    llm = LLM(model=str(tiny_llama), max_model_len=32, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="prompt has 40 tokens; the model allows at most 31"):
        llm.generate([[5] * 4, [5] * 40], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished(), "a rejected batch left requests queued"
    out = llm.generate([[5] * 4], SamplingParams(max_tokens=100, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 28, (
        "generation must stop at max_model_len"
    )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[5, 1000]], SamplingParams())
    with pytest.raises(TypeError, match="unknown argument 'bogus'"):
        LLM(model=str(tiny_llama), bogus=1)


def test_prompt_bigger_than_the_kv_pool_is_refused_not_queued_forever(tiny_llama):
    llm = LLM(model=str(tiny_llama), num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="more than the target KV cache holds \\(16 tokens\\)"):
        llm.generate([[5] * 20], SamplingParams(max_tokens=2))
    assert not llm.llm_engine.has_unfinished()


def test_extreme_sampling_values_do_not_produce_nan(tiny_llama):
    llm = LLM(model=str(tiny_llama), num_blocks=32, block_size=4)
    greedy = llm.generate([[5, 6]], SamplingParams(max_tokens=8, temperature=0.0))[0]
    tiny_t = llm.generate([[5, 6]], SamplingParams(max_tokens=8, temperature=1e-300))[0]
    assert tiny_t.outputs[0].token_ids == greedy.outputs[0].token_ids, "T -> 0 must act greedy"
    tiny_p = llm.generate([[5, 6]], SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-50))[0]
    assert tiny_p.outputs[0].token_ids == greedy.outputs[0].token_ids, (
        "top_p -> 0 keeps the top token"
    )


def test_a_request_outgrowing_the_whole_kv_pool_finishes_with_length(tiny_llama):
    llm = LLM(model=str(tiny_llama), num_blocks=4, block_size=4)  # 16 tokens in all
    out = llm.generate([[5] * 6], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 16 - 6 + 1, "should run until the pool is full"
    assert llm.llm_engine.engine.target.cache.allocator.num_used == 0
