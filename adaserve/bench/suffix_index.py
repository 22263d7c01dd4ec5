"""Micro-benchmark of the suffix drafter's index: `python -m adaserve.bench.suffix_index`.

Builds a request-local TokenIndex and a GlobalSuffixCache of --tokens tokens each, then times
`extend` per token and `build_suffix_tree` per call (one call per decoded token, as in serving)
and prints a markdown table. Tokens are random over a 2k alphabet, interleaved with copies of
a pool of spans, so that suffixes recur as they do in code, chat history and agent traces.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from collections.abc import Callable, Sequence

import numpy as np

from adaserve.request_manager.drafters.suffix_index import (
    GlobalSuffixCache,
    TokenIndex,
    build_suffix_tree,
)

ALPHABET = 2048
DOC_TOKENS = 1024  # length of one finished request in the global cache


def make_stream(num_tokens: int, rng: random.Random, spans: list[list[int]]) -> list[int]:
    """Random runs alternating with copies of spans from a shared pool."""
    out: list[int] = []
    while len(out) < num_tokens:
        if rng.random() < 0.5:
            out.extend(rng.randrange(ALPHABET) for _ in range(rng.randint(4, 32)))
        else:
            out.extend(rng.choice(spans))
    return out[:num_tokens]


def percentiles_us(samples_ns: Sequence[int]) -> tuple[float, float]:
    """(median, p99) in microseconds."""
    arr = np.asarray(samples_ns, dtype=np.float64) / 1e3
    return float(np.median(arr)), float(np.percentile(arr, 99))


def index_mib(build: Callable[[], object]) -> float:
    """Python heap (MiB) held by what `build()` returns; timed runs are done without tracing."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return (after - before) / 2**20


def run(args: argparse.Namespace) -> str:
    """Time the index and the tree builder; returns the markdown table."""
    rng = random.Random(args.seed)
    spans = [[rng.randrange(ALPHABET) for _ in range(rng.randint(8, 64))] for _ in range(256)]
    history = make_stream(args.tokens, rng, spans)
    decode = make_stream(args.calls, rng, spans)
    docs = make_stream(args.tokens, rng, spans)

    # Local index: the prompt in one extend, then one token per decode step.
    local = TokenIndex(args.max_ngram)
    # NOTE: the collector stays on (the indexes' allocations trigger it in serving too), but
    # garbage of the imports is collected first so that it is not billed to the index.
    gc.collect()
    t0 = time.perf_counter_ns()
    local.extend(history)
    bulk_ns = (time.perf_counter_ns() - t0) / len(history)
    cache = GlobalSuffixCache(args.tokens, args.max_ngram)
    t0 = time.perf_counter_ns()
    for start in range(0, len(docs), DOC_TOKENS):
        cache.add(docs[start : start + DOC_TOKENS])
    add_ns = (time.perf_counter_ns() - t0) / len(docs)

    extend_ns, build_ns, nodes, matched = [], [], [], 0
    for token in decode:
        t0 = time.perf_counter_ns()
        local.extend((token,))
        t1 = time.perf_counter_ns()
        tree = build_suffix_tree(
            token, local.tokens, local, cache, depth=args.depth, max_nodes=args.max_nodes
        )
        t2 = time.perf_counter_ns()
        extend_ns.append(t1 - t0)
        build_ns.append(t2 - t1)
        nodes.append(len(tree) - 1)
        matched += len(tree) > 1

    ext_med, ext_p99 = percentiles_us(extend_ns)
    bld_med, bld_p99 = percentiles_us(build_ns)
    local_mib = index_mib(lambda: _local_index(history, args.max_ngram))
    cache_mib = index_mib(lambda: _global_cache(docs, args.tokens, args.max_ngram))
    rows = [
        ("extend, 1 token (decode)", f"{ext_med:.2f}", f"{ext_p99:.2f}", len(decode)),
        ("extend, bulk, per token", f"{bulk_ns / 1e3:.2f}", "-", len(history)),
        ("GlobalSuffixCache.add, per token", f"{add_ns / 1e3:.2f}", "-", len(docs)),
        ("build_suffix_tree, per call", f"{bld_med:.1f}", f"{bld_p99:.1f}", len(decode)),
    ]
    lines = [
        f"tokens {args.tokens} local + {args.tokens} global ({cache.num_docs} docs), depth "
        f"{args.depth}, max_nodes {args.max_nodes}, max_ngram {args.max_ngram}",
        "",
        "| operation | median us | p99 us | n |",
        "|---|---:|---:|---:|",
        *(f"| {name} | {med} | {p99} | {n} |" for name, med, p99, n in rows),
        "",
        f"calls with a match: {matched}/{len(decode)}; mean nodes {np.mean(nodes):.1f}; "
        f"index heap: local {local_mib:.0f} MiB, global {cache_mib:.0f} MiB",
    ]
    return "\n".join(lines)


def _local_index(tokens: list[int], max_ngram: int) -> TokenIndex:
    index = TokenIndex(max_ngram)
    index.extend(tokens)
    return index


def _global_cache(docs: list[int], max_tokens: int, max_ngram: int) -> GlobalSuffixCache:
    cache = GlobalSuffixCache(max_tokens, max_ngram)
    for start in range(0, len(docs), DOC_TOKENS):
        cache.add(docs[start : start + DOC_TOKENS])
    return cache


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32_768, help="tokens in each index")
    p.add_argument("--calls", type=int, default=1000, help="decode steps timed")
    p.add_argument("--depth", type=int, default=6)
    p.add_argument("--max-nodes", type=int, default=24)
    p.add_argument("--max-ngram", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    print(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
