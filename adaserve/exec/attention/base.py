"""Attention backend interface: `plan` once per forward, `forward` once per layer."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Who attends to what in one forward over a flat batch of sequences.

    Sequence s owns the flat tokens [sum(query_lens[:s]), sum(query_lens[:s+1])). Its new tokens
    are written to KV indices [kv_lens[s] - query_lens[s], kv_lens[s]) of its block table, and each
    attends over KV indices [0, kv_lens[s]). A KV index is a slot in the sequence's own order
    (block_table[i // block_size] * block_size + i % block_size); it need not equal the token's
    position (tree nodes share positions; their positions go to RoPE, not here).
    """

    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    # Per sequence: None for causal, else [query_len, kv_len] bool (True = may attend).
    masks: list[torch.Tensor | None]

    def __post_init__(self) -> None:
        n = len(self.query_lens)
        if not (len(self.kv_lens) == len(self.block_tables) == len(self.masks) == n):
            raise ValueError("AttentionMetadata lists must have one entry per sequence")
        for q, kv, m in zip(self.query_lens, self.kv_lens, self.masks):
            if q > kv:
                raise ValueError(f"query_len {q} exceeds kv_len {kv}")
            if m is not None and tuple(m.shape) != (q, kv):
                raise ValueError(f"mask shape {tuple(m.shape)} != (query_len, kv_len) = {(q, kv)}")

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)


class AttentionBackend(ABC):
    """Runs attention over a paged KV cache for the model's layers."""

    @abstractmethod
    def plan(self, meta: AttentionMetadata) -> None:
        """Prepare index/mask tensors for the next forward (called once per forward)."""

    @abstractmethod
    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        """Write k/v [T, Hkv, D] to the cache, attend q [T, Hq, D]; returns [T, Hq, D]."""

    # CUDA-graph hooks. Backends that support capture override these.
    def supports_cuda_graphs(self) -> bool:
        return False

    def prepare_for_capture(
        self, max_tokens: int, meta: AttentionMetadata | None = None, max_kv_len: int | None = None
    ) -> None:
        raise RuntimeError(f"{type(self).__name__} does not support CUDA graphs")

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        raise RuntimeError(f"{type(self).__name__} does not support CUDA graphs")
