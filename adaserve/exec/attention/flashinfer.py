"""FlashInfer attention (CUDA): paged-KV prefill wrapper with packed tree masks, decode wrapper.

Importing this module raises ImportError when `flashinfer` is not installed (`pip install
adaserve[cuda]`); the engine's backend choice relies on that.

KV layout. KVCache keeps per layer a flat [num_blocks * block_size, Hkv, D] tensor; viewed as
[num_blocks, block_size, Hkv, D] it is FlashInfer's "NHD" paged layout with page = block, so the
cache is used in place and a block table is a page list.

One forward, three cases (chosen in `plan`, once per forward):
  - every sequence feeds 1 token, no masks -> BatchDecodeWithPagedKVCacheWrapper;
  - no masks                                -> BatchPrefillWithPagedKVCacheWrapper, causal;
  - any mask (tree verification, tree draft steps) -> the prefill wrapper with a packed custom
    mask for every sequence (a sequence without a mask gets its causal mask written out).

CUDA graphs (see cuda_graph.py). `prepare_for_capture` / `prepare_for_replay` plan a separate
prefill wrapper made with `use_cuda_graph=True` per (num_seqs, num_tokens) shape, always in
custom-mask mode. Captured: the K/V writes (index_put_ through a static slot buffer) and the
attention kernel; not captured: plan(), which runs on the host before every replay and copies
the new indptr/indices/mask into the wrapper's fixed buffers. In graph mode FlashInfer's plan
fixes the kernel grid from (batch size, total rows) alone, so a graph stays valid when the KV
lengths change between replays; the buffers are sized for the whole KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

# An ImportError here (flashinfer not installed) is what engine._has_flashinfer() checks.
import flashinfer
import numpy as np
import torch

from adaserve.exec.attention.base import AttentionBackend, AttentionMetadata
from adaserve.exec.kv_cache import KVCache

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16)
# Split-KV scratch of the kernels; vLLM and SGLang use 128-394 MiB.
WORKSPACE_BYTES = 256 * 1024 * 1024
# Per-plan index scratch of the graph-mode wrappers (request/tile indices: a few KiB here).
GRAPH_INT_WORKSPACE_BYTES = 4 * 1024 * 1024

Mode = Literal["decode", "causal", "masked"]


# ------------------------------------------------------------------ pure layout (host, numpy)
@dataclass(frozen=True)
class PagedLayout:
    """FlashInfer's description of one forward's sequences; host arrays."""

    qo_indptr: np.ndarray  # [n + 1] int32: sequence s owns query rows [qo_indptr[s], [s+1])
    kv_indptr: np.ndarray  # [n + 1] int32: its pages are kv_indices[kv_indptr[s]:[s+1]]
    kv_indices: np.ndarray  # [kv_indptr[-1]] int32 page (= KV block) ids
    kv_last_page_len: np.ndarray  # [n] int32 in [1, page_size]: entries used in the last page
    write_slots: np.ndarray  # [num_tokens] int64 flat cache slots of the new tokens


# Sequences feeding at most this many tokens get their cache slots computed in plain Python.
_PYTHON_SLOTS = 32


def paged_layout(meta: AttentionMetadata, page_size: int) -> PagedLayout:
    """Indptr/indices/last-page lengths and new-token slots of `meta` (pages = KV blocks)."""
    n = len(meta.query_lens)
    qo_indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(meta.query_lens, out=qo_indptr[1:])
    pages: list[int] = []
    indices: list[int] = []
    last: list[int] = []
    slots: list[int] = []
    # Plain Python per sequence (a decode row's pages and slot are a few ints): small numpy
    # arrays per sequence cost more than the arithmetic at 16+ sequences an iteration.
    for q_len, kv_len, table in zip(meta.query_lens, meta.kv_lens, meta.block_tables):
        if kv_len < 1:
            raise ValueError(f"every sequence needs kv_len >= 1 for FlashInfer, got {kv_len}")
        num_pages = -(-kv_len // page_size)
        if len(table) < num_pages:
            raise ValueError(
                f"block table has {len(table)} blocks, kv_len {kv_len} needs {num_pages}"
            )
        pages.append(num_pages)
        indices.extend(table[:num_pages])
        last.append(kv_len - (num_pages - 1) * page_size)
        if q_len <= _PYTHON_SLOTS:
            first = kv_len - q_len
            slots.extend(
                table[k // page_size] * page_size + k % page_size for k in range(first, kv_len)
            )
        else:  # a prompt chunk: its slots in one numpy pass
            idx = np.arange(kv_len - q_len, kv_len)
            blocks = np.asarray(table[:num_pages], dtype=np.int64)
            slots.extend((blocks[idx // page_size] * page_size + idx % page_size).tolist())
    kv_indptr = np.zeros(n + 1, dtype=np.int32)
    np.cumsum(pages, out=kv_indptr[1:])
    return PagedLayout(
        qo_indptr=qo_indptr,
        kv_indptr=kv_indptr,
        kv_indices=np.asarray(indices, dtype=np.int32),
        kv_last_page_len=np.asarray(last, dtype=np.int32),
        write_slots=np.asarray(slots, dtype=np.int64),
    )


def causal_mask(q_len: int, kv_len: int) -> np.ndarray:
    """[q_len, kv_len] bool: new token i sees KV indices <= kv_len - q_len + i."""
    return np.arange(kv_len)[None, :] <= (kv_len - q_len) + np.arange(q_len)[:, None]


def pack_masks(meta: AttentionMetadata) -> tuple[np.ndarray, np.ndarray]:
    """Masks packed as FlashInfer reads them: (packed uint8 [nbytes], byte indptr int32 [n + 1]).

    Sequence s's mask (its own, or causal if None) is flattened row-major, [q_len, kv_len] ->
    element i = row * kv_len + col, and packed little-endian: element i is bit i % 8 of byte
    indptr[s] + i // 8 (the kernel reads `(mask[offset / 8] >> (offset % 8)) & 1`). Every
    sequence starts on a byte boundary, as flashinfer.segment_packbits lays it out.
    """
    chunks = []
    for q_len, kv_len, m in zip(meta.query_lens, meta.kv_lens, meta.masks):
        if m is None and q_len == 1:
            # A decode row sees every key: all ones, the last byte partial (the common case
            # of a graph-replayed forward, which always runs in custom-mask mode).
            chunks.append(_ones(kv_len))
            continue
        # Masks are built on the host (tree layout); .numpy() refuses a CUDA tensor loudly.
        dense = causal_mask(q_len, kv_len) if m is None else m.numpy()
        chunks.append(np.packbits(dense.reshape(-1).astype(bool), bitorder="little"))
    indptr = np.zeros(len(chunks) + 1, dtype=np.int32)
    np.cumsum([len(c) for c in chunks], out=indptr[1:])
    packed = np.concatenate(chunks) if chunks else np.zeros(0, np.uint8)
    return packed, indptr


def _ones(bits: int) -> np.ndarray:
    """`bits` set bits packed little-endian (np.packbits of that many ones)."""
    packed = np.full(-(-bits // 8), 0xFF, dtype=np.uint8)
    if bits % 8:
        packed[-1] = (1 << (bits % 8)) - 1
    return packed


def attention_mode(meta: AttentionMetadata) -> Mode:
    """decode (all single tokens, no masks), causal (no masks) or masked."""
    if any(m is not None for m in meta.masks):
        return "masked"
    if all(q == 1 for q in meta.query_lens):
        return "decode"
    return "causal"


# ------------------------------------------------------------------ the backend
@dataclass
class _Planned:
    """The forward that `plan` prepared; forward() reads it for every layer."""

    mode: Mode
    layout: PagedLayout
    mask: tuple[np.ndarray, np.ndarray] | None  # pack_masks() result when mode == "masked"
    write_slots: torch.Tensor  # [num_tokens] int64, cuda
    wrapper: Any  # the FlashInfer wrapper that runs this forward
    planned: bool  # wrapper.plan() done (it needs num_qo_heads, which the first forward gives)


@dataclass
class _GraphState:
    """A CUDA-graph-mode prefill wrapper and the static buffers a captured forward reads."""

    wrapper: Any  # flashinfer.BatchPrefillWithPagedKVCacheWrapper(use_cuda_graph=True)
    write_slots: torch.Tensor  # [num_tokens] int64, cuda
    mask_indptr: torch.Tensor  # [num_seqs + 1] int32, cuda (the wrapper's mask_indptr_buf)
    max_pages: int
    max_mask_bytes: int


class FlashInferAttentionBackend(AttentionBackend):
    """FlashInfer over the KVCache's blocks; float16/bfloat16 only (FlashInfer has no float32)."""

    def __init__(
        self,
        cache: KVCache,
        num_qo_heads: int | None = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        prefill_backend: str = "fa2",
    ) -> None:
        """num_qo_heads: query heads; None learns them from the first forward (eager only).

        prefill_backend: FlashInfer's prefill implementation. "fa2" runs custom masks on every
        GPU; "auto" may pick fa3 on Hopper, which is faster for long causal prefills but
        sticks to the wrapper, and fa3 has no custom masks.
        """
        _check_cache(cache)
        self.cache = cache
        self.num_qo_heads = num_qo_heads
        self.prefill_backend = prefill_backend
        num_layers, num_slots, self.num_kv_heads, self.head_dim = cache.k.shape
        self.page_size = cache.block_size
        self.num_pages = num_slots // self.page_size
        paged = (num_layers, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)
        self._k_pages = cache.k.view(paged)  # [L, pages, page_size, Hkv, D], shares storage
        self._v_pages = cache.v.view(paged)
        dev = cache.device
        # One float workspace for every wrapper: forwards run one after another on one stream.
        self._workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=dev)
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace, "NHD", backend=prefill_backend
        )
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD")
        self._graph_int_workspace: torch.Tensor | None = None
        self._graphs: dict[tuple[int, int], _GraphState] = {}
        self._planned: _Planned | None = None

    # -------------------------------------------------------------- eager
    def plan(self, meta: AttentionMetadata) -> None:
        layout = paged_layout(meta, self.page_size)
        mode = attention_mode(meta)
        write_slots = torch.from_numpy(layout.write_slots).to(self.cache.device, non_blocking=True)
        self._planned = _Planned(
            mode=mode,
            layout=layout,
            mask=pack_masks(meta) if mode == "masked" else None,
            write_slots=write_slots,
            wrapper=self._decode if mode == "decode" else self._prefill,
            planned=False,
        )
        if self.num_qo_heads is not None:
            self._plan_wrapper(self.num_qo_heads)

    def _plan_wrapper(self, num_qo_heads: int) -> None:
        p = self._planned
        assert p is not None
        lay, dtype = p.layout, self.cache.k.dtype
        common = dict(q_data_type=dtype, kv_data_type=dtype)
        if p.mode == "decode":
            p.wrapper.plan(
                torch.from_numpy(lay.kv_indptr),
                torch.from_numpy(lay.kv_indices),
                torch.from_numpy(lay.kv_last_page_len),
                num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self.page_size,
                **common,
            )
        else:
            packed = None if p.mask is None else torch.from_numpy(p.mask[0])
            p.wrapper.plan(
                torch.from_numpy(lay.qo_indptr),
                torch.from_numpy(lay.kv_indptr),
                torch.from_numpy(lay.kv_indices),
                torch.from_numpy(lay.kv_last_page_len),
                num_qo_heads,
                self.num_kv_heads,
                self.head_dim,
                self.page_size,
                packed_custom_mask=packed,
                causal=p.mode == "causal",
                **common,
            )
            if p.mask is not None:
                _set_mask_indptr(p.wrapper, p.mask[1], self.cache.device)
        p.planned = True

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int
    ) -> torch.Tensor:
        p = self._planned
        if p is None:
            raise RuntimeError("plan() must run before forward()")
        if not p.planned:
            self.num_qo_heads = q.shape[1]
            self._plan_wrapper(q.shape[1])
        # New K/V first: the kernel reads them back from the pages like any cached entry.
        self.cache.k[layer].index_copy_(0, p.write_slots, k)  # [T, Hkv, D] -> [slots, Hkv, D]
        self.cache.v[layer].index_copy_(0, p.write_slots, v)
        return p.wrapper.run(q.contiguous(), (self._k_pages[layer], self._v_pages[layer]))

    # -------------------------------------------------------------- CUDA graphs
    def supports_cuda_graphs(self) -> bool:
        return True

    def prepare_for_capture(
        self, max_tokens: int, meta: AttentionMetadata | None = None, max_kv_len: int | None = None
    ) -> None:
        """Plan the graph-mode wrapper of `meta`'s shape (made on first use); forward() uses it.

        meta: the batch to capture with (its sequence count and `max_tokens` tokens fix the
        graph's shape; its KV lengths do not). max_kv_len: the longest KV any replay gives a
        sequence (None: the whole pool); it bounds the page and mask buffers.
        """
        if meta is None or meta.num_tokens != max_tokens:
            raise ValueError("FlashInfer capture needs the capture batch's metadata")
        if self.num_qo_heads is None:
            raise RuntimeError("set num_qo_heads (the model's query heads) before capturing")
        key = (len(meta.query_lens), meta.num_tokens)
        if key not in self._graphs:
            self._graphs[key] = self._new_graph_state(
                *key, max_q_len=max(meta.query_lens), max_kv_len=max_kv_len
            )
        self._plan_graph(self._graphs[key], meta)

    def prepare_for_replay(self, meta: AttentionMetadata) -> None:
        """Re-plan the graph captured for `meta`'s (num_seqs, num_tokens) with its lengths."""
        key = (len(meta.query_lens), meta.num_tokens)
        if key not in self._graphs:
            raise RuntimeError(f"no CUDA graph was captured for (num_seqs, num_tokens) = {key}")
        self._plan_graph(self._graphs[key], meta)

    def _new_graph_state(
        self, num_seqs: int, num_tokens: int, max_q_len: int, max_kv_len: int | None = None
    ) -> _GraphState:
        dev = self.cache.device
        # Real sequences own distinct blocks; padding sequences may repeat one block each.
        max_pages = self.num_pages + num_seqs * -(-num_tokens // self.page_size)
        # Mask bits: sum of q x kv over the sequences, each sequence from a byte boundary.
        max_mask_bytes = -(-max_q_len * max_pages * self.page_size // 8) + num_seqs
        if max_kv_len is not None:  # a large pool would otherwise size these per graph
            max_pages = min(max_pages, num_seqs * -(-max_kv_len // self.page_size))
            max_mask_bytes = min(max_mask_bytes, -(-num_tokens * max_kv_len // 8) + num_seqs)

        def i32(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.int32, device=dev)

        mask_indptr = i32(num_seqs + 1)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=i32(num_seqs + 1),
            paged_kv_indptr_buf=i32(num_seqs + 1),
            paged_kv_indices_buf=i32(max_pages),
            paged_kv_last_page_len_buf=i32(num_seqs),
            custom_mask_buf=torch.zeros(max_mask_bytes, dtype=torch.uint8, device=dev),
            mask_indptr_buf=mask_indptr,
            backend=self.prefill_backend,
        )
        # Graph wrappers share one small index workspace instead of 8 MiB each: every replay
        # is preceded by its own plan, on the same stream.
        if self._graph_int_workspace is None:
            self._graph_int_workspace = torch.empty(
                GRAPH_INT_WORKSPACE_BYTES, dtype=torch.uint8, device=dev
            )
        wrapper.reset_workspace_buffer(self._workspace, self._graph_int_workspace)
        return _GraphState(
            wrapper=wrapper,
            write_slots=torch.zeros(num_tokens, dtype=torch.long, device=dev),
            mask_indptr=mask_indptr,
            max_pages=max_pages,
            max_mask_bytes=max_mask_bytes,
        )

    def _plan_graph(self, g: _GraphState, meta: AttentionMetadata) -> None:
        lay = paged_layout(meta, self.page_size)
        # The graph wrapper always runs in custom-mask mode: causal sequences get theirs packed.
        packed, mask_indptr = pack_masks(meta)
        if len(lay.kv_indices) > g.max_pages or len(packed) > g.max_mask_bytes:
            raise ValueError(
                f"batch needs {len(lay.kv_indices)} pages / {len(packed)} mask bytes, the "
                f"graph buffers hold {g.max_pages} / {g.max_mask_bytes}"
            )
        dtype = self.cache.k.dtype
        assert self.num_qo_heads is not None
        g.wrapper.plan(
            torch.from_numpy(lay.qo_indptr),
            torch.from_numpy(lay.kv_indptr),
            torch.from_numpy(lay.kv_indices),
            torch.from_numpy(lay.kv_last_page_len),
            self.num_qo_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            packed_custom_mask=torch.from_numpy(packed),
            causal=False,
            q_data_type=dtype,
            kv_data_type=dtype,
        )
        g.mask_indptr.copy_(torch.from_numpy(mask_indptr), non_blocking=True)
        g.write_slots.copy_(torch.from_numpy(lay.write_slots), non_blocking=True)
        self._planned = _Planned(
            mode="masked",
            layout=lay,
            mask=(packed, mask_indptr),
            write_slots=g.write_slots,
            wrapper=g.wrapper,
            planned=True,
        )


def _check_cache(cache: KVCache) -> None:
    if cache.device.type != "cuda":
        raise ValueError(
            f"FlashInfer runs on CUDA, the KV cache is on {cache.device}; "
            "use attention_backend='torch' there"
        )
    if cache.k.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"FlashInfer attention needs float16 or bfloat16 weights and KV, got "
            f"{cache.k.dtype}; run with dtype bfloat16 or attention_backend='torch'"
        )


def _set_mask_indptr(wrapper: Any, byte_indptr: np.ndarray, device: torch.device) -> None:
    """Give an eager prefill wrapper the byte offsets of the packed masks.

    NOTE: plan(packed_custom_mask=...) stores offsets counted in mask *bits* (sum of q * kv),
    while the kernel adds them to a byte pointer; only plan(custom_mask=...) converts them,
    and that path packs on the GPU with host syncs (flashinfer PR #2201 is the upstream fix).
    Writing the byte offsets here is right before and after that fix.
    """
    if not hasattr(wrapper, "_mask_indptr_buf"):
        raise RuntimeError(
            f"flashinfer {getattr(flashinfer, '__version__', '?')} keeps its mask offsets "
            "elsewhere; adaserve was written against flashinfer-python 0.5-0.7"
        )
    wrapper._mask_indptr_buf = torch.from_numpy(byte_indptr).to(device, non_blocking=True)
