"""The real default model (SmolLM2-135M-Instruct from its GGUF) against HF transformers."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from adaserve import LLM, SamplingParams

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "Python is a programming language that",
    "The largest planet in the solar system",
    "Water boils at",
]


def test_greedy_batch_of_8_equals_transformers_generate(default_model_dir):
    llm = LLM(max_num_seqs=8)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    # ignore_eos keeps generating past EOS without banning it (as vLLM's does); min_new_tokens
    # would ban it, so switch EOS off in transformers instead.
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(PROMPTS, outs):
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=64,
                do_sample=False,
                pad_token_id=0,
            )[0, ids.shape[1] :].tolist()
        assert out.outputs[0].token_ids == ref, f"{prompt!r}: adaserve and transformers diverge"
        assert out.outputs[0].finish_reason == "length"
    alloc = llm.llm_engine.engine.target.cache.allocator
    assert alloc.num_used == 0, f"{alloc.num_used} KV blocks still held after generate"


def test_chat_applies_the_template_and_stops_at_eos(default_model_dir):
    llm = LLM()
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=40, temperature=0.0),
    )[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop", "chat answer should end with <|im_end|>"
    assert out.metrics.ttft_s is not None and out.metrics.ttft_s > 0
    assert out.metrics.tpot_ms is not None and out.metrics.tpot_ms > 0
