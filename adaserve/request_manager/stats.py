"""IterationStats: what one iteration did; the metrics, the benchmarks and the timeline read it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class IterationStats:
    """What one iteration did; the metrics and the benchmark read these."""

    kind: str  # "decode" (something decoded, maybe with prefill chunks) or "prefill"
    num_requests: int  # decoding requests (prefill iterations: requests prefilled)
    num_tokens: int  # tree tokens in the target forward (prefill iterations: prompt tokens)
    prefill_tokens: int = 0  # prompt tokens computed in this forward
    prefill_requests: int = 0  # requests that got a prefill chunk
    padded_tokens: int = 0  # tokens the forward ran, padding included
    speculative: bool = False  # the policy speculates (whether or not it drafted now)
    drafted: bool = False  # the drafter ran this iteration
    draft_nodes: int = 0  # non-root nodes the drafter proposed
    tree_tokens: int = 0  # non-root tree nodes verified
    accepted_tokens: int = 0  # non-root tree nodes accepted
    emitted_tokens: int = 0  # tokens committed (accepted + bonus)
    deferred_rows: int = 0  # running streams ahead of their pace that sat out (pacing.py)
    budget: int = 0
    depth: int = 0
    width: int = 0
    draft_s: float = 0.0
    select_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0
    forward_s: float = 0.0  # the target forward alone
    # Wall time of the iteration outside model forwards: scheduling, sampling, detokenizing,
    # and what the serving loop did since the previous iteration ended (streaming, new
    # requests). None after an idle engine (the gap then is waiting, not work).
    host_s: float | None = None

    @property
    def budget_utilization(self) -> float:
        return self.num_tokens / self.budget if self.budget else 0.0
