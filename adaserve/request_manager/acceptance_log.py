"""A record of every verified tree: what the drafter proposed and what the target accepted.

`adaserve serve --record-acceptance FILE` (and `LLM(record_acceptance=FILE)`) append one JSON
line per verified tree:

    {"p": parents, "q": draft probability of each node given its parent (4 digits),
     "v": verified nodes (selected, root excluded), "a": accepted nodes}

The whole candidate tree is kept, not only the selected nodes: the simulator (`adaserve
simulate --acceptance FILE`) draws synthetic trees whose probabilities follow these (by depth
and sibling rank) and marks a node correct with the probability that verified nodes of that
depth and draft probability were accepted (`adaserve.sim.acceptance`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from adaserve.request_manager.jsonl import JsonLines
from adaserve.tree import CandidateTree


class AcceptanceLog:
    """Appends verified trees to a JSONL file (buffered; `close` flushes)."""

    def __init__(self, path: str | Path) -> None:
        self.lines = JsonLines(path)

    @property
    def path(self) -> Path:
        return self.lines.path

    @property
    def num_trees(self) -> int:
        return self.lines.num_lines

    def record(self, tree: CandidateTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """`verified`: candidate nodes sent to the target (root included); `accepted`: kept."""
        self.lines.append(
            {
                "p": tree.parents,
                "q": [round(math.exp(lp), 4) for lp in tree.logprobs],
                "v": sorted(v for v in verified if v != 0),
                "a": sorted(accepted),
            }
        )

    def flush(self) -> None:
        self.lines.flush()

    def close(self) -> None:
        self.lines.close()
