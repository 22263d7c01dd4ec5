"""The runner protocol: what every model runner implements, and how an iteration's plan runs.

Four runners implement it: the torch `ModelRunner` (and its `EagleRunner`, `torch_runner.py`),
the llama.cpp `GgmlRunner` (`ggml.py`) and the simulator's `SimRunner` (`sim/engine.py`).
The request manager reserves KV through `runner.cache` before it hands a batch over; a runner
never allocates a request's KV itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from adaserve.exec.batch import ForwardBatch
from adaserve.exec.kv_cache import KVCacheLike
from adaserve.exec.model.llama import LlamaArgs
from adaserve.exec.prefix_cache import PrefixCache


@runtime_checkable
class Runner(Protocol):
    """One model with its KV cache: forward over a batch -> logits (and features)."""

    device: torch.device
    # forward(pad_to=...) runs extra throw-away rows (the controller pads when that is cheaper)
    supports_padding: bool
    # Its attention reads only the KV a sequence holds: timing must compute a context first.
    needs_context: bool
    # Forwards of at least this many tokens run a tiled attention kernel, smaller ones each
    # query row alone (llama.cpp on the CPU: 64); None when the cost has no such step.
    attention_tile_tokens: int | None
    # When set, every forward keeps its final hidden states [T, hidden] in `last_hidden`.
    capture_hidden: bool
    last_hidden: torch.Tensor | None
    # The checkpoint directory its config (and tokenizer) came from; None: not from one.
    checkpoint: Path | None

    @property
    def cache(self) -> KVCacheLike:
        """KVCache (torch, sim) or GgmlKVCache: block tables in, KV slots out."""
        ...

    @property
    def args(self) -> LlamaArgs:
        """The model's configuration (layers, heads, vocabulary, context length)."""
        ...

    @property
    def head_token_ids(self) -> torch.Tensor | None:
        """A reduced-vocabulary LM head's token ids per logit column (None: full vocabulary)."""
        ...

    def forward(self, batch: ForwardBatch, pad_to: int | None = None) -> torch.Tensor | None:
        """float32 logits [len(logits_indices), vocab], or None when no logits are wanted."""
        ...

    def cost_points(self, max_tokens: int) -> list[tuple[int, int, float]]:
        """A quick measured cost curve (tokens, context, seconds) that seeds a cost model."""
        ...

    def tree_pair_cost(self) -> float | None:
        """Measured seconds per tree pair beyond the cost curve (`exec/timing.py`
        `tree_pair_cost`); None when it could not be measured."""
        ...

    def timing_key(self) -> tuple | None:
        """What its forwards' times depend on (weights file, backend, threads, ...): a second
        runner with the same key times like this one, so start-up measurements are taken once
        per process (`timing.measured_once`); None: measure every time."""
        ...


class PlanToRun(Protocol):
    """What the engine reads of an iteration plan (request_manager/plan.py builds it)."""

    @property
    def batch(self) -> ForwardBatch: ...

    @property
    def pad_to(self) -> int: ...

    @property
    def draft_batch(self) -> ForwardBatch | None: ...


@dataclass(frozen=True)
class ForwardOutput:
    """What running a plan returned: the target's logits (and features), and when it ran."""

    logits: torch.Tensor | None  # [rows wanted, vocab] float32
    hidden: torch.Tensor | None  # [tokens run, hidden]: only when the target captures them
    start_s: float  # clock at the start of the target forward
    end_s: float  # clock at its end (the draft's prompt catch-up runs after)

    @property
    def forward_s(self) -> float:
        return self.end_s - self.start_s


def run_plan(
    target: Runner, draft: Runner | None, plan: PlanToRun, clock: Callable[[], float]
) -> ForwardOutput:
    """The target forward over the plan's batch, then the draft's forward over the prompt
    tokens it must also hold (a draft model's KV catch-up on this iteration's prompt chunks)."""
    start = clock()
    if not plan.batch.token_ids:
        return ForwardOutput(None, None, start, start)
    logits = target.forward(plan.batch, pad_to=plan.pad_to)
    end = clock()
    hidden = target.last_hidden if target.capture_hidden else None
    if draft is not None and plan.draft_batch is not None:
        draft.forward(plan.draft_batch)
    return ForwardOutput(logits, hidden, start, end)


class Engine(Protocol):
    """What the scheduler uses of an engine: the real `ExecutionEngine` or the simulator's."""

    tokenizer: Any
    generation_eos_ids: tuple[int, ...]  # generation_config.json's end ids, besides eos_token
    max_model_len: int
    vocab_size: int
    target_prefix: PrefixCache | None
    draft_prefix: PrefixCache | None
    cuda_graphs: bool
    draft_graphs: Any  # DraftGraphRunner | None (CUDA only)

    # Read-only here, so an engine may hold a narrower runner type (the simulator's SimRunner).
    @property
    def target(self) -> Runner: ...

    @property
    def draft(self) -> Runner | None: ...

    def clock(self) -> float: ...

    @property
    def draft_is_head(self) -> bool: ...

    def run(self, plan: PlanToRun) -> ForwardOutput: ...

    def enable_draft_graphs(self, max_num_seqs: int, max_width: int) -> None: ...
