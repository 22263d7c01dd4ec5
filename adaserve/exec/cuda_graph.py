"""CUDA graphs: draft steps 2..d (DraftGraphRunner) and any small forward (ForwardGraphRunner).

Eager PyTorch launches some 40 kernels per decoder layer, each costing the host several
microseconds: on an H100 a 1-token forward of a 7B-shaped model took 22 ms eagerly against
4.4 ms of weight streaming (docs/results.md). A replayed graph launches them all at once.

Steps 2..d of speculation feed `width` frontier nodes for each of R requests, with tree masks:
the same shapes step after step and iteration after iteration; only R changes. A step's batch
is padded to the smallest bucket >= R with dummy requests (their tokens write KV into blocks
reserved for them, their outputs are dropped) and replayed from the graph of (bucket, width).

KV lengths need no bucket: in CUDA-graph mode FlashInfer sizes the kernel grid from the batch
size and token count alone, and its index and mask buffers are sized for the whole KV pool,
so one graph serves every context length (attention/flashinfer.py).

Captured: embedding, every decoder layer (K/V writes and attention kernels included) and the
final norm. On the host before each replay: the attention plan and copying token ids and
positions into the graph's input buffers. After it, eagerly: the LM head over the real rows
(one GEMM; capturing it would keep a [tokens, vocab] buffer per graph alive).
ForwardGraphRunner replays the target's (and a draft's) forwards of up to `max_tokens` tokens,
verification and decode alike: one graph per (sequence bucket, token bucket); a batch of S
sequences and T tokens is padded with dummy sequences to the smallest buckets S' >= S and
T' >= T + (S' - S) (each dummy holds at least one token). Larger forwards (prompt chunks)
stay eager: they are bound by the GPU, not the host.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from adaserve.exec.batch import ForwardBatch

if TYPE_CHECKING:  # torch_runner.py stays free of CUDA-graph code; the type alone is needed
    from adaserve.exec.torch_runner import ModelRunner

# Eager runs before capturing: JIT kernels load, cuBLAS picks its algorithms, the allocator warms.
WARMUP_RUNS = 2


def request_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Request counts to capture: 1, 2, 4, then every 8 up to max_num_seqs (always included).

    Padding costs at most 2x the requests below 8 and at most 7 dummy requests above.
    """
    if max_num_seqs <= 0:
        raise ValueError(f"max_num_seqs must be > 0, got {max_num_seqs}")
    small = [b for b in (1, 2, 4) if b < max_num_seqs]
    return tuple(sorted({*small, *range(8, max_num_seqs, 8), max_num_seqs}))


def choose_bucket(num_requests: int, buckets: Sequence[int]) -> int | None:
    """Smallest bucket >= num_requests (buckets sorted ascending); None if none is that large."""
    if num_requests <= 0:
        raise ValueError(f"num_requests must be > 0, got {num_requests}")
    i = bisect.bisect_left(buckets, num_requests)
    return buckets[i] if i < len(buckets) else None


def pad_batch(
    batch: ForwardBatch, num_seqs: int, width: int, dummy_table: list[int]
) -> ForwardBatch:
    """`batch` plus dummy sequences up to `num_seqs`: `width` tokens each, KV in `dummy_table`.

    A dummy sequence is `width` causal tokens at KV indices [0, width) of `dummy_table`; every
    dummy shares that table, so their K/V writes collide there, harmlessly.
    """
    extra = num_seqs - len(batch.query_lens)
    if extra < 0:
        raise ValueError(f"batch has {len(batch.query_lens)} sequences, more than {num_seqs}")
    return replace(
        batch,
        token_ids=batch.token_ids + [0] * (extra * width),
        positions=batch.positions + list(range(width)) * extra,
        query_lens=batch.query_lens + [width] * extra,
        kv_lens=batch.kv_lens + [width] * extra,
        block_tables=batch.block_tables + [dummy_table] * extra,
        trees=batch.trees + [None] * extra,
        logits_indices=None,
    )


def token_buckets(max_tokens: int) -> tuple[int, ...]:
    """Token counts to capture: 1, 2, 4, then every 8 up to max_tokens (always included)."""
    return request_buckets(max_tokens)


def pad_forward(
    batch: ForwardBatch, num_seqs: int, num_tokens: int, dummy_table: list[int]
) -> ForwardBatch:
    """`batch` plus dummy sequences up to `num_seqs` sequences and `num_tokens` tokens.

    The first dummy takes what the others (one token each) leave; every dummy is causal at KV
    indices [0, its length) of `dummy_table`, so their K/V writes collide there, harmlessly.
    """
    seqs, tokens = num_seqs - len(batch.query_lens), num_tokens - len(batch.token_ids)
    if seqs < 0 or tokens < seqs or (seqs == 0 and tokens > 0):
        raise ValueError(
            f"cannot pad {len(batch.query_lens)} sequences / {len(batch.token_ids)} tokens "
            f"to {num_seqs} / {num_tokens}"
        )
    lens = [tokens - seqs + 1] + [1] * (seqs - 1) if seqs else []
    return replace(
        batch,
        token_ids=batch.token_ids + [0] * tokens,
        positions=batch.positions + [i for n in lens for i in range(n)],
        query_lens=batch.query_lens + lens,
        kv_lens=batch.kv_lens + lens,
        block_tables=batch.block_tables + [dummy_table] * seqs,
        trees=batch.trees + [None] * seqs,
        logits_indices=None,
    )


def step_width(batch: ForwardBatch) -> int | None:
    """The common query length of a draft-step batch that wants every logit; None otherwise."""
    widths = set(batch.query_lens)
    every_logit = batch.logits_indices is None or list(batch.logits_indices) == list(
        range(len(batch.token_ids))
    )
    return widths.pop() if len(widths) == 1 and every_logit else None


def _check_runner(runner: ModelRunner) -> None:
    if runner.device.type != "cuda" or not runner.backend.supports_cuda_graphs():
        raise ValueError(
            "CUDA graphs need a CUDA runner whose attention backend supports them "
            f"(flashinfer); got {type(runner.backend).__name__} on {runner.device}"
        )


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph  # replay() reruns the captured forward
    input_ids: torch.Tensor  # [bucket * width] int64, cuda (static input)
    positions: torch.Tensor  # [bucket * width] int64, cuda (static input)
    hidden: torch.Tensor  # [bucket * width, hidden_size], cuda (static output)


class _GraphRunner:
    """What both runners share: the runner, the dummy sequences' KV blocks, captured graphs."""

    def __init__(self, runner: ModelRunner, dummy_tokens: int) -> None:
        _check_runner(runner)
        backend = runner.backend
        # The FlashInfer backend plans before the first layer runs, so it must know the query
        # heads up front (eagerly it learns them from the first forward).
        if getattr(backend, "num_qo_heads", 0) is None:
            backend.num_qo_heads = runner.model.args.num_heads  # type: ignore[attr-defined]
        self.runner = runner
        # Blocks for the dummy sequences' KV, taken from the pool for the runner's lifetime.
        blocks = -(-dummy_tokens // runner.cache.block_size)
        self._dummy_table = runner.cache.allocator.allocate(blocks)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        # One memory pool shared by every graph (torch's NewType of a (int, int) handle).
        self._pool: torch.cuda._POOL_HANDLE | None = None

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    def _capture(
        self, key: tuple[int, int], padded: ForwardBatch, max_kv_len: int | None = None
    ) -> _Graph:
        """Capture the forward of `padded` (its shape; its tokens and lengths are stand-ins)."""
        runner, dev = self.runner, self.runner.device
        ids = torch.tensor(padded.token_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(padded.positions, dtype=torch.long, device=dev)
        meta = padded.metadata()
        if max_kv_len is None:
            runner.backend.prepare_for_capture(len(ids), meta)
        else:
            runner.backend.prepare_for_capture(len(ids), meta, max_kv_len=max_kv_len)
        graph, hidden = self._record(lambda: runner.model(ids, pos, runner.backend))
        g = _Graph(graph, ids, pos, hidden)  # hidden: [tokens, hidden_size]
        self._graphs[key] = g
        return g

    def _replay(self, g: _Graph, padded: ForwardBatch) -> torch.Tensor:
        """Re-plan attention for `padded`, load its tokens, replay; the static hidden states."""
        self.runner.backend.prepare_for_replay(padded.metadata())
        g.input_ids.copy_(torch.tensor(padded.token_ids, dtype=torch.long), non_blocking=True)
        g.positions.copy_(torch.tensor(padded.positions, dtype=torch.long), non_blocking=True)
        g.graph.replay()
        return g.hidden

    def _record(self, fn: Callable[[], torch.Tensor]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Run `fn` eagerly on a side stream, then capture it; (graph, its static output)."""
        dev = self.runner.device
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(WARMUP_RUNS):
                fn()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = fn()
        if self._pool is None:
            self._pool = graph.pool()
        return graph, out

    def close(self) -> None:
        """Drop the graphs and give the dummy sequences' KV blocks back."""
        self._graphs.clear()
        if self._dummy_table:
            self.runner.cache.allocator.free(self._dummy_table)
            self._dummy_table = []


class DraftGraphRunner(_GraphRunner):
    """Replays captured draft forwards for step batches; `forward` equals `runner.forward`."""

    def __init__(
        self,
        runner: ModelRunner,
        max_num_seqs: int,
        max_width: int,
        buckets: Sequence[int] | None = None,
    ) -> None:
        super().__init__(runner, dummy_tokens=max_width)
        self.max_width = max_width
        self.buckets = tuple(sorted(buckets)) if buckets else request_buckets(max_num_seqs)

    def covers(self, batch: ForwardBatch) -> bool:
        """Whether `batch` is a step batch this runner can replay."""
        width = step_width(batch)
        return (
            width is not None
            and width <= self.max_width
            and choose_bucket(len(batch.query_lens), self.buckets) is not None
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """float32 logits [len(batch.token_ids), vocab], as runner.forward(batch) returns."""
        width = step_width(batch)
        bucket = choose_bucket(len(batch.query_lens), self.buckets)
        if width is None or width > self.max_width or bucket is None:
            raise ValueError("batch is not a draft-step shape this runner covers; see covers()")
        g = self._graphs.get((bucket, width)) or self.capture(bucket, width, batch)
        hidden = self._replay(g, pad_batch(batch, bucket, width, self._dummy_table))
        return self.runner.model.compute_logits(hidden[: len(batch.token_ids)])

    @torch.inference_mode()
    def capture(self, bucket: int, width: int, like: ForwardBatch) -> _Graph:
        """Capture the forward of `bucket` requests x `width` tokens (`like`: any ForwardBatch)."""
        padded = pad_batch(_empty(like), bucket, width, self._dummy_table)
        return self._capture((bucket, width), padded)


class ForwardGraphRunner(_GraphRunner):
    """Replays a runner's forwards of up to `max_tokens` tokens and `max_num_seqs` sequences.

    `forward(batch)` returns what `runner.forward(batch)` returns (logits of the wanted rows).
    Graphs are captured the first time their (sequence bucket, token bucket) is met.
    """

    def __init__(
        self, runner: ModelRunner, max_num_seqs: int, max_tokens: int, max_kv_len: int
    ) -> None:
        """max_kv_len: the longest KV a sequence may attend (sizes FlashInfer's graph buffers)."""
        super().__init__(runner, dummy_tokens=max_tokens)
        self.seq_buckets = request_buckets(max_num_seqs)
        self.tok_buckets = token_buckets(max_tokens)
        self.max_kv_len = max_kv_len

    def buckets(self, batch: ForwardBatch) -> tuple[int, int] | None:
        """(sequence bucket, token bucket) of `batch`; None if it is not replayed."""
        seqs = len(batch.query_lens)
        if not seqs or batch.features is not None or max(batch.kv_lens) > self.max_kv_len:
            return None
        return self.key(seqs, len(batch.token_ids))

    def key(self, seqs: int, tokens: int) -> tuple[int, int] | None:
        """(sequence bucket, token bucket) of a forward of `seqs` sequences and `tokens`
        tokens; None if no captured shape holds it."""
        s = choose_bucket(seqs, self.seq_buckets)
        if s is None:
            return None
        # Every dummy sequence holds a token: the token bucket leaves room for them.
        t = choose_bucket(tokens + s - seqs, self.tok_buckets)
        if t is not None and t > tokens and s == seqs:  # padding tokens need a dummy to hold them
            s = choose_bucket(seqs + 1, self.seq_buckets)
            if s is None:
                return None
            t = choose_bucket(tokens + s - seqs, self.tok_buckets)
        return None if t is None else (s, t)

    def covers(self, batch: ForwardBatch) -> bool:
        return self.buckets(batch) is not None

    def start_keys(self, max_num_seqs: int, budget: int) -> list[tuple[int, int]]:
        """The (sequence, token) buckets of every decode iteration: 1..max_num_seqs requests,
        each feeding its root, with tree nodes up to `budget` tokens in all (B counts the roots;
        0: no trees). Prompt chunks beside them are not included."""
        keys: set[tuple[int, int]] = set()
        for rows in range(1, max_num_seqs + 1):
            for tokens in range(rows, max(budget, rows) + 1):
                key = self.key(rows, tokens)
                if key is not None:
                    keys.add(key)
        return sorted(keys)

    @torch.inference_mode()
    def capture(self, keys: Sequence[tuple[int, int]]) -> int:
        """Capture the graphs of `keys` not held yet; returns how many it captured.

        A server does this at start-up for the shapes its decode iterations meet, so no
        request's iteration pays a capture (about three eager forwards); shapes left out
        (prompt chunks beside decode rows) are still captured the first time they are met.
        """
        template = ForwardBatch([], [], [], [], [], [])
        todo = [k for k in keys if k not in self._graphs]
        for key in todo:
            self._capture(key, pad_forward(template, *key, self._dummy_table), self.max_kv_len)
        return len(todo)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        key = self.buckets(batch)
        if key is None:
            raise ValueError("batch is not a shape this runner covers; see covers()")
        g = self._graphs.get(key) or self._capture(
            key, pad_forward(_empty(batch), *key, self._dummy_table), self.max_kv_len
        )
        hidden = self._replay(g, pad_forward(batch, *key, self._dummy_table))
        real = hidden[: len(batch.token_ids)]
        if self.runner.capture_hidden:
            self.runner.last_hidden = real.clone()  # the next replay overwrites `hidden`
        if batch.logits_indices is None:
            return self.runner.model.compute_logits(real)
        if not batch.logits_indices:
            return None
        idx = torch.tensor(batch.logits_indices, dtype=torch.long, device=real.device)
        return self.runner.model.compute_logits(real[idx])


def _empty(like: ForwardBatch) -> ForwardBatch:
    """`like` with no sequences: what a capture pads from."""
    return replace(
        like,
        token_ids=[],
        positions=[],
        query_lens=[],
        kv_lens=[],
        block_tables=[],
        trees=[],
        logits_indices=None,
        features=None,
    )
