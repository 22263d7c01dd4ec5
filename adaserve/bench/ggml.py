"""The ggml backend against llama.cpp itself: same GGUF file, same machine, same run.

    python -m adaserve.bench.ggml [--max-tokens 128] [--concurrency 1 4 16 32] [--repeats 3]
    python -m adaserve.bench.ggml --eagle --max-tokens 40

Rows: llama-cpp-python's own greedy `generate` (one request, its high-level API, prompt
evaluation included as in ours); adaserve incremental on ggml at every concurrency (aggregate
tokens/s); adaserve's own policy with the suffix drafter on ggml (--spec-concurrency); the torch
backend's incremental for scale. Engines take turns within each point, --repeats times, the
median reported. Then the ggml forward cost curve speculation control reads (ms per forward of
N new tokens over --context cached ones), and the identical-request check (how often
concurrent identical greedy requests agree on ggml; see docs/ggml.md). Prints markdown.
"""

from __future__ import annotations

import argparse
import statistics
import time

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.policies import Result, run
from adaserve.bench.prompts import prompts
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig


def llama_cpp_tokens_per_s(ids: list[int], max_tokens: int, threads: int, llm) -> float:
    """One greedy request through llama-cpp-python's high-level generator, from scratch."""
    llm.reset()  # no prefix reuse from the previous run: the prompt is evaluated again
    start = time.perf_counter()
    n = 0
    for _ in llm.generate(ids, temp=0.0):
        n += 1
        if n == max_tokens:
            break
    return n / (time.perf_counter() - start)


def identical_requests_agree(engine: LLMEngine, n: int, max_tokens: int) -> tuple[int, int]:
    """(distinct outputs, requests) for n identical greedy requests run concurrently."""
    prompt = prompts(1)[0]
    for i in range(n):
        engine.add_request(
            prompt,
            SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            request_id=f"same-{i}",
        )
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = tuple(out.outputs[0].token_ids)
    return len(set(outs.values())), n


def eagle_comparison(max_tokens: int) -> None:
    """The EAGLE head beside a ggml target vs on the torch backend: 3 prompts one at a time."""
    from adaserve import LLM

    texts = prompts(3)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    print("| target backend | policy | tok/s | vs incremental | accepted | iterations |")
    print("|---|---|---:|---:|---:|---:|")
    for backend in ("torch", "ggml"):
        base = None
        for policy, drafter in (
            ("incremental", "auto"),
            ("adaserve_paper", "eagle"),
            ("adaserve", "eagle"),
        ):
            llm = LLM(backend=backend, policy=policy, drafter=drafter, budget=16)
            llm.generate([texts[0]], SamplingParams(max_tokens=4))  # warm-up
            start = time.perf_counter()
            outs = [llm.generate([t], params)[0] for t in texts]
            tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)
            base = base or tps
            acc = sum(o.metrics.num_accepted_tokens for o in outs)
            iters = sum(o.metrics.num_iterations for o in outs)
            label = policy if drafter == "auto" else f"{policy} + EAGLE"
            print(
                f"| {backend} | {label} | {tps:.1f} | {tps / base:.2f}x | {acc} | {iters} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    ap.add_argument("--spec-concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--torch-concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget", type=int, default=SchedulerConfig.budget)
    ap.add_argument("--context", type=int, default=300, help="cached tokens for the cost curve")
    ap.add_argument(
        "--eagle",
        action="store_true",
        help="only compare the EAGLE head beside a ggml target with it on the torch backend",
    )
    args = ap.parse_args()
    if args.eagle:
        eagle_comparison(args.max_tokens)
        return
    import llama_cpp

    from adaserve.exec.default_model import default_gguf_file
    from adaserve.exec.ggml import GgmlRunner
    from adaserve.exec.timing import time_forward

    top = max(args.concurrency + args.spec_concurrency + args.torch_concurrency)
    engines: dict[str, tuple[LLMEngine, set[int]]] = {}
    for label, backend, policy, drafter, points in (
        ("ggml incremental", "ggml", "incremental", "auto", args.concurrency),
        ("ggml adaserve+suffix", "ggml", "adaserve", "suffix", args.spec_concurrency),
        ("torch incremental", "torch", "incremental", "auto", args.torch_concurrency),
    ):
        if not points:
            continue
        engine = LLMEngine(
            ModelConfig(backend=backend, drafter=drafter),
            CacheConfig(),
            SchedulerConfig(policy=policy, budget=args.budget, max_num_seqs=top),
        )
        run(engine, prompts(2), 4, [None])  # warm-up
        engines[label] = (engine, set(points))
    ggml_engine = engines["ggml incremental"][0]
    ggml_target = ggml_engine.engine.target
    assert isinstance(ggml_target, GgmlRunner)  # the engine was built with backend="ggml"
    threads = ggml_target.llama.threads
    ref = llama_cpp.Llama(
        str(default_gguf_file()),
        n_ctx=2048,
        n_threads=threads,
        n_threads_batch=threads,
        flash_attn=True,
        verbose=False,
    )
    ref_ids = ggml_engine.tokenize(prompts(1)[0])
    llama_cpp_tokens_per_s(ref_ids, 8, threads, ref)  # warm-up

    print(
        f"SmolLM2-135M-Instruct Q4_1 GGUF, {threads} threads, {args.max_tokens} tokens/request, "
        f"greedy, median of {args.repeats}\n"
    )
    print("| engine | concurrent | tok/s (aggregate) | vs llama.cpp, 1 stream | accepted/iter |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for c in sorted(set(args.concurrency + args.spec_concurrency + args.torch_concurrency)):
        rows: dict[str, list[Result | float]] = {}
        for _ in range(args.repeats):
            if c == 1:
                rows.setdefault("llama-cpp-python generate", []).append(
                    llama_cpp_tokens_per_s(ref_ids, args.max_tokens, threads, ref)
                )
            for label, (engine, points) in engines.items():
                if c in points:
                    rows.setdefault(label, []).append(
                        run(engine, prompts(c), args.max_tokens, [None])
                    )
        for label, results in rows.items():
            tps = [r if isinstance(r, float) else r.tokens_per_s for r in results]
            med = statistics.median(tps)
            pick = results[tps.index(sorted(tps)[len(tps) // 2])]
            acc = "" if isinstance(pick, float) else f"{pick.accepted_per_iter:.2f}"
            if label.startswith("llama-cpp"):
                base = med
            ratio = f"{med / base:.2f}x" if base else ""
            print(f"| {label} | {c} | {med:.1f} | {ratio} | {acc} |", flush=True)

    print(f"\nggml forward cost ({args.context} cached tokens per sequence, 8 sequences):\n")
    print("| new tokens | ms | ms per token |")
    print("|---:|---:|---:|")
    for n in (1, 2, 4, 8, 16, 32, 64):
        ms = time_forward(ggml_engine.engine.target, n, args.context, 3)
        if ms is not None:
            print(f"| {n} | {ms:.1f} | {ms / n:.2f} |", flush=True)

    distinct, n = identical_requests_agree(ggml_engine, 16, args.max_tokens)
    print(
        f"\n{n} identical greedy requests, concurrent, on ggml: {distinct} distinct outputs "
        f"of {args.max_tokens} tokens"
    )


if __name__ == "__main__":
    main()
