"""Several drafters at once: their trees merged per request, the selection picks from the union."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from adaserve.request_manager.drafters.base import Drafter, KeepGoing
from adaserve.request_manager.policies import SpecShape
from adaserve.request_manager.request import Request
from adaserve.tree import CandidateTree, merge_trees


class CombinedDrafter(Drafter):
    """`model+suffix`: identical paths merge (noisy-OR of probabilities, see `merge_trees`)."""

    def __init__(self, parts: Sequence[Drafter]) -> None:
        if len(parts) < 2:
            raise ValueError(f"a combined drafter needs at least two drafters, got {len(parts)}")
        self.parts = list(parts)
        self.name = "+".join(p.name for p in parts)
        self.costly = any(p.costly for p in parts)
        self.wants_features = any(p.wants_features for p in parts)

    @property
    def has_cheap_part(self) -> bool:
        """Some part costs no model forward (it can propose while the costly ones are off)."""
        return any(not p.costly for p in self.parts)

    def scratch_tokens(self, shape: SpecShape) -> int:
        if shape.cheap_only:
            return 0
        return max(p.scratch_tokens(shape) for p in self.parts)

    def propose(
        self, requests: Sequence[Request], shape: SpecShape, keep_going: KeepGoing | None = None
    ) -> list[CandidateTree]:
        parts = [p for p in self.parts if not (shape.cheap_only and p.costly)]
        merged = parts[0].propose(requests, shape, keep_going)
        for part in parts[1:]:
            trees = part.propose(requests, shape, keep_going)
            merged = [merge_trees(a, b) for a, b in zip(merged, trees)]
        return merged

    def observe_features(self, request: Request, position: int, hidden: torch.Tensor) -> None:
        for p in self.parts:
            if p.wants_features:
                p.observe_features(request, position, hidden)

    def on_finish(self, request: Request) -> None:
        for p in self.parts:
            p.on_finish(request)

    def on_release(self, request: Request) -> None:
        for p in self.parts:
            p.on_release(request)
