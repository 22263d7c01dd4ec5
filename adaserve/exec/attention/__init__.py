"""Attention backends: a small ABC, a torch reference (CPU), FlashInfer (CUDA)."""

from adaserve.exec.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata"]
