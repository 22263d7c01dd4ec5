"""ExecutionEngine: assembles the target and draft runners and runs an iteration's plan.

The request manager builds the plan (`request_manager/plan.py`: a `ForwardBatch` of plain
lists, tree structure as parents) and commits what `run(plan)` returns. KV blocks are
reserved by the request manager through `runner.cache` before a plan is run, never by a
runner itself. This file only builds runners (`torch_runner.py`, `ggml.py`) and holds no
policy.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from adaserve.config import CacheConfig, ModelConfig
from adaserve.exec.cuda_graph import DraftGraphRunner, ForwardGraphRunner
from adaserve.exec.default_model import default_draft_dir, default_head_dir
from adaserve.exec.draft_vocab import draft_vocab_ids
from adaserve.exec.ggml import GgmlRunner, ggml_available
from adaserve.exec.kv_cache import KVCache, blocks_for_memory
from adaserve.exec.loader import (
    check_draft_compatible,
    checkpoint_dir,
    generation_eos_ids,
    gguf_source,
    load_args,
    load_embedding_and_head,
    load_model,
    load_tokenizer,
    locate_model,
    locate_tokenizer,
)
from adaserve.exec.model.eagle import is_eagle_head, load_eagle_head
from adaserve.exec.model.llama import choose_cpu_linears, packed_linears_pay
from adaserve.exec.prefix_cache import PrefixCache
from adaserve.exec.runner import ForwardOutput, PlanToRun, Runner, run_plan
from adaserve.exec.torch_runner import EagleRunner, ModelRunner, make_attention_backend


def _build_runner(
    path: Path, model_cfg: ModelConfig, num_blocks: int | None, cache_cfg: CacheConfig
) -> ModelRunner:
    model = load_model(path, model_cfg.dtype, model_cfg.device, model_cfg.trust_remote_code)
    if model_cfg.device == "cpu":
        choose_cpu_linears(model.linear_weights())
        if packed_linears_pay():
            model.pack_cpu_linears()
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
    backend = make_attention_backend(model_cfg.attention_backend, cache, a.num_heads)
    return ModelRunner(model, cache, backend, checkpoint=path)


def pick_backend(model_cfg: ModelConfig, source: Path) -> tuple[str, Path | None]:
    """("torch", None) or ("ggml", the GGUF file it runs), as `model_cfg.backend` asks, for
    a located model (`source`: a checkpoint dir or a .gguf file, see `locate_model`)."""
    if model_cfg.backend == "torch":
        return "torch", None
    cpu = torch.device(model_cfg.device).type == "cpu"
    gguf = gguf_source(source, is_default=model_cfg.model is None) if cpu else None
    if model_cfg.backend == "auto":
        fits = gguf is not None and ggml_available()
        return ("ggml", gguf) if fits else ("torch", None)
    if not cpu:
        raise ValueError(f"backend 'ggml' runs on the CPU; device is {model_cfg.device!r}")
    if gguf is None:
        raise ValueError(
            f"backend 'ggml' runs GGUF models; {source} came from no GGUF file that "
            "adaserve knows of: pass the .gguf file as the model (or gguf_file in a repo)"
        )
    if not ggml_available():
        raise ValueError(
            "backend 'ggml' needs llama-cpp-python: pip install 'adaserve[cpu]' (it builds "
            "llama.cpp from source, a few minutes on first install)"
        )
    return "ggml", gguf


def _target_tokenizer(model_cfg: ModelConfig, target_path: Path):
    """The model's own tokenizer, or the one `model_cfg.tokenizer` names (checked to fit)."""
    if model_cfg.tokenizer is None:
        return load_tokenizer(target_path, model_cfg.trust_remote_code)
    tokenizer = load_tokenizer(locate_tokenizer(model_cfg.tokenizer), model_cfg.trust_remote_code)
    vocab_size = load_args(target_path).vocab_size
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"tokenizer {model_cfg.tokenizer!r} has {len(tokenizer)} tokens, more than the "
            f"model's {vocab_size}: it is not this model's tokenizer"
        )
    return tokenizer


def _build_ggml_runner(
    gguf: Path, target_path: Path, cache_cfg: CacheConfig, threads: int | None = None
) -> GgmlRunner:
    args = load_args(target_path)
    if cache_cfg.num_blocks is not None:
        tokens = cache_cfg.num_blocks * cache_cfg.block_size
    else:
        # llama.cpp stores K and V in float16.
        per_block = KVCache.bytes_per_block(
            args.num_layers, cache_cfg.block_size, args.num_kv_heads, args.head_dim, torch.float16
        )
        blocks = blocks_for_memory(per_block, cache_cfg.memory_fraction, torch.device("cpu"))
        tokens = min(blocks * cache_cfg.block_size, cache_cfg.ggml_max_cache_tokens)
    return GgmlRunner(
        gguf,
        target_path,
        tokens,
        cache_cfg.block_size,
        n_batch=cache_cfg.ggml_n_batch,
        n_ubatch=cache_cfg.ggml_n_ubatch,
        n_threads=threads,
        max_kept_cells=cache_cfg.ggml_kept_prefix_cells,
    )


def _build_head_runner(
    path: Path, target: Runner, model_cfg: ModelConfig, num_blocks: int, cache_cfg: CacheConfig
) -> EagleRunner:
    if isinstance(target, ModelRunner):
        head = load_eagle_head(path, target.model)
    else:
        # A target torch does not run (ggml): the head borrows the checkpoint's embedding and
        # LM head, loaded on their own, and drafts from llama.cpp's final hidden states.
        assert target.checkpoint is not None
        head = load_eagle_head(path, load_embedding_and_head(target.checkpoint))
    a = head.args
    ref = head.embed_weight
    assert ref is not None  # load_eagle_head attaches the head to the target's embedding
    cache = KVCache(
        1, num_blocks, cache_cfg.block_size, a.num_kv_heads, a.head_dim, ref.dtype, ref.device
    )
    backend = make_attention_backend(model_cfg.attention_backend, cache, a.num_heads)
    return EagleRunner(head, cache, backend, checkpoint=path)


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
        self.threads = model_cfg.threads
        torch_threads = torch.get_num_threads()  # what torch runs on unless told otherwise
        if self.threads is not None:
            torch.set_num_threads(self.threads)
        source = locate_model(model_cfg.model, model_cfg.revision, model_cfg.gguf_file)
        self.backend, gguf = pick_backend(model_cfg, source)
        # The thread count the target runs on when none is set (llama.cpp: every core this
        # process may use): `--threads` naming it changes nothing, cached profile included.
        self.default_threads = (
            len(os.sched_getaffinity(0)) if self.backend == "ggml" else torch_threads
        )
        # A GGUF's dir holds dequantized weights only for torch: llama.cpp reads the file.
        self.target_path = checkpoint_dir(source, weights=self.backend == "torch")
        self.tokenizer = _target_tokenizer(model_cfg, self.target_path)
        self.generation_eos_ids = generation_eos_ids(self.target_path)
        self.target: Runner
        if self.backend == "ggml":
            assert gguf is not None
            self.target = _build_ggml_runner(gguf, self.target_path, cache_cfg, model_cfg.threads)
        else:
            self.target = _build_runner(
                self.target_path, model_cfg, cache_cfg.num_blocks, cache_cfg
            )
        self.cuda_graphs = model_cfg.cuda_graphs
        self.draft_graphs: DraftGraphRunner | None = None  # see enable_draft_graphs
        self.draft: Runner | None = None
        self.draft_path: Path | None = None
        if model_cfg.draft_model is not None or need_draft:
            if model_cfg.draft_model is None:
                pick = default_head_dir if need_draft == "eagle" else default_draft_dir
                self.draft_path = pick(self.target_path)
                draft_gguf = None
            else:
                draft_source = locate_model(model_cfg.draft_model)
                # A GGUF draft beside a ggml target runs on ggml too: no weights expanded.
                draft_gguf = gguf_source(draft_source) if self.backend == "ggml" else None
                self.draft_path = checkpoint_dir(draft_source, weights=draft_gguf is None)
            draft_blocks = max(1, int(self.target.cache.num_blocks * cache_cfg.draft_blocks_ratio))
            if is_eagle_head(self.draft_path):
                self.draft = _build_head_runner(
                    self.draft_path, self.target, model_cfg, draft_blocks, cache_cfg
                )
                self.target.capture_hidden = True  # the head drafts from the target's features
            else:
                check_draft_compatible(self.target_path, self.draft_path)
                # (No draft named: the default draft, a checkpoint dir, never a GGUF file.)
                if draft_gguf is not None:  # a GGUF draft beside a ggml target: ggml too
                    cells = CacheConfig(
                        block_size=cache_cfg.block_size,
                        num_blocks=draft_blocks,
                        enable_prefix_caching=False,
                    )
                    self.draft = _build_ggml_runner(
                        draft_gguf, self.draft_path, cells, model_cfg.threads
                    )
                else:
                    self.draft = _build_runner(self.draft_path, model_cfg, draft_blocks, cache_cfg)
            k = model_cfg.draft_vocab_size
            vocab = self.draft.args.vocab_size
            if k is not None and k < vocab and isinstance(self.draft, ModelRunner):
                ids = draft_vocab_ids(self.target_path.name, vocab, k, model_cfg.draft_vocab_file)
                self.draft.model.restrict_head(torch.tensor(ids, dtype=torch.long))
        # Automatic prefix caching, one index per KV cache (see exec/prefix_cache.py).
        self.target_prefix: PrefixCache | None = None
        self.draft_prefix: PrefixCache | None = None
        if cache_cfg.enable_prefix_caching:
            # (On llama.cpp the blocks are virtual; the cells are shared by sequence id.)
            self.target_prefix = PrefixCache(self.target.cache)
            if isinstance(self.draft, ModelRunner) and not self.draft_is_head:
                # A head's KV depends on the target's features, not on tokens alone.
                self.draft_prefix = PrefixCache(self.draft.cache)
        args = self.target.args
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
        for runner in (self.target, self.draft):
            if (
                self.cuda_graphs
                and type(runner) is ModelRunner  # an EAGLE head or llama.cpp: eager
                and runner.backend.supports_cuda_graphs()
            ):
                # A batch of S sequences holds at least S tokens: the token bound bounds both.
                # On a draft model it replays the KV catch-up and the draft steps alike.
                n = model_cfg.cuda_graph_max_tokens
                runner.graphs = ForwardGraphRunner(runner, n, n, self.max_model_len + n)

    def capture_graphs(self, max_num_seqs: int, budget: int) -> int:
        """Capture the target's graphs for decode iterations of up to `max_num_seqs` requests
        and `budget` verified tokens (ForwardGraphRunner.start_keys); how many were captured
        (0 without graphs)."""
        graphs = getattr(self.target, "graphs", None)
        if not isinstance(graphs, ForwardGraphRunner):
            return 0
        return graphs.capture(graphs.start_keys(max_num_seqs, budget))

    def run(self, plan: PlanToRun) -> ForwardOutput:
        """Run one iteration's plan: the target forward (and the draft's prompt catch-up)."""
        return run_plan(self.target, self.draft, plan, self.clock)

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
            or d.graphs is not None  # its ForwardGraphRunner replays the steps already
        ):
            return
        self.draft_graphs = DraftGraphRunner(d, max_num_seqs, max_width)
