"""ExecutionEngine: the target and draft runners. Executes forward batches; holds no policy.

The request manager builds a `ForwardBatch` (plain lists: which tokens at which positions,
which KV indices, which masks) and reads logits back. KV blocks are reserved by the request
manager through `runner.cache` before a batch is run, never by the runner itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from adaserve.config import CacheConfig, ModelConfig
from adaserve.exec.attention.base import AttentionBackend, AttentionMetadata
from adaserve.exec.attention.torch_ref import TorchAttentionBackend
from adaserve.exec.draft_vocab import draft_vocab_ids
from adaserve.exec.kv_cache import KVCache, blocks_for_memory
from adaserve.exec.loader import (
    check_draft_compatible,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from adaserve.exec.model.eagle import EagleHead, is_eagle_head, load_eagle_head
from adaserve.exec.model.llama import LlamaForCausalLM
from adaserve.exec.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from adaserve.exec.cuda_graph import DraftGraphRunner


@dataclass
class ForwardBatch:
    """One forward over several sequences' new tokens (flat, sequence after sequence)."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    masks: list[torch.Tensor | None]
    # Flat indices of tokens whose logits are wanted (None: every token).
    logits_indices: list[int] | None = None
    # An EAGLE head's input features, one row per token [T, hidden] (None: zeros).
    features: torch.Tensor | None = None

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(self.query_lens, self.kv_lens, self.block_tables, self.masks)

    def silent_tokens(self) -> tuple[int, int]:
        """(tokens whose logits are not wanted, the keys they attend in all): what a forward's
        prompt-chunk tokens add to its cost apart from decode tokens (exec/cost_model.py).
        A token at position p of a chunk attends p + 1 keys."""
        wanted = self.logits_indices
        if wanted is None:
            return 0, 0
        out = set(wanted)
        silent = [i for i in range(len(self.token_ids)) if i not in out]
        return len(silent), sum(self.positions[i] + 1 for i in silent)


@dataclass
class SequenceBatchBuilder:
    """Accumulates sequences into a ForwardBatch; who fills it: the request manager."""

    batch: ForwardBatch = field(default_factory=lambda: ForwardBatch([], [], [], [], [], [], []))

    def add(
        self,
        tokens: list[int],
        positions: list[int],
        kv_len: int,
        block_table: list[int],
        mask: torch.Tensor | None = None,
        logits: str = "all",
    ) -> list[int]:
        """Append a sequence; returns the flat indices (into logits rows) of its wanted logits."""
        b = self.batch
        start = len(b.token_ids)
        b.token_ids += tokens
        b.positions += positions
        b.query_lens.append(len(tokens))
        b.kv_lens.append(kv_len)
        b.block_tables.append(block_table)
        b.masks.append(mask)
        assert b.logits_indices is not None
        first = len(b.logits_indices)
        if logits == "all":
            b.logits_indices += range(start, start + len(tokens))
        elif logits == "last":
            b.logits_indices.append(start + len(tokens) - 1)
        return list(range(first, len(b.logits_indices)))

    def __len__(self) -> int:
        return len(self.batch.query_lens)


class ModelRunner:
    """One model, its KV cache and attention backend."""

    # forward(pad_to=...) runs the extra rows (the controller pads when that is cheaper).
    supports_padding = True

    def __init__(self, model: LlamaForCausalLM, cache: KVCache, backend: AttentionBackend) -> None:
        self.model, self.cache, self.backend = model, cache, backend
        self.device = cache.device
        # When set, every forward keeps its final hidden states [T, hidden] (flat, padding
        # rows last) in `last_hidden`: what an EAGLE head drafts from.
        self.capture_hidden = False
        self.last_hidden: torch.Tensor | None = None

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
                batch.masks + [None] * len(lens),
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
        from adaserve.exec.profile import forward_cost_points

        return forward_cost_points(self, max_tokens)

    def _forward(self, batch: ForwardBatch) -> torch.Tensor | None:
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

    def __init__(self, model: EagleHead, cache: KVCache, backend: AttentionBackend) -> None:
        super().__init__(model, cache, backend)  # type: ignore[arg-type]
        self.capture_hidden = True  # the drafter reads each row's output feature

    def _hidden(self, batch: ForwardBatch, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        feats = torch.zeros(len(ids), self.model.args.hidden_size, device=self.device)
        if batch.features is not None:  # padding rows (and profiling) read zeros
            feats[: len(batch.features)] = batch.features
        return self.model(ids, pos, self.backend, feats)


def _make_backend(name: str, cache: KVCache, num_qo_heads: int | None = None) -> AttentionBackend:
    if name == "auto":
        # FlashInfer has no float32 kernels: a float32 model stays on the torch reference.
        fits = cache.device.type == "cuda" and cache.k.dtype in (torch.float16, torch.bfloat16)
        name = "flashinfer" if fits and _has_flashinfer() else "torch"
    if name == "torch":
        return TorchAttentionBackend(cache)
    if name == "flashinfer":
        from adaserve.exec.attention.flashinfer import FlashInferAttentionBackend

        return FlashInferAttentionBackend(cache, num_qo_heads=num_qo_heads)
    raise ValueError(f"attention_backend must be auto, torch or flashinfer, got {name!r}")


def _has_flashinfer() -> bool:
    try:
        import adaserve.exec.attention.flashinfer  # noqa: F401

        return True
    except ImportError:
        return False


def _build_runner(
    path: Path, model_cfg: ModelConfig, num_blocks: int | None, cache_cfg: CacheConfig
) -> ModelRunner:
    model = load_model(path, model_cfg.dtype, model_cfg.device)
    a = model.args
    dtype = next(model.parameters()).dtype
    device = torch.device(model_cfg.device)
    if num_blocks is None:
        per_block = KVCache.bytes_per_block(
            a.num_layers, cache_cfg.block_size, a.num_kv_heads, a.head_dim, dtype
        )
        num_blocks = blocks_for_memory(per_block, cache_cfg.memory_fraction, device)
    cache = KVCache(
        a.num_layers, num_blocks, cache_cfg.block_size, a.num_kv_heads, a.head_dim, dtype, device
    )
    backend = _make_backend(model_cfg.attention_backend, cache, a.num_heads)
    return ModelRunner(model, cache, backend)


def pick_backend(model_cfg: ModelConfig, target_path: Path) -> tuple[str, Path | None]:
    """("torch", None) or ("ggml", the GGUF file it runs), as `model_cfg.backend` asks."""
    from adaserve.exec.ggml import ggml_available
    from adaserve.exec.loader import gguf_source

    if model_cfg.backend == "torch":
        return "torch", None
    cpu = torch.device(model_cfg.device).type == "cpu"
    gguf = gguf_source(model_cfg.model, target_path) if cpu else None
    if model_cfg.backend == "auto":
        fits = gguf is not None and ggml_available()
        return ("ggml", gguf) if fits else ("torch", None)
    if not cpu:
        raise ValueError(f"backend 'ggml' runs on the CPU; device is {model_cfg.device!r}")
    if gguf is None:
        raise ValueError(
            f"backend 'ggml' runs GGUF models; {target_path} came from no GGUF file that "
            "adaserve knows of: pass the .gguf file as the model"
        )
    if not ggml_available():
        raise ValueError(
            "backend 'ggml' needs llama-cpp-python: pip install 'adaserve[cpu]' (it builds "
            "llama.cpp from source, a few minutes on first install)"
        )
    return "ggml", gguf


# Most cells of the ggml backend's KV cache when sized from memory: llama.cpp walks every cell
# to drop or copy a sequence, so a cache far larger than the traffic costs time each step.
MAX_GGML_CACHE_TOKENS = 65536


def _build_ggml_runner(gguf: Path, target_path: Path, cache_cfg: CacheConfig):
    from adaserve.exec.ggml import GgmlRunner
    from adaserve.exec.loader import load_args

    args = load_args(target_path)
    if cache_cfg.num_blocks is not None:
        tokens = cache_cfg.num_blocks * cache_cfg.block_size
    else:
        # llama.cpp stores K and V in float16.
        per_block = KVCache.bytes_per_block(
            args.num_layers, cache_cfg.block_size, args.num_kv_heads, args.head_dim, torch.float16
        )
        blocks = blocks_for_memory(per_block, cache_cfg.memory_fraction, torch.device("cpu"))
        tokens = min(blocks * cache_cfg.block_size, MAX_GGML_CACHE_TOKENS)
    return GgmlRunner(gguf, target_path, tokens, cache_cfg.block_size, n_batch=2048)


def _build_head_runner(
    path: Path, target: ModelRunner, model_cfg: ModelConfig, num_blocks: int, cache_cfg: CacheConfig
) -> EagleRunner:
    if isinstance(target, ModelRunner):
        head = load_eagle_head(path, target.model)
    else:
        # A target torch does not run (ggml): the head borrows the checkpoint's embedding and
        # LM head, loaded on their own, and drafts from llama.cpp's final hidden states.
        from adaserve.exec.loader import load_embedding_and_head

        head = load_eagle_head(path, load_embedding_and_head(target.model.path))  # type: ignore[arg-type]
    a = head.args
    ref = head.embed_weight
    cache = KVCache(
        1, num_blocks, cache_cfg.block_size, a.num_kv_heads, a.head_dim, ref.dtype, ref.device
    )
    backend = _make_backend(model_cfg.attention_backend, cache, a.num_heads)
    return EagleRunner(head, cache, backend)


class ExecutionEngine:
    """Target runner, optional draft runner, tokenizer and the model-length limit.

    `clock` is what the scheduler reads for every timestamp; the simulator's engine
    (`adaserve.sim`) replaces it with a virtual clock that its forwards advance.
    """

    clock = staticmethod(time.monotonic)

    def __init__(
        self, model_cfg: ModelConfig, cache_cfg: CacheConfig, need_draft: bool | str
    ) -> None:
        """`need_draft`: load the default draft when none is named (True or "model"), or the
        default target's shipped EAGLE head ("eagle")."""
        self.target_path = resolve_model_path(model_cfg.model)
        self.tokenizer = load_tokenizer(self.target_path)
        self.backend, gguf = pick_backend(model_cfg, self.target_path)
        if self.backend == "ggml":
            assert gguf is not None
            self.target = _build_ggml_runner(gguf, self.target_path, cache_cfg)
        else:
            self.target = _build_runner(
                self.target_path, model_cfg, cache_cfg.num_blocks, cache_cfg
            )
        self.cuda_graphs = model_cfg.cuda_graphs
        self.draft_graphs: DraftGraphRunner | None = None  # see enable_draft_graphs
        self.draft: ModelRunner | None = None
        self.draft_path: Path | None = None
        if model_cfg.draft_model is not None or need_draft:
            if model_cfg.draft_model is None:
                from adaserve.exec.default_model import default_draft_dir, default_head_dir

                pick = default_head_dir if need_draft == "eagle" else default_draft_dir
                self.draft_path = pick(self.target_path)
            else:
                self.draft_path = resolve_model_path(model_cfg.draft_model)
            draft_blocks = max(1, int(self.target.cache.num_blocks * cache_cfg.draft_blocks_ratio))
            if is_eagle_head(self.draft_path):
                self.draft = _build_head_runner(
                    self.draft_path, self.target, model_cfg, draft_blocks, cache_cfg
                )
                self.target.capture_hidden = True  # the head drafts from the target's features
            else:
                check_draft_compatible(self.target_path, self.draft_path)
                draft_gguf = None
                # (No draft named: the default draft, a checkpoint dir, never a GGUF file.)
                if self.backend == "ggml" and model_cfg.draft_model is not None:
                    from adaserve.exec.loader import gguf_source

                    draft_gguf = gguf_source(model_cfg.draft_model, self.draft_path)
                if draft_gguf is not None:  # a GGUF draft beside a ggml target: ggml too
                    cells = CacheConfig(
                        block_size=cache_cfg.block_size,
                        num_blocks=draft_blocks,
                        enable_prefix_caching=False,
                    )
                    self.draft = _build_ggml_runner(draft_gguf, self.draft_path, cells)
                else:
                    self.draft = _build_runner(self.draft_path, model_cfg, draft_blocks, cache_cfg)
            k = model_cfg.draft_vocab_size
            vocab = self.draft.model.args.vocab_size
            if k is not None and k < vocab and isinstance(self.draft, ModelRunner):
                ids = draft_vocab_ids(self.target_path.name, vocab, k, model_cfg.draft_vocab_file)
                self.draft.model.restrict_head(torch.tensor(ids, dtype=torch.long))
        # Automatic prefix caching, one index per KV cache (see exec/prefix_cache.py).
        self.target_prefix: PrefixCache | None = None
        self.draft_prefix: PrefixCache | None = None
        if cache_cfg.enable_prefix_caching and self.backend == "torch":
            # (llama.cpp's cache is indexed by sequence, not by block: no prefix sharing yet.)
            self.target_prefix = PrefixCache(self.target.cache)
            if isinstance(self.draft, ModelRunner) and not self.draft_is_head:
                # A head's KV depends on the target's features, not on tokens alone.
                self.draft_prefix = PrefixCache(self.draft.cache)
        args = self.target.model.args
        limit = args.max_position_embeddings
        if args.sliding_window is not None:
            # No sliding-window attention here: stay within the window, where it is plain attention.
            limit = min(limit, args.sliding_window)
        if model_cfg.max_model_len is not None and model_cfg.max_model_len > limit:
            raise ValueError(
                f"max_model_len {model_cfg.max_model_len} exceeds what the model supports ({limit})"
            )
        self.max_model_len = model_cfg.max_model_len or limit
        self.vocab_size = args.vocab_size

    @property
    def draft_is_head(self) -> bool:
        """The draft is an EAGLE head: it needs the target's features, not just tokens."""
        return isinstance(self.draft, EagleRunner)

    def enable_draft_graphs(self, max_num_seqs: int, max_width: int) -> None:
        """Replay draft steps 2..d from CUDA graphs, if the draft's backend supports them."""
        d = self.draft
        if (
            not isinstance(d, ModelRunner)
            or not self.cuda_graphs
            or not d.backend.supports_cuda_graphs()
        ):
            return
        from adaserve.exec.cuda_graph import DraftGraphRunner

        self.draft_graphs = DraftGraphRunner(d, max_num_seqs, max_width)
