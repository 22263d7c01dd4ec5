"""Incremental decoding throughput vs Hugging Face transformers `generate()`, same prompts, one run.

    python -m adaserve.bench.engine_throughput [--batch-sizes 1 8 32] [--max-tokens 64]
        [--backend torch|ggml|auto]

Prints a markdown table of output tokens/s at each batch size and the ratio. The two systems
run alternately `--repeats` times and the medians are reported, so a passing load on a shared
machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from adaserve import LLM, SamplingParams
from adaserve.bench.prompts import prompts


def adaserve_tokens_per_s(llm: LLM, batch: list[str], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def hf_tokens_per_s(model, tokenizer, batch: list[str], max_tokens: int) -> float:
    enc = tokenizer(batch, return_tensors="pt", padding=True, add_special_tokens=False)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            **enc, max_new_tokens=max_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
        )
    elapsed = time.perf_counter() - start
    return (out.shape[1] - enc.input_ids.shape[1]) * len(batch) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint dir or .gguf (default: SmolLM2-135M)")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--backend",
        default="torch",
        choices=("torch", "ggml", "auto"),
        help="adaserve's backend (default torch: the same float32 model as transformers; "
        "auto picks ggml where llama-cpp-python is installed)",
    )
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    llm = LLM(model=args.model, max_num_seqs=max(args.batch_sizes), backend=args.backend)
    path = llm.llm_engine.engine.target_path
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # same as ignore_eos: always max_tokens tokens
    tok = AutoTokenizer.from_pretrained(path, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    llm.generate(prompts(2), SamplingParams(max_tokens=4))  # warm-up
    print(
        f"model: {path.name}, adaserve backend {args.backend}, {torch.get_num_threads()} threads, "
        f"{args.max_tokens} tokens each, "
        f"median of {args.repeats} alternating runs\n"
    )
    print("| batch | adaserve incremental tok/s | transformers generate tok/s | ratio |")
    print("|---:|---:|---:|---:|")
    for bs in args.batch_sizes:
        batch = prompts(bs)
        runs = [
            (
                adaserve_tokens_per_s(llm, batch, args.max_tokens),
                hf_tokens_per_s(hf, tok, batch, args.max_tokens),
            )
            for _ in range(args.repeats)
        ]
        ours = statistics.median(r[0] for r in runs)
        ref = statistics.median(r[1] for r in runs)
        print(f"| {bs} | {ours:.1f} | {ref:.1f} | {ours / ref:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
