"""Reference attention in plain torch (CPU and tests): SDPA with boolean masks over gathered KV."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from adaserve.exec.attention.base import AttentionBackend, AttentionMetadata
from adaserve.exec.kv_cache import KVCache


class TorchAttentionBackend(AttentionBackend):
    """Pads the batch to [num_seqs, max_query, max_kv] and runs one SDPA call per layer."""

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache

    def plan(self, meta: AttentionMetadata) -> None:
        dev = self.cache.device
        n, max_q, max_kv = len(meta.query_lens), max(meta.query_lens), max(meta.kv_lens)
        kv_slots = torch.zeros(n, max_kv, dtype=torch.long)
        mask = torch.zeros(n, max_q, max_kv, dtype=torch.bool)
        q_rows, q_cols, write_slots = [], [], []
        for s, (q_len, kv_len, table, m) in enumerate(
            zip(meta.query_lens, meta.kv_lens, meta.block_tables, meta.masks)
        ):
            slots = self.cache.slots(table, 0, kv_len)  # [kv_len]
            kv_slots[s, :kv_len] = slots
            write_slots.append(slots[kv_len - q_len :])
            if m is None:
                # causal: new token i sees KV indices < kv_len - q_len + i + 1
                ctx = kv_len - q_len
                mask[s, :q_len, :kv_len] = (
                    torch.arange(kv_len)[None, :] <= ctx + torch.arange(q_len)[:, None]
                )
            else:
                mask[s, :q_len, :kv_len] = m
            mask[s, q_len:, 0] = True  # padded query rows: any valid column avoids NaN; discarded
            q_rows.append(torch.full((q_len,), s, dtype=torch.long))
            q_cols.append(torch.arange(q_len))
        self._kv_slots = kv_slots.to(dev)
        self._mask = mask[:, None].to(dev)  # [n, 1, max_q, max_kv]
        self._rows = torch.cat(q_rows).to(dev)  # [T]
        self._cols = torch.cat(q_cols).to(dev)  # [T]
        self._write_slots = torch.cat(write_slots).to(dev)  # [T]
        self._shape = (n, max_q)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        k_cache, v_cache = self.cache.k[layer], self.cache.v[layer]  # [slots, Hkv, D]
        k_cache[self._write_slots] = k
        v_cache[self._write_slots] = v
        n, max_q = self._shape
        qp = q.new_zeros(n, max_q, q.shape[1], q.shape[2])
        qp[self._rows, self._cols] = q
        kp = k_cache[self._kv_slots]  # [n, max_kv, Hkv, D]
        vp = v_cache[self._kv_slots]
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2),
            kp.transpose(1, 2),
            vp.transpose(1, 2),
            attn_mask=self._mask,
            enable_gqa=True,
        )  # [n, Hq, max_q, D]
        return out.transpose(1, 2)[self._rows, self._cols]
