"""The ggml backend: a GGUF model run by llama.cpp in its own quantization, on the CPU.

It sits behind the torch engine's runner interface (`forward(ForwardBatch) -> logits`, a
`cache` with block tables), so the scheduler, every policy and drafter, the server and the
metrics run unchanged. llama.cpp is reached through llama-cpp-python's low-level API (the
`cpu` extra); nothing here goes through its high-level `Llama` class.

How a plan maps onto llama.cpp:
- One unified KV cache of `n_ctx` cells shared by every request. A request owns a sequence
  id; its tokens' cells carry that id. A query token sees exactly the cells that carry its
  first sequence id at positions up to its own.
- A verification tree is a set of sequence ids per token. Each leaf of the tree gets an id
  (one leaf the request's own, the others borrowed for this forward, their context copied
  from the request's: metadata only, no KV is copied), and a node carries the ids of every
  leaf below it. A node so sees the request's context and its own ancestors, never a sibling.
  Accepting a path keeps one leaf's cells up to the accepted depth as the request's and
  removes every other cell of the tree.
- Block tables stay the scheduler's currency: this cache hands out virtual blocks of
  `block_size` cells out of `n_ctx`, so admission, preemption and the KV metrics work as on
  the torch engine (a request never holds more cells than its blocks cover); a table gets
  its sequence id at its first reserve (exec/ggml_cache.py).
- Prefix caching shares a cached prefix's cells between sequence ids (`seq_cp`) and keeps a
  released prefix's cells under an id of its own until the allocator needs them
  (exec/ggml_cache.py).
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import numpy as np
import torch

from adaserve.exec.batch import ForwardBatch
from adaserve.exec.ggml_cache import MAX_KEPT_CELLS, GgmlKVCache
from adaserve.exec.loader import load_args
from adaserve.exec.model.llama import LlamaArgs
from adaserve.exec.timing import forward_cost_points, tree_pair_cost

# llama.cpp's flash attention on the CPU skips masked cells and tiles: with many requests in
# one shared cache every query row would otherwise pay for every request's cells.
FLASH_ATTN_ENABLED = 1

logger = logging.getLogger("adaserve.ggml")


def ggml_available() -> bool:
    """llama-cpp-python is installed (the `cpu` extra)."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def _lib():
    try:
        import llama_cpp
    except ImportError as exc:
        raise ImportError(
            "the ggml backend needs llama-cpp-python: pip install 'adaserve[cpu]' "
            "(it builds llama.cpp from source, a few minutes on first install)"
        ) from exc
    return llama_cpp


def amx_build(lc) -> bool:
    """llama.cpp was compiled with its AMX matrix kernels (`-march=native` on a CPU with AMX).
    On some AMX-capable virtual machines those kernels die with SIGILL at the first forward
    (a `tileloadd` without usable tile state): the process is killed, nothing can catch it."""
    return "AMX_INT8 = 1" in lc.llama_print_system_info().decode(errors="replace")


_log_callback = None  # keeps the ctypes callback alive for as long as llama.cpp may call it


def _quiet(lc) -> None:
    """Send llama.cpp's own logging nowhere (errors still reach us as return codes)."""
    global _log_callback
    if _log_callback is None:
        _log_callback = lc.llama_log_callback(lambda level, text, data: None)
        lc.llama_log_set(_log_callback, ctypes.c_void_p(0))


class LlamaCppContext:
    """One llama.cpp model and context: unified KV, flash attention, per-token sequence ids."""

    def __init__(
        self,
        gguf: Path,
        n_ctx: int,
        n_batch: int,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        streams: int | None = None,
    ):
        """`n_batch`: most tokens one decode call takes; `n_ubatch`: most llama.cpp computes at
        once (a bigger batch runs as several micro-batches). `streams`: that many sequences,
        each in a KV stream of its own (n_ctx / streams cells; no cell shared between
        sequences, so no trees and no seq_cp) instead of one unified cache: only for measuring
        what the unified cache costs (`adaserve.bench.ggml_kv`), the engine never asks."""
        lc = _lib()
        self.lc = lc
        _quiet(lc)
        lc.llama_backend_init()
        self.max_seqs = int(lc.llama_max_parallel_sequences()) if streams is None else streams
        mp = lc.llama_model_default_params()
        mp.n_gpu_layers = 0
        # Whether weights may sit in llama.cpp's extra (repacked, AMX) buffer types.
        self.extra_buffers = not amx_build(lc)
        if not self.extra_buffers:
            # The AMX kernels run only on weights in llama.cpp's "extra" buffer types: keep the
            # weights in plain CPU buffers, so those kernels never run (the Makefile builds
            # llama.cpp without them; a wheel built elsewhere may still have them).
            mp.use_extra_bufts = False
            logger.warning(
                "llama.cpp was built with AMX kernels, which crash on some machines: adaserve "
                "does not use them. Rebuild without them for llama.cpp's weight repacking: "
                "CMAKE_ARGS='-DCMAKE_C_FLAGS=-mno-amx-int8 -DCMAKE_CXX_FLAGS=-mno-amx-int8' "
                "pip install --force-reinstall --no-cache-dir llama-cpp-python"
            )
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), mp)
        if not self.model:
            raise ValueError(f"llama.cpp could not load {gguf} (not a GGUF model it knows?)")
        threads = self.threads = n_threads or len(os.sched_getaffinity(0))
        cp = lc.llama_context_default_params()
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = min(n_batch, n_ubatch)
        cp.n_seq_max = self.max_seqs
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.kv_unified = streams is None
        cp.flash_attn_type = FLASH_ATTN_ENABLED
        cp.embeddings = False
        self.ctx = lc.llama_init_from_model(self.model, cp)
        if not self.ctx:
            lc.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} cells")
        self.n_ctx = int(lc.llama_n_ctx(self.ctx))
        self.n_batch = int(lc.llama_n_batch(self.ctx))
        self.n_ubatch = int(lc.llama_n_ubatch(self.ctx))
        self.mem = lc.llama_get_memory(self.ctx)
        self.n_vocab = int(lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model)))
        self.n_embd = int(lc.llama_model_n_embd(self.model))
        self._embeddings = False
        # The batch struct points into these arrays for the context's whole life.
        n, k = self.n_batch, self.max_seqs
        self._tok = np.zeros(n, np.int32)
        self._pos = np.zeros(n, np.int32)
        self._nsid = np.zeros(n, np.int32)
        self._seqs = np.zeros((n, k), np.int32)
        self._out = np.zeros(n, np.int8)
        self._rows = (self._seqs.ctypes.data + np.arange(n) * self._seqs.strides[0]).astype(
            np.uintp
        )
        i32 = ctypes.POINTER(ctypes.c_int32)
        self._batch = lc.llama_batch()
        self._batch.token = self._tok.ctypes.data_as(i32)
        self._batch.embd = ctypes.cast(0, ctypes.POINTER(ctypes.c_float))
        self._batch.pos = self._pos.ctypes.data_as(i32)
        self._batch.n_seq_id = self._nsid.ctypes.data_as(i32)
        self._batch.seq_id = self._rows.ctypes.data_as(ctypes.POINTER(i32))
        self._batch.logits = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))

    def close(self) -> None:
        if getattr(self, "ctx", None):
            self.lc.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.lc.llama_model_free(self.model)
            self.model = None

    def __del__(self) -> None:
        self.close()

    # -------------------------------------------------------------- sequence memory
    def seq_rm(self, seq: int, p0: int = -1, p1: int = -1) -> None:
        """Drop `seq` from its cells at positions [p0, p1) (-1: open end); a cell no sequence
        holds any more is free."""
        self._check_seq(seq)
        self.lc.llama_memory_seq_rm(self.mem, seq, p0, p1)

    def seq_cp(self, src: int, dst: int, p0: int = -1, p1: int = -1) -> None:
        """`dst` also holds `src`'s cells at positions [p0, p1). llama.cpp does not check that
        `dst` holds none of them yet (it would count them twice): callers clear `dst` first."""
        self._check_seq(src)
        self._check_seq(dst)
        self.lc.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_max(self, seq: int) -> int:
        """Last position `seq` holds, -1 if none."""
        self._check_seq(seq)
        return int(self.lc.llama_memory_seq_pos_max(self.mem, seq))

    def seq_pos_min(self, seq: int) -> int:
        self._check_seq(seq)
        return int(self.lc.llama_memory_seq_pos_min(self.mem, seq))

    def seq_state(self, seq: int) -> bytes:
        """The sequence's KV as llama.cpp serializes it (positions, then K and V of every
        cell it holds): what tests compare to check the cache holds what it should."""
        self._check_seq(seq)
        size = int(self.lc.llama_state_seq_get_size(self.ctx, seq))
        buf = (ctypes.c_uint8 * size)()
        n = int(self.lc.llama_state_seq_get_data(self.ctx, buf, size, seq))
        return bytes(buf[:n])

    def _check_seq(self, seq: int) -> None:
        # llama.cpp aborts the process on an id out of range: never let one through.
        if not 0 <= seq < self.max_seqs:
            raise ValueError(f"sequence id {seq} outside [0, {self.max_seqs})")

    # -------------------------------------------------------------- forward
    def set_embeddings(self, on: bool) -> None:
        """Also return the final hidden states (after the final norm) of every token."""
        if on != self._embeddings:
            self.lc.llama_set_embeddings(self.ctx, on)
            self._embeddings = on

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        seq: np.ndarray,
        extra_seqs: dict[int, list[int]],
        want: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One forward; (logits [wanted, vocab], hidden [tokens, embd] or None).

        Token i belongs to sequence seq[i], or to every id of extra_seqs[i] when given (the
        first of them decides what it attends to). `want[i]`: return its logits.
        """
        n = len(tokens)
        logits, hidden = [], []
        for lo in range(0, n, self.n_batch):  # llama.cpp aborts on a batch over n_batch
            hi = min(n, lo + self.n_batch)
            m = hi - lo
            self._tok[:m] = tokens[lo:hi]
            self._pos[:m] = positions[lo:hi]
            self._seqs[:m, 0] = seq[lo:hi]
            self._nsid[:m] = 1
            for i, ids in extra_seqs.items():
                if lo <= i < hi:
                    for s in ids:
                        self._check_seq(s)
                    self._seqs[i - lo, : len(ids)] = ids
                    self._nsid[i - lo] = len(ids)
            out = want[lo:hi]
            if self._embeddings:
                out = np.ones(m, bool)  # llama.cpp outputs every row when embedding anyway
            self._out[:m] = out
            self._batch.n_tokens = m
            rc = self.lc.llama_decode(self.ctx, self._batch)
            if rc != 0:
                reason = {1: "no free KV cell", 2: "aborted"}.get(rc, "invalid batch")
                raise RuntimeError(f"llama_decode failed ({rc}: {reason})")
            n_out = int(out.sum())
            if n_out:
                rows = np.ctypeslib.as_array(
                    self.lc.llama_get_logits(self.ctx), shape=(n_out, self.n_vocab)
                )
                keep = want[lo:hi][out.astype(bool)] if self._embeddings else slice(None)
                logits.append(rows[keep].copy())
                if self._embeddings:
                    emb = np.ctypeslib.as_array(
                        self.lc.llama_get_embeddings(self.ctx), shape=(m, self.n_embd)
                    )
                    hidden.append(emb.copy())
        vocab = np.concatenate(logits) if logits else np.zeros((0, self.n_vocab), np.float32)
        return vocab, (np.concatenate(hidden) if hidden else None)


def segments(n: int, chunks: list[tuple[int, int]], tile: int) -> list[np.ndarray]:
    """The llama.cpp calls one forward of `n` tokens runs as: batch indices per call.

    In the unified cache every query row's attention walks the mask of every occupied cell.
    Below `tile` query rows llama.cpp skips a masked cell one at a time; at `tile` and above it
    computes 64 x 64 blocks of queries and keys and skips a block only when every query in it
    is masked from every key, so decode rows of many requests, tiled together with a prompt
    chunk, pay for every request's cells (`adaserve.bench.ggml_kv`: 16 decode rows and a
    128-token chunk beside 16 x 800 cached tokens took 924 ms in one call, 90 + 360 ms
    apart). So a forward that reaches the tile runs each prompt chunk (`chunks`: (start,
    tokens)) as a call of its own, whose tiles hold one request's queries, and the rest
    (decode rows, trees, short chunks) as one call; each call costs a pass over the weights
    (a 1-token forward, ~6 ms here). A forward below the tile, or of one part only, is one
    call."""
    if n < tile or not chunks or (len(chunks) == 1 and chunks[0][1] == n):
        return [np.arange(n)]
    alone = np.zeros(n, bool)
    parts = []
    for start, q in chunks:
        alone[start : start + q] = True
        parts.append(np.arange(start, start + q))
    rest = np.flatnonzero(~alone)
    return ([rest] if len(rest) else []) + parts


def tree_kind(tree: list[int] | None, query_len: int) -> str:
    """How a sequence's tree runs here: "causal" (a chunk, a decode token or a chain),
    "verify" (one request's verification tree: one root, every slot fed now) or "draft"
    (a draft step: nodes over scratch KV, or several roots)."""
    if tree is None or all(p == j - 1 for j, p in enumerate(tree)):
        return "causal"
    if len(tree) == query_len and tree[0] == -1 and all(p >= 0 for p in tree[1:]):
        return "verify"
    return "draft"


class GgmlRunner:
    """The target model on llama.cpp, with the torch `ModelRunner`'s interface."""

    # Attention reads only the cells a sequence holds: profiling must compute a context.
    needs_context = True
    # Every token costs about the same here (compute bound): padding never pays, and is ignored.
    supports_padding = False
    # llama.cpp's CPU flash attention (ggml-cpu ops.cpp) tiles the queries of a forward of at
    # least GGML_FA_TILE_Q = 64 tokens; below that it walks every query row over every cell.
    attention_tile_tokens: int | None = 64
    # A prompt chunk of at least this many tokens runs in a llama.cpp call of its own when the
    # forward reaches the attention tile (`segments`).
    own_call_tokens = 16

    def __init__(
        self,
        gguf: Path,
        checkpoint: Path,
        cache_tokens: int,
        block_size: int,
        n_batch: int,
        n_ubatch: int = 512,
        n_threads: int | None = None,
        max_kept_cells: int = MAX_KEPT_CELLS,
    ):
        """`checkpoint`: the GGUF file's dir (config and tokenizer from its metadata, no
        weights; an EAGLE head borrows the embedding and LM head from the GGUF itself)."""
        args = load_args(checkpoint)
        self.gguf = Path(gguf)
        self.llama = LlamaCppContext(self.gguf, cache_tokens, n_batch, n_ubatch, n_threads)
        if self.llama.n_vocab != args.vocab_size:
            raise ValueError(
                f"{gguf} has {self.llama.n_vocab} tokens, its config says {args.vocab_size}"
            )
        self._args = args
        self.checkpoint: Path | None = Path(checkpoint)
        self.cache = GgmlKVCache(self.llama, block_size, max_kept_cells)
        self.device = torch.device("cpu")
        self.capture_hidden = False
        self.last_hidden: torch.Tensor | None = None

    @property
    def args(self) -> LlamaArgs:
        return self._args

    @property
    def head_token_ids(self) -> torch.Tensor | None:
        return None  # llama.cpp's LM head is the full vocabulary

    def forward(self, batch: ForwardBatch, pad_to: int | None = None) -> torch.Tensor | None:
        """Logits [len(logits_indices), vocab] (float32), as the torch runner returns them.

        `pad_to` is ignored: llama.cpp's cost grows with every token here, padding never pays.
        """
        n = len(batch.token_ids)
        tokens = np.asarray(batch.token_ids, np.int32)
        positions = np.asarray(batch.positions, np.int32)
        seq = np.empty(n, np.int32)
        extra: dict[int, list[int]] = {}
        chunks: list[tuple[int, int]] = []  # (start, tokens) of each prompt-sized causal run
        start = 0
        for q, kv_len, table, tree in zip(
            batch.query_lens, batch.kv_lens, batch.block_tables, batch.trees
        ):
            s = self.cache.seq_of(table)
            first = int(positions[start])
            kind = tree_kind(tree, q)
            if kind == "causal" and q >= self.own_call_tokens:
                chunks.append((start, q))
            if kind == "draft":
                # A draft step: each node sees the committed tokens and its scratch ancestors.
                assert tree is not None
                context = kv_len - len(tree)
                for j in range(q):
                    slot = len(tree) - q + j
                    parent = tree[slot]
                    seq[start + j] = self._scratch_row(
                        s,
                        context,
                        context + slot,
                        None if parent < 0 else context + parent,
                        int(positions[start + j]),
                    )
                start += q
                continue
            if self.llama.seq_pos_max(s) >= first:
                self.cache.truncate(table, first)  # this forward rewrites those positions
            seq[start : start + q] = s
            if kind == "verify":
                assert tree is not None
                for j, ids in enumerate(self.cache.begin_tree(s, first, tree)):
                    seq[start + j] = ids[0]
                    if len(ids) > 1:
                        extra[start + j] = ids
            start += q
        want = np.zeros(n, bool)
        if batch.logits_indices is None:
            want[:] = True
        else:
            idx = batch.logits_indices
            if any(b <= a for a, b in zip(idx, idx[1:])):
                raise ValueError("logits_indices must be increasing on the ggml backend")
            want[idx] = True
        self.llama.set_embeddings(self.capture_hidden)
        parts = segments(n, chunks, self.attention_tile_tokens or n + 1)
        if len(parts) == 1:
            logits, hidden = self.llama.decode(tokens, positions, seq, extra, want)
        else:
            logits, hidden = self._decode_apart(parts, tokens, positions, seq, extra, want)
        if self.capture_hidden and hidden is not None:
            self.last_hidden = torch.from_numpy(hidden)
        if not want.any():
            return None
        return torch.from_numpy(logits)

    def _decode_apart(
        self,
        parts: list[np.ndarray],
        tokens: np.ndarray,
        positions: np.ndarray,
        seq: np.ndarray,
        extra: dict[int, list[int]],
        want: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One forward as several llama.cpp calls (`segments`), its outputs in batch order."""
        logits, hidden, wanted = [], [], []
        for idx in parts:
            local = {int(i): k for k, i in enumerate(idx)}
            sub_extra = {local[i]: ids for i, ids in extra.items() if i in local}
            out, hid = self.llama.decode(
                tokens[idx], positions[idx], seq[idx], sub_extra, want[idx]
            )
            logits.append(out)
            wanted.append(idx[want[idx]])
            if hid is not None:
                hidden.append((idx, hid))
        order = np.argsort(np.concatenate(wanted), kind="stable")
        vocab = np.concatenate(logits)[order]
        if not hidden:
            return vocab, None
        rows = np.empty((len(tokens), hidden[0][1].shape[1]), np.float32)
        for idx, hid in hidden:
            rows[idx] = hid
        return vocab, rows

    def _scratch_row(
        self, seq: int, context: int, kv_index: int, parent_kv: int | None, pos: int
    ) -> int:
        """The sequence id a draft-step node is fed under (see GgmlKVCache.scratch_node)."""
        if context != self.llama.seq_pos_max(seq) + 1:
            raise ValueError(
                f"a draft step's context ({context} tokens) must be every committed token of "
                f"its sequence ({self.llama.seq_pos_max(seq) + 1})"
            )
        return self.cache.scratch_node(seq, kv_index, parent_kv, pos)

    def cost_points(self, max_tokens: int) -> list[tuple[int, int, float]]:
        """This backend's own cost curve (tokens, context, seconds) to seed the cost model."""
        return forward_cost_points(self, max_tokens)

    def tree_pair_cost(self) -> float | None:
        """Seconds per tree pair beyond the cost curve, measured (`timing.tree_pair_cost`)."""
        return tree_pair_cost(self)

    def timing_key(self) -> tuple | None:
        """The GGUF file, threads, context size, batch sizes, weight buffers and hidden-state
        capture: what a llama.cpp forward's time depends on."""
        llama = self.llama
        return (
            "ggml",
            str(self.gguf.resolve()),
            llama.threads,
            llama.n_ctx,
            llama.n_batch,
            llama.n_ubatch,
            llama.extra_buffers,
            self.capture_hidden,
        )

    def close(self) -> None:
        self.llama.close()
