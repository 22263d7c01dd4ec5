"""Timing a runner's forwards: the measured cost curve that seeds a cost model, the latency
of one shape, and the baseline latency of incremental decoding (the unit of relative SLOs).

Beside the runners: any `Runner` (`exec/runner.py`) is timed the same way.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.runner import Runner

# A forward's tokens are spread over at most this many sequences (the paper's baseline batch).
NUM_SEQS = 8
# The paper's baseline latency: incremental decoding at batch 8, input 32.
BASELINE_BATCH, BASELINE_INPUT = 8, 32
# Token counts where a CPU's cost curve bends (the 2nd token can cost more than the 8th).
SMALL_COUNTS = (1, 2, 3, 4, 6, 8, 12)
# The verification tree whose keys `tree_pair_cost` prices: this many tokens on one sequence.
TREE_TOKENS = 12
# `tree_pair_cost` times each shape this often (in alternating rounds of two runs), and its
# tree counts as slower than the curve's shape at this rank statistic or below (`slower_by`).
TREE_RUNS, MAX_TIES_U = 6, 5

T = TypeVar("T")
# Start-up measurements this process took, by (what, the runner's `timing_key`).
_MEASURED: dict[tuple[str, tuple], Any] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Keyed(Protocol):
    def timing_key(self) -> tuple | None: ...


def measured_once(runner: Keyed, what: str, measure: Callable[[], T]) -> T:
    """`measure()`, or what it returned the first time this process measured `what` on a
    runner with the same `timing_key` (the same model file, backend, threads, ...). An engine
    built again in one process (a second `LLM`, a test suite's many engines, a server's
    replacement scheduler) seeds its cost model from the first one's measurements instead of
    timing the same forwards again: on llama.cpp on 2 cores the cost curve and tree price take
    10-20 s of every start. A runner whose key is None is measured every time."""
    key = runner.timing_key()
    if key is None:
        return measure()
    k = (what, key)
    if k not in _MEASURED:
        _MEASURED[k] = measure()
    return _MEASURED[k]


def forget_measurements() -> None:
    """Drop what `measured_once` kept: the next engine times its forwards again."""
    _MEASURED.clear()


def split_tokens(tokens: int, num_seqs: int) -> list[int]:
    n = min(tokens, num_seqs)
    return [tokens // n + (i < tokens % n) for i in range(n)]


def time_forward(runner: Runner, tokens: int, context: int, repeats: int) -> float | None:
    """Median ms of one forward of `tokens` new tokens over `context` cached ones per sequence.

    None when the KV pool cannot hold the shape. KV is reserved for the run and released after.
    """
    samples = time_forward_samples(runner, tokens, context, repeats)
    return None if samples is None else statistics.median(samples)


def time_forward_samples(
    runner: Runner, tokens: int, context: int, repeats: int
) -> list[float] | None:
    """Every timed run (ms) of `time_forward`'s shape; None when the KV pool cannot hold it."""
    with ShapeTimer(runner, context) as timer:
        return timer.samples(tokens, repeats)


class ShapeTimer:
    """Times forwards of new tokens over sequences that hold `context` cached tokens each.

    A backend whose attention reads only the cells a sequence holds (ggml) would time a
    context-free forward, so the context is computed, once per sequence: the sequences are
    kept from shape to shape and cut back to `context` after every timed run. (Computing it
    per shape made the cost curve that seeds every ggml engine take ~20 s on a 2-core CPU.)
    Use as a context manager: leaving it releases every sequence's KV.
    """

    def __init__(self, runner: Runner, context: int) -> None:
        self.runner, self.context = runner, context
        self.tables: list[list[int]] = []  # sequences holding the context, in order of use

    def __enter__(self) -> ShapeTimer:
        return self

    def __exit__(self, *exc: object) -> None:
        for table in self.tables:
            self.runner.cache.release(table)
        self.tables = []

    def samples(self, tokens: int, repeats: int, num_seqs: int = NUM_SEQS) -> list[float] | None:
        """Every timed run (ms) of a forward of `tokens` new tokens over up to `num_seqs`
        sequences, each token with its logits (after one untimed run that warms the shape
        up); None when the KV pool cannot hold the shape."""
        runner, cache, context = self.runner, self.runner.cache, self.context
        lens = split_tokens(tokens, num_seqs)
        fresh: list[list[int]] = [[] for _ in range(len(lens) - len(self.tables))]
        need = sum(
            cache.blocks_needed(table, context + q)
            for table, q in zip([*self.tables, *fresh], lens)
        )
        if need > cache.allocator.num_free:
            return None
        if fresh:
            warm = SequenceBatchBuilder()
            for table in fresh:
                cache.reserve(table, context)
                if context:
                    warm.add(
                        list(range(1, context + 1)),
                        list(range(context)),
                        context,
                        table,
                        logits="none",
                    )
            self.tables += fresh
            if context and runner.needs_context:
                runner.forward(warm.batch)
        vocab = runner.args.vocab_size
        samples = []
        for i in range(repeats + 1):  # the first run warms this shape up and is not counted
            builder = SequenceBatchBuilder()
            for table, q in zip(self.tables, lens):
                cache.reserve(table, context + q)
                ids = [(context + j) % vocab for j in range(q)]  # any in-vocabulary ids will do
                builder.add(ids, list(range(context, context + q)), context + q, table)
            _sync(runner.device)
            start = time.perf_counter()
            runner.forward(builder.batch)
            _sync(runner.device)
            if i:
                samples.append(1000.0 * (time.perf_counter() - start))
            for table in self.tables[: len(lens)]:
                cache.truncate(table, context)
        return samples


def forward_cost_points(
    runner: Runner, max_tokens: int, context: int = 64, repeats: int = 2
) -> list[tuple[int, int, float]]:
    """A quick cost curve to seed the online cost model: (tokens, total context, seconds).

    The small counts where the curve bends (on a CPU the 2nd token can cost more than the
    8th), then powers of two up to `max_tokens`; the online model refines it as it runs.
    """
    counts, context = cost_point_shapes(runner, max_tokens, context)
    time_forward(runner, 1, 0, 1)  # the first forward allocates: keep it out of the numbers
    points = []
    with ShapeTimer(runner, context) as timer:
        for tokens in counts:
            samples = timer.samples(tokens, repeats)
            if samples is not None:
                ms = statistics.median(samples)
                points.append((tokens, context * len(split_tokens(tokens, NUM_SEQS)), ms / 1000.0))
    return points


def cost_point_shapes(runner: Runner, max_tokens: int, context: int = 64) -> tuple[list[int], int]:
    """The token counts `forward_cost_points` times and the context per sequence it times them
    over: the small counts where a CPU's curve bends, then powers of two up to `max_tokens`,
    over `context` cut down until the KV pool holds every shape (shrink the context, not the
    curve)."""
    small = [n for n in SMALL_COUNTS if n <= max_tokens]
    counts = sorted({*small, *powers_of_two(max_tokens)})
    cache = runner.cache
    per_seq = cache.allocator.num_free // NUM_SEQS * cache.block_size
    context = max(0, min(context, per_seq - -(-max_tokens // NUM_SEQS) - cache.block_size))
    return counts, context


def tree_pairs_of(lens: list[int], context: int) -> int:
    """The tree pairs (`ForwardBatch.cost_terms`) of sequences of `lens` tokens, each with its
    logits, over `context` cached tokens each: every token after its sequence's first, at
    position context + j, attends context + j + 1 keys."""
    return sum(context + j + 1 for q in lens for j in range(1, q))


def tree_pair_cost(runner: Runner, tokens: int = TREE_TOKENS, context: int = 64) -> float | None:
    """Seconds per tree pair (the cost model's h): what a verification tree's nodes pay to
    attend their request's context, beyond the cost curve's forwards of as many tokens.

    The cost curve spreads its `tokens` over NUM_SEQS sequences of `context` each, so its
    tokens attend short contexts; a tree puts them all on one request and every node attends
    the whole of it. Both shapes are timed TREE_RUNS times (alternating rounds of two runs) with
    the same total context, so the cost model prices them alike but for the tree pairs: the
    difference (`slower_by`) over the difference in tree pairs is h. On llama.cpp on 2 cores a
    12-token tree 512 tokens into one sequence took 47 ms where the curve's 12 tokens over
    8 x 64 took 35 ms, and with no h the cost model priced a 12- or 16-token tree at 0.67x of
    its time. 0.0 when the tree is not clearly slower: on torch here the difference is within
    the runs' noise, and a noise-made price cut its trees by half. None when the KV pool
    cannot hold the shapes."""
    spread = split_tokens(tokens, NUM_SEQS)
    total = context * len(spread)
    extra = tree_pairs_of([tokens], total) - tree_pairs_of(spread, context)
    if extra <= 0:
        return None
    times: tuple[list[float], list[float]] = ([], [])
    with ShapeTimer(runner, context) as curve, ShapeTimer(runner, total) as tree:
        for _ in range(TREE_RUNS // 2):
            for timer, num_seqs, out in ((curve, NUM_SEQS, times[0]), (tree, 1, times[1])):
                samples = timer.samples(tokens, 2, num_seqs)
                if samples is None:
                    return None
                out.extend(samples)
    return slower_by(times[0], times[1]) / 1000.0 / extra


def slower_by(base: list[float], other: list[float]) -> float:
    """How much slower the runs `other` are than the runs `base`: the median of their pairwise
    differences (Hodges-Lehmann), or 0.0 unless `other` is slower by a one-sided rank test
    (Mann-Whitney U, the pairs where a `base` run is as slow as an `other` run, at most
    MAX_TIES_U: for TREE_RUNS = 6 runs each, a 2% chance when both come from one
    distribution)."""
    if min(len(base), len(other)) < TREE_RUNS:
        raise ValueError(
            f"the rank test needs {TREE_RUNS} runs of each, got {len(base)}, {len(other)}"
        )
    diffs = [y - x for x in base for y in other]
    if sum(d <= 0 for d in diffs) > MAX_TIES_U:
        return 0.0
    return max(statistics.median(diffs), 0.0)


def baseline_latency_ms(runner: Runner, steps: int) -> float:
    """Minimal per-iteration latency of incremental decoding (batch 8, input 32, `steps` out).

    Each iteration is a 1-token-per-sequence forward plus the greedy pick that a real
    iteration's sampler makes (its host copy is where a GPU iteration really ends).
    """
    cache, vocab = runner.cache, runner.args.vocab_size
    tables: list[list[int]] = [[] for _ in range(BASELINE_BATCH)]
    total = BASELINE_INPUT + steps
    if BASELINE_BATCH * cache.blocks_needed([], total) > cache.allocator.num_free:
        raise ValueError(
            f"the KV pool ({cache.num_blocks} blocks) cannot hold the baseline batch "
            f"({BASELINE_BATCH} x {total} tokens); give it more blocks"
        )
    try:
        prefill = SequenceBatchBuilder()
        for t in tables:
            cache.reserve(t, total)
            prefill.add(
                [i % vocab for i in range(1, BASELINE_INPUT + 1)],
                list(range(BASELINE_INPUT)),
                BASELINE_INPUT,
                t,
                logits="last",
            )
        last = runner.forward(prefill.batch).argmax(-1).tolist()  # type: ignore[union-attr]
        best = float("inf")
        for pos in range(BASELINE_INPUT, total):
            step = SequenceBatchBuilder()
            for t, tok in zip(tables, last):
                step.add([tok], [pos], pos + 1, t)
            _sync(runner.device)
            start = time.perf_counter()
            last = runner.forward(step.batch).argmax(-1).tolist()  # type: ignore[union-attr]
            best = min(best, 1000.0 * (time.perf_counter() - start))
        return best
    finally:
        for t in tables:
            cache.release(t)


def powers_of_two(max_tokens: int) -> list[int]:
    counts = [1]
    while counts[-1] * 2 <= max_tokens:
        counts.append(counts[-1] * 2)
    return counts
