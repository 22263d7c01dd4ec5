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


def test_greedy_batch_of_8_equals_transformers_greedy(default_model_dir):
    # The torch engine on the dequantized weights (the ggml backend runs the quantized GGUF:
    # tests/exec/test_ggml.py compares it with llama.cpp's own decoding).
    llm = LLM(max_num_seqs=8, backend="torch")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    # Greedy equality, checked in one transformers forward per sequence: every token the engine
    # emitted is transformers' argmax after the prompt and the tokens before it. By induction
    # that is `generate(do_sample=False)`'s output (which ignore_eos would let run past EOS,
    # as this does), at a 64th of its cost.
    for prompt, out in zip(PROMPTS, outs):
        got = out.outputs[0].token_ids
        assert len(got) == 64 and out.outputs[0].finish_reason == "length"
        ids = torch.tensor([out.prompt_token_ids + got[:-1]])
        with torch.no_grad():
            logits = hf(ids).logits[0, len(out.prompt_token_ids) - 1 :]
        ref = logits.argmax(-1).tolist()
        if got != ref:
            i = next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)
            gap = float(logits[i, ref[i]] - logits[i, got[i]])
            raise AssertionError(
                f"{prompt!r}: token {i} is {got[i]}, transformers' argmax {ref[i]} "
                f"(logit gap {gap:.4f})"
            )
    alloc = llm.llm_engine.engine.target.cache.allocator
    assert alloc.num_used == 0, f"{alloc.num_used} KV blocks still held after generate"


def test_chat_applies_the_template_and_stops_at_eos(default_model_dir):
    # The float32 weights: the Q4_1 file as llama.cpp runs it starts this answer with "L"
    # (a 0.1-logit tie with "The" flipped by its 8-bit activations; docs/ggml.md).
    llm = LLM(backend="torch")
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=40, temperature=0.0),
    )[0]
    assert "Paris" in out.outputs[0].text, out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop", "chat answer should end with <|im_end|>"
    assert out.metrics.ttft_s is not None and out.metrics.ttft_s > 0
    assert out.metrics.tpot_ms is not None and out.metrics.tpot_ms > 0


def test_the_shipped_eagle_head_drafts_losslessly_on_the_default_model(default_model_dir):
    from adaserve.exec.default_model import shipped_head

    assert shipped_head() is not None, "the package lost its EAGLE head"
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = PROMPTS[:4]
    ref = LLM(max_num_seqs=4, backend="torch").generate(prompts, sp)
    # torch: bitwise losslessness in a batch (on ggml near-ties may flip: docs/ggml.md, and
    # tests/exec/test_ggml.py runs the head beside a ggml target).
    llm = LLM(drafter="eagle", policy="adaserve_paper", budget=16, max_num_seqs=4, backend="torch")
    assert llm.llm_engine.scheduler.drafter.name == "eagle"
    outs = llm.generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    iterations = sum(o.metrics.num_iterations for o in outs)
    # Trained to ~42% held-out depth-1 agreement: it must get a fair share accepted.
    assert accepted > 0.2 * iterations, f"{accepted} accepted in {iterations} iterations"
