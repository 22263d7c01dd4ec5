"""SLO arithmetic: how many tokens a request must accept now, and the iteration-latency estimate."""

from __future__ import annotations

from collections.abc import Sequence

from adaserve.config import SchedulerConfig
from adaserve.request_manager.request import Request
from adaserve.tree import required_accepts


def ttft_objective_ms(
    prefill_alone_ms: float,
    factor: float = SchedulerConfig.default_ttft_factor,
    floor_ms: float = SchedulerConfig.default_ttft_floor_ms,
) -> float:
    """The TTFT objective of a request that names none: `floor_ms` plus `factor` x the time to
    prefill its prompt alone on this machine (a user waits longer for a longer prompt, but a
    first token seconds late is lost to them whatever its TPOT)."""
    return floor_ms + factor * prefill_alone_ms


class TSpecEstimator:
    """t_spec: exponential moving average of measured speculative-iteration latency (seconds)."""

    def __init__(self, initial_s: float, weight: float) -> None:
        self.value_s = initial_s
        self.weight = weight
        self.num_samples = 0

    def update(self, sample_s: float) -> None:
        # The first sample replaces the guess outright; later ones blend in.
        w = 1.0 if self.num_samples == 0 else self.weight
        self.value_s = (1 - w) * self.value_s + w * sample_s
        self.num_samples += 1


def slo_requirements(
    requests: Sequence[Request], now: float, t_spec_s: float, depth: int
) -> tuple[list[float | None], list[float | None]]:
    """(A_cap(r), A(r)) per request; None for requests without an SLO.

    A(r) = (l_r + t_spec) / tpot_r - o_r, with l_r the time since r's first output token and
    o_r its output tokens so far; A_cap(r) = min(A(r), d + 1): a tree of depth d cannot yield more.
    """
    caps: list[float | None] = []
    needs: list[float | None] = []
    for r in requests:
        slo_ms = r.paced_slo_tpot_ms
        first = r.metrics.first_token_time
        if slo_ms is None or first is None:
            caps.append(None)
            needs.append(None)
            continue
        # o_r counts tokens after the first, the ones TPOT is measured over.
        a = required_accepts(now - first, t_spec_s, slo_ms / 1000.0, len(r.output_token_ids) - 1)
        needs.append(a)
        caps.append(min(a, depth + 1))
    return caps, needs
