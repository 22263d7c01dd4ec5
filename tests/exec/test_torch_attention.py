"""The torch reference attention: every sequence of a mixed batch (prompt chunks, decode rows,
token trees) gets exactly the attention it would get alone, whichever SDPA group it lands in."""

from __future__ import annotations

import math
import random

import pytest
import torch

from adaserve.exec.attention.base import AttentionMetadata
from adaserve.exec.attention.torch_ref import (
    SHARED_QUERY_MAX,
    TorchAttentionBackend,
    kv_groups,
)
from adaserve.exec.kv_cache import KVCache

HQ, HKV, D, BLOCK = 6, 2, 16, 8


def tree_mask(q_len: int, kv_len: int, rng: random.Random) -> torch.Tensor:
    ctx = kv_len - q_len
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    mask[:, :ctx] = True
    parents = [-1] + [rng.randrange(i) for i in range(1, q_len)]
    for i in range(q_len):
        v = i
        while v >= 0:
            mask[i, ctx + v] = True
            v = parents[v]
    return mask


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v per head, keys repeated for grouped queries; q [t, HQ, D]."""
    rep = HQ // HKV
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)  # [kv, HQ, D]
    scores = torch.einsum("thd,khd->htk", q, k) / math.sqrt(D)
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("htk,khd->thd", scores.softmax(-1), v)


@pytest.mark.parametrize(
    "q_lens, kv_lens, trees",
    [
        # a long chunk beside decode rows and a tree: three SDPA groups' worth of layouts
        ([SHARED_QUERY_MAX + 9, 1, 7, 1], [90, 40, 25, 3], [False, False, True, False]),
        # two chunks, each alone, and nothing short
        ([SHARED_QUERY_MAX + 1, 64], [SHARED_QUERY_MAX + 1, 100], [False, False]),
        # short only: one shared group
        ([1, 5, SHARED_QUERY_MAX], [12, 30, 70], [False, True, False]),
        # one decode row with many keys and 15 padding rows of one key: two groups by keys
        ([1] * 16, [400] + [1] * 15, [False] * 16),
        # short rows in two groups by keys (a tree among the few-key ones), and a chunk
        (
            [1, 1, 6, 1, 1, 1, 1, 1, 1, 1, 1, SHARED_QUERY_MAX + 3],
            [420, 200, 30, 5, 9, 12, 20, 25, 28, 7, 3, 80],
            [False, False, True] + [False] * 9,
        ),
    ],
)
def test_each_sequence_attends_as_if_alone(q_lens, kv_lens, trees) -> None:
    torch.manual_seed(0)
    rng = random.Random(1)
    cache = KVCache(1, 160, BLOCK, HKV, D, torch.float32, "cpu")
    blocks = list(range(160))
    rng.shuffle(blocks)
    tables, masks, old = [], [], []
    for q_len, kv_len, tree in zip(q_lens, kv_lens, trees):
        table = [blocks.pop() for _ in range(-(-kv_len // BLOCK))]
        tables.append(table)
        masks.append(tree_mask(q_len, kv_len, rng) if tree else None)
        # the context already in the cache
        ctx = cache.slots(table, 0, kv_len - q_len)
        old.append((torch.randn(len(ctx), HKV, D), torch.randn(len(ctx), HKV, D)))
        cache.k[0][ctx], cache.v[0][ctx] = old[-1]
    meta = AttentionMetadata(q_lens, kv_lens, tables, masks)
    total = sum(q_lens)
    q, k, v = torch.randn(total, HQ, D), torch.randn(total, HKV, D), torch.randn(total, HKV, D)
    backend = TorchAttentionBackend(cache)
    backend.plan(meta)
    out = backend.forward(q, k, v, 0)
    assert out.shape == (total, HQ, D)
    start = 0
    for s, (q_len, kv_len) in enumerate(zip(q_lens, kv_lens)):
        end = start + q_len
        keys = torch.cat([old[s][0], k[start:end]])
        values = torch.cat([old[s][1], v[start:end]])
        mask = masks[s]
        if mask is None:
            ctx = kv_len - q_len
            mask = torch.arange(kv_len)[None, :] <= ctx + torch.arange(q_len)[:, None]
        want = naive(q[start:end], keys, values, mask)
        torch.testing.assert_close(out[start:end], want, atol=1e-5, rtol=1e-4)
        # the new keys landed in the sequence's own slots
        slots = cache.slots(tables[s], kv_len - q_len, kv_len)
        assert torch.equal(cache.k[0][slots], k[start:end])
        start = end


def test_rows_with_few_keys_are_not_padded_to_a_long_rows_keys() -> None:
    # One decode row at 950 keys and 15 one-key padding rows: the padding attends apart.
    assert kv_groups(list(range(16)), [950] + [1] * 15) == [[0], list(range(1, 16))]
    # Decode rows of similar contexts, or too few short ones to pay for a group: one group.
    assert kv_groups([0, 1, 2, 3], [900, 850, 300, 120]) == [[0, 1, 2, 3]]
    assert kv_groups([0, 1], [950, 1]) == [[0, 1]]  # 949 keys saved: under KV_SPLIT_MIN_SLOTS
    # Three scales of keys, each group in the batch's order; only the listed sequences.
    kv = [4000, 30, 900, 3500, 20, 850, 10, 25, 5]
    assert kv_groups([0, 1, 2, 3, 4, 5, 6, 7, 8], kv) == [[0, 3], [2, 5], [1, 4, 6, 7, 8]]
    assert kv_groups([2, 5, 6], kv) == [[2, 5, 6]]
    assert kv_groups([], kv) == []
