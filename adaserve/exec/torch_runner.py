"""The torch runners: this package's model code over the paged KV cache (CPU or CUDA).

`ModelRunner` runs a target or draft model; `EagleRunner` an EAGLE head, which also reads
the target's features. Both implement `exec/runner.py`'s `Runner`; the attention backend
(torch reference or FlashInfer) gets the batch's trees as masks (`ForwardBatch.metadata`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from adaserve.exec.attention.base import AttentionBackend
from adaserve.exec.attention.torch_ref import TorchAttentionBackend
from adaserve.exec.batch import ForwardBatch
from adaserve.exec.kv_cache import KVCache
from adaserve.exec.model.eagle import EagleHead
from adaserve.exec.model.llama import LlamaArgs, LlamaForCausalLM
from adaserve.exec.timing import forward_cost_points, tree_pair_cost

if TYPE_CHECKING:  # cuda_graph.py imports this module's types the same way
    from adaserve.exec.cuda_graph import ForwardGraphRunner


class ModelRunner:
    """One model, its KV cache and attention backend."""

    # forward(pad_to=...) runs the extra rows (the controller pads when that is cheaper).
    supports_padding = True
    needs_context = False  # the paged KV holds whatever the slots hold; timing needs no prefill
    attention_tile_tokens: int | None = None  # no step in the cost at a forward size

    def __init__(
        self,
        model: LlamaForCausalLM,
        cache: KVCache,
        backend: AttentionBackend,
        checkpoint: Path | None = None,
    ) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.checkpoint = checkpoint
        self.device = cache.device
        # When set, every forward keeps its final hidden states [T, hidden] (flat, padding
        # rows last) in `last_hidden`: what an EAGLE head drafts from.
        self.capture_hidden = False
        self.last_hidden: torch.Tensor | None = None
        # CUDA only: replays forwards it covers from graphs (exec/cuda_graph.ForwardGraphRunner).
        self.graphs: ForwardGraphRunner | None = None

    @property
    def args(self) -> LlamaArgs:
        return self.model.args

    @property
    def head_token_ids(self) -> torch.Tensor | None:
        return self.model.head_token_ids

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, pad_to: int | None = None) -> torch.Tensor | None:
        """Run the batch; float32 logits [len(logits_indices), vocab], or None if none wanted.

        `pad_to`: run at least this many tokens, the rest a throw-away sequence in scratch KV.
        On some CPUs a few more rows make the matrix products cheaper (see the cost model);
        padding is skipped when the KV pool has no room for it.
        """
        pad = 0 if pad_to is None else pad_to - len(batch.token_ids)
        if pad <= 0:
            return self._forward(batch)
        # Padding rides as extra sequences no longer than the batch's longest, so a backend that
        # pads queries to the longest sequence (the torch reference) does no extra work for it.
        chunk = max(batch.query_lens)
        lens = [min(chunk, pad - i) for i in range(0, pad, chunk)]
        if sum(self.cache.blocks_needed([], n) for n in lens) > self.cache.allocator.num_free:
            return self._forward(batch)
        tables: list[list[int]] = [[] for _ in lens]
        for table, n in zip(tables, lens):
            self.cache.reserve(table, n)
        try:
            padded = ForwardBatch(
                batch.token_ids + [0] * pad,
                batch.positions + [i for n in lens for i in range(n)],
                batch.query_lens + lens,
                batch.kv_lens + lens,
                batch.block_tables + tables,
                batch.trees + [None] * len(lens),
                # Padding rows never produce logits.
                list(range(len(batch.token_ids)))
                if batch.logits_indices is None
                else batch.logits_indices,
                batch.features,
            )
            return self._forward(padded)
        finally:
            for table in tables:
                self.cache.release(table)

    def cost_points(self, max_tokens: int) -> list[tuple[int, int, float]]:
        """A quick measured cost curve (tokens, context, seconds) that seeds a cost model."""
        return forward_cost_points(self, max_tokens)

    def tree_pair_cost(self) -> float | None:
        """Seconds per tree pair beyond the cost curve, measured (`timing.tree_pair_cost`)."""
        return tree_pair_cost(self)

    def timing_key(self) -> tuple | None:
        """The weights file, the runner's class (an EAGLE head's forward is not a model's),
        vocabulary, device, dtype, threads, attention backend, KV block size, CUDA graphs, LM
        head width and hidden-state capture; None for a model built in memory (no file names
        it)."""
        if self.checkpoint is None:
            return None
        head = self.head_token_ids
        return (
            type(self).__name__,
            str(Path(self.checkpoint).resolve()),
            self.args.vocab_size,  # an EAGLE head beside a GGUF borrows its target's embedding
            str(self.device),
            str(next(self.model.parameters()).dtype),
            torch.get_num_threads(),
            type(self.backend).__name__,
            self.cache.block_size,
            self.graphs is not None,
            None if head is None else len(head),
            self.capture_hidden,
        )

    def _forward(self, batch: ForwardBatch) -> torch.Tensor | None:
        if self.graphs is not None and self.graphs.covers(batch):
            return self.graphs.forward(batch)
        self.backend.plan(batch.metadata())
        ids = torch.tensor(batch.token_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        hidden = self._hidden(batch, ids, pos)  # [T, hidden]
        if self.capture_hidden:
            self.last_hidden = hidden
        if batch.logits_indices is None:
            return self.model.compute_logits(hidden)
        if not batch.logits_indices:
            return None
        idx = torch.tensor(batch.logits_indices, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden[idx])

    def _hidden(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.model(ids, pos, self.backend)


class EagleRunner(ModelRunner):
    """An EAGLE head (`exec/model/eagle.py`) with its own KV cache; reads batch.features."""

    model: EagleHead  # type: ignore[assignment]

    def __init__(
        self,
        model: EagleHead,
        cache: KVCache,
        backend: AttentionBackend,
        checkpoint: Path | None = None,
    ) -> None:
        super().__init__(model, cache, backend, checkpoint)  # type: ignore[arg-type]
        self.capture_hidden = True  # the drafter reads each row's output feature

    def _hidden(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        feats = torch.zeros(len(ids), self.model.args.hidden_size, device=self.device)
        if batch.features is not None:  # padding rows (and profiling) read zeros
            feats[: len(batch.features)] = batch.features
        return self.model(ids, pos, self.backend, feats)


def make_attention_backend(
    name: str, cache: KVCache, num_qo_heads: int | None = None
) -> AttentionBackend:
    if name == "auto":
        # FlashInfer has no float32 kernels: a float32 model stays on the torch reference.
        fits = cache.device.type == "cuda" and cache.k.dtype in (torch.float16, torch.bfloat16)
        name = "flashinfer" if fits and has_flashinfer() else "torch"
    if name == "torch":
        return TorchAttentionBackend(cache)
    if name == "flashinfer":
        from adaserve.exec.attention.flashinfer import FlashInferAttentionBackend

        return FlashInferAttentionBackend(cache, num_qo_heads=num_qo_heads)
    raise ValueError(f"attention_backend must be auto, torch or flashinfer, got {name!r}")


def has_flashinfer() -> bool:
    try:
        import adaserve.exec.attention.flashinfer  # noqa: F401

        return True
    except ImportError:
        return False
