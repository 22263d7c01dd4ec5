"""The drafter interface: who proposes a candidate tree per running request.

The selection never knows who drafted: it sees CandidateTrees with a draft log-probability on
every node. A drafter keeps whatever per-request state it needs (an index, draft KV) and hears
about requests through the hooks below; the scheduler owns the requests and calls them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from adaserve.tree import CandidateTree

if TYPE_CHECKING:
    import torch

    from adaserve.request_manager.policies import SpecShape
    from adaserve.request_manager.request import Request

# Called by a step-wise drafter after each growth step with the trees so far and each tree's
# newest frontier; returning False stops drafting early (speculation control).
KeepGoing = Callable[[list[CandidateTree], list[list[int]]], bool]


class Drafter(ABC):
    """Proposes one candidate tree per request for the shape of this iteration."""

    name: str = "?"
    # True when proposing runs a model forward (then the controller weighs its cost).
    costly: bool = False
    # True when the drafter reads the target's hidden states (observe_features).
    wants_features: bool = False

    def scratch_tokens(self, shape: SpecShape) -> int:
        """Draft-KV entries beyond the committed tokens one request needs while proposing."""
        return 0

    @abstractmethod
    def propose(
        self, requests: Sequence[Request], shape: SpecShape, keep_going: KeepGoing | None = None
    ) -> list[CandidateTree]:
        """One tree per request, rooted at its last committed token (root only: nothing)."""

    def observe_features(self, request: Request, position: int, hidden: torch.Tensor) -> None:
        """The target computed final hidden states `hidden` [n, H] for positions
        position..position+n-1 of `request` (only called when `wants_features`)."""
        return None

    def on_finish(self, request: Request) -> None:
        """A request finished normally (its text may serve later requests)."""
        return None

    def on_release(self, request: Request) -> None:
        """A request left the running set (finished, aborted or preempted): drop its state."""
        return None
