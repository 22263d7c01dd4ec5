"""Which replica serves a request: SLO-aware routing over the stats replicas publish.

Every replica publishes `ReplicaStats` now and then (the simulator: at each refresh period;
a Ray deployment: `record_routing_stats`). Between refreshes the router keeps a reservation
per replica, the requests it sent there since, so a burst does not pile onto the replica that
looked emptiest a second ago.

Policies (`rank` returns replica indices, best first; an empty list means refuse):

- `round_robin`: each in turn.
- `pow2` (Ray Serve's default): two replicas at random, the one with fewer requests first.
- `slo`: the replicas whose predicted TPOT with this request admitted stays within
  `headroom x slo_tpot_ms` (and within the tightest SLO they already hold) come first; a
  tight request goes where the predicted TPOT is lowest (the most room), a loose one where
  it is highest while still within its SLO (best fit: it fills a busy replica and leaves
  the empty ones for tight requests). None feasible: refuse (the cluster-wide 429).

    predicted(i) = tpot_ms(i) + slope_ms(i) x reserved(i)
    feasible(i) <=> predicted(i) <= headroom x min(slo_tpot_ms, tightest_slo_ms(i))
    tight <=> slo_tpot_ms <= tight_factor x min_i tpot_ms(i)
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adaserve.request_manager.admission import Admission

ROUTERS = ("slo", "pow2", "round_robin")
# A request whose SLO is within this factor of the best TPOT any replica offers is tight.
TIGHT_FACTOR = 1.5


@dataclass(frozen=True)
class ReplicaStats:
    """What one replica says about itself (a snapshot)."""

    num_requests: int  # running + prefilling + waiting
    tpot_ms: float  # predicted TPOT of one more request admitted now (`Admission`)
    slope_ms: float  # how much each further request adds to that prediction
    tightest_slo_ms: float = math.inf  # the tightest TPOT SLO among its admitted requests


def replica_stats(admission: Admission) -> ReplicaStats:
    """What a replica publishes, from its own admission's view of its load."""
    running, prefilling, waiting = admission.queues()
    reqs = [*running, *prefilling, *waiting]
    one, two = admission.predicted_tpot_s(1), admission.predicted_tpot_s(2)
    tpot_ms = 1000.0 * one if one is not None else 0.0
    slope_ms = 1000.0 * (two - one) if one is not None and two is not None else 0.0
    slos = [r.params.slo_tpot_ms for r in reqs if r.params.slo_tpot_ms is not None]
    return ReplicaStats(len(reqs), tpot_ms, max(0.0, slope_ms), min(slos, default=math.inf))


class Router:
    """Ranks replicas for each request; `refresh` takes new stats and clears reservations."""

    def __init__(
        self, policy: str, num_replicas: int, headroom: float = 0.85, seed: int = 0
    ) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; one of {', '.join(ROUTERS)}")
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.policy, self.num_replicas, self.headroom = policy, num_replicas, headroom
        self.rng = random.Random(seed)
        self.stats: list[ReplicaStats] = [ReplicaStats(0, 0.0, 0.0)] * num_replicas
        self.reserved = [0] * num_replicas
        self._next = 0

    def refresh(self, stats: Sequence[ReplicaStats]) -> None:
        if len(stats) != self.num_replicas:
            raise ValueError(f"{len(stats)} stats for {self.num_replicas} replicas")
        self.stats, self.reserved = list(stats), [0] * self.num_replicas

    def predicted_tpot_ms(self, i: int) -> float:
        s = self.stats[i]
        return s.tpot_ms + s.slope_ms * self.reserved[i]

    def rank(self, slo_tpot_ms: float | None) -> list[int]:
        """Replica indices to try, best first; [] = no replica can meet `slo_tpot_ms`."""
        n = self.num_replicas
        if self.policy == "round_robin":
            start, self._next = self._next, (self._next + 1) % n
            return [(start + k) % n for k in range(n)]
        load = [self.stats[i].num_requests + self.reserved[i] for i in range(n)]
        if self.policy == "pow2":
            pair = self.rng.sample(range(n), min(2, n))
            first = sorted(pair, key=lambda i: load[i])
            return first + sorted((i for i in range(n) if i not in pair), key=lambda i: load[i])
        return self._rank_slo(slo_tpot_ms, load)

    def _rank_slo(self, slo_tpot_ms: float | None, load: list[int]) -> list[int]:
        n = self.num_replicas
        tpot = [self.predicted_tpot_ms(i) for i in range(n)]
        bound = [
            self.headroom * min(slo_tpot_ms or math.inf, self.stats[i].tightest_slo_ms)
            for i in range(n)
        ]
        feasible = [i for i in range(n) if tpot[i] <= bound[i]]
        if slo_tpot_ms is None:
            # No SLO of its own: the least loaded replica that keeps the others' SLOs.
            return sorted(feasible, key=lambda i: (load[i], tpot[i], i))
        tight = slo_tpot_ms <= TIGHT_FACTOR * min(tpot)
        if tight:
            return sorted(feasible, key=lambda i: (tpot[i], load[i], i))
        return sorted(feasible, key=lambda i: (-tpot[i], load[i], i))

    def fallback(self) -> int:
        """Where a request goes when no replica is feasible and nothing is refused: the one
        with the lowest predicted TPOT."""
        return min(range(self.num_replicas), key=lambda i: (self.predicted_tpot_ms(i), i))

    def routed(self, i: int) -> None:
        """A request went to replica `i`: reserve its share until the next refresh."""
        self.reserved[i] += 1
