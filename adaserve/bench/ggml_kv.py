"""What the ggml backend's unified KV cache costs a forward, against one stream per sequence.

    python -m adaserve.bench.ggml_kv [--others 0 16] [--context 200 800] [--chunks 32 128]
    python -m adaserve.bench.ggml_kv --idle 0 4000 16000 48000

The ggml backend keeps every request in one llama.cpp KV cache (`exec/ggml.py`: trees share
their request's cells by sequence ids), as llama-server does not (one stream per slot). In one
cache a query row's attention walks the mask of every occupied cell, whoever owns it; this
measures that price on the default GGUF: `--others` sequences of `--context` tokens each sit in
the cache, then the median time (--repeats) of a forward of one decode row per sequence, and of
a `--chunks`-token prompt chunk of a new sequence, in a unified cache, then in per-sequence
streams. Prints markdown; docs/results.md has a run.

`--idle`: what cells nobody queries cost (a prefix kept for requests that have ended:
exec/ggml_cache.py). Four 300-token sequences sit in a unified cache of 65,536 cells, then
sequences of 400 tokens until `--idle` tokens more; the median time of one decode row per
live sequence and of four rows each (a tree's size).
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

STREAMS = 32  # sequences of the per-stream context (each stream gets n_ctx / STREAMS cells)
CELLS_PER_STREAM = 4096


def _context(unified: bool, threads: int | None):
    from adaserve.exec.default_model import default_gguf_file
    from adaserve.exec.ggml import LlamaCppContext

    n_ctx = STREAMS * CELLS_PER_STREAM
    return LlamaCppContext(
        default_gguf_file(), n_ctx, 2048, n_threads=threads, streams=None if unified else STREAMS
    )


def _fill(ctx, seq: int, n: int, rng: np.random.Generator, start: int = 0) -> float:
    """Decode `n` random tokens of `seq` from position `start`; the seconds it took."""
    tokens = rng.integers(100, 20000, n).astype(np.int32)
    positions = np.arange(start, start + n, dtype=np.int32)
    want = np.arange(n) == n - 1
    t0 = time.perf_counter()
    ctx.decode(tokens, positions, np.full(n, seq, np.int32), {}, want)
    return time.perf_counter() - t0


def _rows_ms(ctx, rng: np.random.Generator, seqs: int, rows: int, context: int, repeats: int):
    """Median ms of a forward of `rows` new tokens on each of sequences 0..seqs-1 (each
    `context` tokens long), cut back after every run; the first run is a warm-up."""
    times = []
    for _ in range(repeats + 1):
        tokens = rng.integers(100, 20000, seqs * rows).astype(np.int32)
        ids = np.repeat(np.arange(seqs, dtype=np.int32), rows)
        pos = (context + np.tile(np.arange(rows), seqs)).astype(np.int32)
        t0 = time.perf_counter()
        ctx.decode(tokens, pos, ids, {}, np.ones(seqs * rows, bool))
        times.append(time.perf_counter() - t0)
        for s in range(seqs):
            ctx.seq_rm(s, context, -1)
    return 1000.0 * statistics.median(times[1:])


def measure(
    unified: bool, others: int, context: int, chunks: list[int], repeats: int, threads: int | None
) -> dict[str, float]:
    """Median ms of each shape with `others` sequences of `context` tokens in the cache."""
    ctx = _context(unified, threads)
    rng = np.random.default_rng(0)
    try:
        for s in range(others):
            _fill(ctx, s, context, rng)
        out: dict[str, float] = {}
        if others:
            out[f"{others} decode rows"] = _rows_ms(ctx, rng, others, 1, context, repeats)
        new = others  # a sequence id of its own
        for c in chunks:
            times = []
            for _ in range(repeats + 1):
                times.append(_fill(ctx, new, c, rng))
                ctx.seq_rm(new)
            out[f"{c}-token chunk"] = 1000.0 * statistics.median(times[1:])
        if others:
            # An iteration as the server runs them: every sequence's decode row and a chunk.
            c = max(chunks)
            tokens = rng.integers(100, 20000, others + c).astype(np.int32)
            seqs = np.concatenate([np.arange(others), np.full(c, new)]).astype(np.int32)
            pos = np.concatenate([np.full(others, context), np.arange(c)]).astype(np.int32)
            want = np.concatenate([np.ones(others, bool), np.arange(c) == c - 1])
            times = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                ctx.decode(tokens, pos, seqs, {}, want)
                times.append(time.perf_counter() - t0)
                for s in range(others):
                    ctx.seq_rm(s, context, -1)
                ctx.seq_rm(new)
            out[f"{others} decode rows + {c}-token chunk"] = 1000.0 * statistics.median(times[1:])
        return out
    finally:
        ctx.close()


def measure_idle(
    idle_tokens: int, repeats: int, threads: int | None, live: int = 4, context: int = 300
) -> dict[str, float]:
    """Median ms of `live` sequences' forwards with `idle_tokens` cells of others beside."""
    from adaserve.exec.default_model import default_gguf_file
    from adaserve.exec.ggml import LlamaCppContext

    ctx = LlamaCppContext(default_gguf_file(), 65536, 2048, n_threads=threads)
    rng = np.random.default_rng(0)
    try:
        for s in range(live):  # the live sequences' cells first, as a server fills its cache
            _fill(ctx, s, context, rng)
        seq = live
        while idle_tokens > 0:
            _fill(ctx, seq, min(400, idle_tokens), rng)
            idle_tokens -= 400
            seq += 1
        out: dict[str, float] = {}
        for rows in (1, 4):
            out[f"{live * rows} rows"] = _rows_ms(ctx, rng, live, rows, context, repeats)
        return out
    finally:
        ctx.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--others", type=int, nargs="+", default=[0, 16])
    ap.add_argument("--context", type=int, nargs="+", default=[200, 800])
    ap.add_argument("--chunks", type=int, nargs="+", default=[32, 128])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--idle", type=int, nargs="+", default=None, help="idle cells to try")
    args = ap.parse_args(argv)
    if args.idle is not None:
        print("| idle cells | 4 decode rows ms | 16 rows (4 x 4) ms |")
        print("|---|---|---|")
        for idle in args.idle:
            r = measure_idle(idle, max(args.repeats, 20), args.threads)
            print(f"| {idle} | {r['4 rows']:.1f} | {r['16 rows']:.1f} |", flush=True)
        return
    if max(args.others) >= STREAMS:
        ap.error(f"--others must stay below {STREAMS} (one stream is the new sequence's)")
    if max(args.context) + max(args.chunks) > CELLS_PER_STREAM:
        ap.error(f"--context + --chunks must fit a stream of {CELLS_PER_STREAM} cells")
    print("| cache holds | forward | unified ms | per-sequence streams ms | unified / streams |")
    print("|---|---|---|---|---|")
    for others in args.others:
        for context in args.context if others else [0]:
            a = measure(True, others, context, args.chunks, args.repeats, args.threads)
            b = measure(False, others, context, args.chunks, args.repeats, args.threads)
            held = f"{others} x {context} tokens" if others else "nothing"
            for shape in a:
                print(
                    f"| {held} | {shape} | {a[shape]:.1f} | {b[shape]:.1f} | "
                    f"{a[shape] / b[shape]:.2f}x |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
