"""Paged KV cache: allocator accounting and keep-subset compaction (property tests)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.exec.kv_cache import KVCache, NoFreeBlocksError


def make_cache(num_blocks: int = 32, block_size: int = 4) -> KVCache:
    return KVCache(
        num_layers=2,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=1,
        head_dim=2,
        dtype=torch.float32,
        device="cpu",
    )


def fill(cache: KVCache, table: list[int], start: int, end: int, base: float) -> None:
    """Write a recognisable value (base + KV index) into entries [start, end) of every layer."""
    slots = cache.slots(table, start, end)
    vals = base + torch.arange(start, end, dtype=torch.float32)
    for layer in range(cache.k.shape[0]):
        cache.k[layer, slots] = (vals + layer)[:, None, None]
        cache.v[layer, slots] = -(vals + layer)[:, None, None]


def read(cache: KVCache, table: list[int], start: int, end: int, layer: int = 0) -> list[float]:
    return cache.k[layer, cache.slots(table, start, end), 0, 0].tolist()


@settings(max_examples=200, deadline=None)
@given(
    context=st.integers(0, 40),
    fresh=st.integers(1, 30),
    block_size=st.sampled_from([1, 2, 4, 16]),
    data=st.data(),
)
def test_keep_subset_moves_kept_entries_and_frees_the_rest(context, fresh, block_size, data):
    cache = make_cache(num_blocks=128, block_size=block_size)
    table: list[int] = []
    cache.reserve(table, context + fresh)
    fill(cache, table, 0, context + fresh, base=1000.0)
    keep = sorted(data.draw(st.sets(st.integers(0, fresh - 1))))
    before_ctx = read(cache, table, 0, context)
    expected = [1000.0 + context + k for k in keep]
    cache.keep_subset(table, context, keep)
    assert read(cache, table, 0, context) == before_ctx, "committed context changed"
    assert read(cache, table, context, context + len(keep)) == expected, (
        "kept entries not compacted"
    )
    assert cache.k.shape[0] == 2 and cache.v[
        1, cache.slots(table, context, context + len(keep)), 0, 0
    ].tolist() == [-(e + 1) for e in expected], "layer 1 / V not moved alike"
    assert len(table) == -(-(context + len(keep)) // block_size), (
        "blocks past the kept entries not freed"
    )
    assert cache.allocator.num_used == len(table), "allocator count disagrees with the block table"
    cache.release(table)
    assert cache.allocator.num_free == cache.num_blocks, "blocks leaked after release"


def test_allocator_refuses_over_allocation_and_double_free():
    cache = make_cache(num_blocks=4)
    table: list[int] = []
    cache.reserve(table, 16)
    with pytest.raises(NoFreeBlocksError, match="asked for 1 KV blocks, 0 free"):
        cache.reserve(table, 17)
    blocks = list(table)
    cache.release(table)
    with pytest.raises(RuntimeError, match="freed twice"):
        cache.allocator.free(blocks[:1])


def test_keep_subset_rejects_unsorted_offsets():
    cache = make_cache()
    table: list[int] = []
    cache.reserve(table, 8)
    with pytest.raises(ValueError, match="strictly increasing"):
        cache.keep_subset(table, 2, [3, 1])
