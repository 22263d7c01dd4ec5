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

import atexit
import json
import math
from collections.abc import Sequence
from pathlib import Path

from adaserve.tree import CandidateTree

# Lines are written in batches: a record per iteration must not cost a syscall per tree.
FLUSH_EVERY = 256


class AcceptanceLog:
    """Appends verified trees to a JSONL file (buffered; `close` flushes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a")  # noqa: SIM115 - closed by close()
        self._pending: list[str] = []
        self.num_trees = 0
        atexit.register(self.close)  # a server stopped by a signal still writes its tail

    def record(self, tree: CandidateTree, verified: Sequence[int], accepted: Sequence[int]) -> None:
        """`verified`: candidate nodes sent to the target (root included); `accepted`: kept."""
        row = {
            "p": tree.parents,
            "q": [round(math.exp(lp), 4) for lp in tree.logprobs],
            "v": sorted(v for v in verified if v != 0),
            "a": sorted(accepted),
        }
        self._pending.append(json.dumps(row, separators=(",", ":")))
        self.num_trees += 1
        if len(self._pending) >= FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            self._file.write("\n".join(self._pending) + "\n")
            self._file.flush()
            self._pending.clear()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()
