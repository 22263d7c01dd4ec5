"""Reference attention in plain torch (CPU and tests): SDPA with boolean masks over gathered KV.

Sequences are padded to a common [max_query, max_kv] so one SDPA call serves many of them.
Padding a decode row (1 query) or a tree (a few) to a prompt chunk's length would make every
row pay the chunk's attention: 3 decode rows beside a 256-token chunk at 900 keys cost as much
attention as 4 chunks (measured on the default model: 4.3 ms per prompt token in such an
iteration against 2.5 in a prefill alone). So a sequence whose query is longer than
`SHARED_QUERY_MAX` attends in its own group; the short ones share one, or a few by their
keys (`kv_groups`): a row with few keys padded to a long row's keys gathers and attends them
all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from adaserve.exec.attention.base import AttentionBackend, AttentionMetadata
from adaserve.exec.kv_cache import KVCache

# Longest query that shares a padded SDPA call with others (decode rows and token trees); a
# longer one (a prompt chunk) runs alone.
SHARED_QUERY_MAX = 32
# Short sequences whose keys number under 1 / KV_SPLIT_RATIO of the longest's attend in a group
# of their own when that gathers at least KV_SPLIT_MIN_SLOTS fewer keys: one decode row at 950
# keys padded by 15 one-token padding rows (`TorchRunner.forward(pad_to=16)`) cost 165-249 ms
# a forward in one group, each padding row gathering and attending all 950 keys, against ~50
# for the row alone (docs/results.md, twenty-second session). A group costs an SDPA call a
# layer, so rows of similar contexts stay together.
KV_SPLIT_RATIO = 4
KV_SPLIT_MIN_SLOTS = 2048


@dataclass
class _Group:
    """Sequences attended by one padded SDPA call."""

    kv_slots: torch.Tensor  # [n, max_kv] KV slots to gather
    mask: torch.Tensor  # [n, 1, max_q, max_kv]
    rows: torch.Tensor  # [t] padded row of each of the group's tokens
    cols: torch.Tensor  # [t] padded query column of each
    tokens: torch.Tensor  # [t] their index in the flat batch
    shape: tuple[int, int]  # (n, max_q)


def kv_groups(seqs: list[int], kv_lens: list[int]) -> list[list[int]]:
    """`seqs` (indices into `kv_lens`) split into groups padded to their own longest keys: from
    the longest down, the sequences with under 1 / KV_SPLIT_RATIO of a group's longest keys
    start a new group when that saves KV_SPLIT_MIN_SLOTS gathered keys or more. Each group
    in the original order; [] for no sequences."""
    order = sorted(seqs, key=lambda s: -kv_lens[s])
    groups: list[list[int]] = []
    while order:
        top = kv_lens[order[0]]
        cut = next(
            (i for i, s in enumerate(order) if kv_lens[s] * KV_SPLIT_RATIO < top), len(order)
        )
        rest = order[cut:]
        if rest and len(rest) * (top - kv_lens[rest[0]]) >= KV_SPLIT_MIN_SLOTS:
            groups.append(sorted(order[:cut]))
            order = rest
        else:
            groups.append(sorted(order))
            order = []
    return groups


class TorchAttentionBackend(AttentionBackend):
    """Groups the batch's sequences by query length; one SDPA call per group and layer."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def plan(self, meta: AttentionMetadata) -> None:
        dev = self.cache.device
        starts, write_slots = [], []
        start = 0
        for q_len, kv_len, table in zip(meta.query_lens, meta.kv_lens, meta.block_tables):
            starts.append(start)
            start += q_len
            write_slots.append(self.cache.slots(table, kv_len - q_len, kv_len))
        self._write_slots = torch.cat(write_slots).to(dev)  # [T]
        self._num_tokens = start
        shared = [s for s, q in enumerate(meta.query_lens) if q <= SHARED_QUERY_MAX]
        alone = [[s] for s, q in enumerate(meta.query_lens) if q > SHARED_QUERY_MAX]
        groups = kv_groups(shared, meta.kv_lens) + alone
        self._groups = [self._plan_group(meta, seqs, starts) for seqs in groups]

    def _plan_group(self, meta: AttentionMetadata, seqs: list[int], starts: list[int]) -> _Group:
        n = len(seqs)
        q_lens = [meta.query_lens[s] for s in seqs]
        kv_lens = [meta.kv_lens[s] for s in seqs]
        max_q, max_kv = max(q_lens), max(kv_lens)
        kv_slots = torch.zeros(n, max_kv, dtype=torch.long)
        for i, s in enumerate(seqs):
            kv_slots[i, : kv_lens[i]] = self.cache.slots(meta.block_tables[s], 0, kv_lens[i])
        # Causal for every sequence at once (new token j sees KV indices up to
        # kv_len - q_len + j), then the trees' own masks over theirs. Padded query rows see
        # column 0 only (any valid column avoids NaN; their outputs are discarded).
        ql = torch.tensor(q_lens)
        row = torch.arange(max_q)
        last = (torch.tensor(kv_lens) - ql)[:, None] + row[None, :]  # [n, max_q]
        real = row[None, :] < ql[:, None]  # [n, max_q]
        mask = (torch.arange(max_kv)[None, None, :] <= last[:, :, None]) & real[:, :, None]
        mask[:, :, 0] |= ~real
        for i, s in enumerate(seqs):
            m = meta.masks[s]
            if m is not None:
                mask[i, : q_lens[i], : kv_lens[i]] = m
        cols: list[int] = []
        tokens: list[int] = []
        for i, s in enumerate(seqs):
            cols.extend(range(q_lens[i]))
            tokens.extend(range(starts[s], starts[s] + q_lens[i]))
        dev = self.cache.device
        return _Group(
            kv_slots=kv_slots.to(dev),
            mask=mask[:, None].to(dev),
            rows=torch.repeat_interleave(torch.arange(n), ql).to(dev),
            cols=torch.tensor(cols, dtype=torch.long).to(dev),
            tokens=torch.tensor(tokens, dtype=torch.long).to(dev),
            shape=(n, max_q),
        )

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [slots, Hkv, D]
        k_cache.index_copy_(0, self._write_slots, k)
        v_cache.index_copy_(0, self._write_slots, v)
        if len(self._groups) == 1 and self._groups[0].tokens.shape[0] == self._num_tokens:
            return self._attend(q, k_cache, v_cache, self._groups[0], all_tokens=True)
        out = q.new_empty(q.shape)
        for g in self._groups:
            out[g.tokens] = self._attend(q, k_cache, v_cache, g, all_tokens=False)
        return out

    @staticmethod
    def _attend(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        g: _Group,
        all_tokens: bool,
    ) -> torch.Tensor:
        """The group's tokens' attention output, [t, Hq, D] in the order of `g.tokens`."""
        n, max_q = g.shape
        qp = q.new_zeros(n, max_q, q.shape[1], q.shape[2])
        qp[g.rows, g.cols] = q if all_tokens else q[g.tokens]
        # index_select of the flat slot list: the same rows as `k_cache[g.kv_slots]`, which
        # takes 3x as long on CPU (advanced indexing; 154 against 55 us for 600 slots).
        n_kv = g.kv_slots.shape[1]
        flat = g.kv_slots.view(-1)
        kp = k_cache.index_select(0, flat).view(n, n_kv, *k_cache.shape[1:])  # [n, max_kv, Hkv, D]
        vp = v_cache.index_select(0, flat).view(n, n_kv, *v_cache.shape[1:])
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            kp.transpose(1, 2),
            vp.transpose(1, 2),
            attn_mask=g.mask,
            enable_gqa=True,
        )  # [n, Hq, max_q, D]
        return out.transpose(1, 2)[g.rows, g.cols]
