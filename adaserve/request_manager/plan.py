"""IterationPlan: what one iteration runs, decided by the scheduler before the engine runs it.

`Scheduler.schedule()` builds it (trees drafted and selected, prompt chunks sized, KV slots
reserved), `ExecutionEngine.run(plan)` runs its forward, `Scheduler.commit(plan, out)` walks
the verified trees and advances the prompts. The plan is plain data: it can be logged,
tested and run on the simulator's clock as on a real engine, and it is what the iteration
timeline records (`timeline.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from adaserve.exec.batch import ForwardBatch
from adaserve.request_manager.request import Request
from adaserve.request_manager.speculation import TreePlan
from adaserve.request_manager.stats import IterationStats
from adaserve.tree import CandidateTree, VerifyTree


@dataclass(frozen=True)
class TreeItem:
    """A decoding request's verification tree: its root (last token) and selected nodes."""

    request: Request
    candidate: CandidateTree  # as drafted (capped); calibration and the acceptance log read it
    tree: VerifyTree  # the selected nodes re-indexed: tokens, parents (-1: root), depths
    kv_start: int  # its first KV slot: the request's cached tokens when planned
    first_row: int  # flat index of its root in the batch (features are read from here)
    logit_rows: tuple[int, ...]  # its rows in the logits, one per tree node


@dataclass(frozen=True)
class ChunkItem:
    """Prompt tokens [start, end) of a prefilling request computed in this forward."""

    request: Request
    start: int
    end: int
    first_row: int  # flat index of its first token in the batch
    logit_row: int | None  # the last prompt token's logits: it samples the first output token
    draft_end: int | None = None  # the draft model's KV catches up to here (None: it does not)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class IterationPlan:
    """One iteration: a target forward over trees and prompt chunks, with its KV slots."""

    trees: tuple[TreeItem, ...]
    chunks: tuple[ChunkItem, ...]
    batch: ForwardBatch  # what the target runs; KV slots reserved in each block table
    pad_to: int  # tokens the forward runs, padding rows included
    draft_batch: ForwardBatch | None  # a draft model's prompt catch-up (None: nothing)
    budget: int  # B: the policy's token budget for verification
    context: int  # cached tokens of the decoding requests, summed
    chunk_context: int  # cached tokens of the prefilling requests, summed
    predicted_s: float | None  # the cost model's forward time (None: no cost model)
    speculation: TreePlan  # candidate trees, selections, shape, draft and select time
    stats: IterationStats  # filled while planning, completed by the commit
    started_s: float  # clock when planning began (drafting included)
    built_s: float  # clock when trees and chunks were chosen and the batch began
    gap_s: float | None  # since the previous iteration ended (None: the engine was idle)
    # Requests finished while planning (alone, they no longer fit in KV).
    cut_short: tuple[Request, ...] = ()
    idle: bool = False  # nothing to run: no request is prefilling or decoding

    @property
    def is_empty(self) -> bool:
        return not self.batch.token_ids

    @property
    def decoding(self) -> list[Request]:
        return [t.request for t in self.trees]

    @classmethod
    def empty(
        cls, now: float, budget: int, cut_short: tuple[Request, ...] = (), idle: bool = False
    ) -> IterationPlan:
        """A plan that runs nothing (idle, or every request was cut short while planning)."""
        return cls(
            trees=(),
            chunks=(),
            batch=ForwardBatch([], [], [], [], [], []),
            pad_to=0,
            draft_batch=None,
            budget=budget,
            context=0,
            chunk_context=0,
            predicted_s=None,
            speculation=TreePlan([], [], []),
            stats=IterationStats("decode", 0, 0, budget=budget),
            started_s=now,
            built_s=now,
            gap_s=None,
            cut_short=cut_short,
            idle=idle,
        )
