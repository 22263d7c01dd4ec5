"""A prompt chunk's forward on the ggml backend by its size, deep in a prompt and beside decode
rows: where llama.cpp's CPU attention tile (64 query tokens) makes a larger chunk cheaper.

    .venv/bin/python bench/chunk_tile.py [--context 0 500] [--rows 4] [--repeats 5]

On the default GGUF: for each context, the median ms of one forward of a chunk of N prompt
tokens that many tokens into its prompt (logits for its last token only), then the same
chunk sizes beside `--rows` decode rows, each its own sequence with `--context` tokens
cached. docs/results.md ("Prompt chunks a tile at a time") has a run; `prefill.tile_or_wait`
is the rule it led to.
"""

from __future__ import annotations

import argparse
import statistics
import time

from adaserve import LLMEngine
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from adaserve.exec.batch import SequenceBatchBuilder

SIZES = (1, 8, 16, 32, 48, 56, 60, 64, 96, 128, 256)


def forward_ms(runner, rows: int, chunk: int, context: int, repeats: int) -> float:
    """Median ms of a forward of `rows` decode rows and a `chunk`-token prompt chunk, every
    sequence `context` tokens in (cached before each timed run, which is not counted)."""
    cache, out = runner.cache, []
    for i in range(repeats + 1):  # the first run warms the shape up
        tables: list[list[int]] = [[] for _ in range(rows + 1)]
        for t in tables:
            cache.reserve(t, context + max(chunk, 1))
            if context:
                warm = SequenceBatchBuilder()
                warm.add(
                    list(range(1, context + 1)), list(range(context)), context, t, logits="none"
                )
                runner.forward(warm.batch)
        b = SequenceBatchBuilder()
        for t in tables[:rows]:
            b.add([7], [context], context + 1, t, logits="all")
        positions = list(range(context, context + chunk))
        b.add(list(range(5, 5 + chunk)), positions, context + chunk, tables[rows], logits="last")
        start = time.perf_counter()
        runner.forward(b.batch)
        elapsed = time.perf_counter() - start
        for t in tables:
            cache.release(t)
        if i:
            out.append(1000.0 * elapsed)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--context", type=int, nargs="+", default=[0, 500])
    ap.add_argument("--rows", type=int, default=4, help="decode rows beside the chunk (0: none)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    engine = LLMEngine(
        ModelConfig(backend="ggml"), CacheConfig(), SchedulerConfig(policy="incremental")
    )
    runner = engine.engine.target
    print("| context | decode rows | " + " | ".join(str(n) for n in SIZES) + " |")
    print("|---|---|" + "---|" * len(SIZES))
    for context in args.context:
        for rows in sorted({0, args.rows}):
            ms = [forward_ms(runner, rows, n, context, args.repeats) for n in SIZES]
            print(f"| {context} | {rows} | " + " | ".join(f"{m:.1f}" for m in ms) + " |")


if __name__ == "__main__":
    main()
