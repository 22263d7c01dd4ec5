"""Which replica serves a request: SLO-aware routing over the stats replicas publish.

Every replica publishes `ReplicaStats` now and then (the simulator: at each refresh period;
a Ray deployment: `record_routing_stats`). Between refreshes the router keeps a reservation
per replica, the requests it sent there since, so a burst does not pile onto the replica that
looked emptiest a second ago.

Policies (`rank` returns replica indices, best first; an empty list means refuse):

- `round_robin`: each in turn.
- `pow2` (Ray Serve's default): two replicas at random, the one with fewer requests first.
- `slo`: the replicas whose predicted TPOT with this request admitted stays within
  `headroom x slo_tpot_ms` (and within the tightest SLO they already hold), and whose
  backlog of prompts drains within `ttft_budget_s` (else a first token waits behind it),
  come first; a tight request goes where the predicted TPOT is lowest (the most room); a
  loose one to the fewest requests, a replica that holds tighter requests (whose room it
  would eat into) counted up to `LOOSE_AVERSION` (2) times as loaded, less as such replicas
  become most of the feasible ones (`loose_aversion`), so the classes tend to separate
  without piling onto the few replicas that hold no tight request. None
  feasible: refuse (the cluster-wide 429). Two designs lost at paper scale (8 replicas,
  roofline, 32 rps, against power-of-two's 100%): packing loose requests where the predicted
  TPOT is highest (best fit), 29.7%, because where a forward costs about the same for 1 or
  200 tokens the prediction hardly moves as a replica fills and one replica took nearly
  every loose request; and sending them strictly to replicas holding no tighter request,
  93.2%, as those few replicas' prompts queued past their first-token objectives. A fixed
  aversion of 2 lost to power of two at 64 simulated replicas (stats 0.5 s old) and one of
  a request more lost on the real 2-replica Ray replay (docs/results.md); the shrinking
  aversion is 2 on two replicas and near 1 where nearly every replica holds a tight request.

    predicted(i) = tpot_ms(i) + slope_ms(i) x reserved(i)
    feasible(i) <=> predicted(i) <= headroom x min(slo_tpot_ms, tightest_slo_ms(i))
                    and backlog_s(i) + prompt_s(i) x reserved(i) <= ttft_budget_s
    tight <=> slo_tpot_ms <= tight_factor x min_i tpot_ms(i)
    loose order: (requests(i) + reserved(i)) x (a if tightest_slo_ms(i) < slo_tpot_ms else 1)
    a = 1 + (LOOSE_AVERSION - 1) x (1 - share of the feasible replicas that hold tighter ones)
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
# A loose request counts a replica that holds tighter requests as this many times as
# loaded: it prefers to leave their room alone, but not at the price of piling onto the few
# replicas that hold none (a strict preference lost 7 points of TTFT attainment at scale).
LOOSE_AVERSION = 2.0
# Held requests whose prompts price a typical newcomer's (`ReplicaStats.prompt_s`).
PROMPT_SAMPLE = 16


@dataclass(frozen=True)
class ReplicaStats:
    """What one replica says about itself (a snapshot)."""

    num_requests: int  # running + prefilling + waiting
    tpot_ms: float  # predicted TPOT of one more request admitted now (`Admission`)
    slope_ms: float  # how much each further request adds to that prediction
    tightest_slo_ms: float = math.inf  # the tightest TPOT SLO among its admitted requests
    # Seconds its waiting and prefilling prompts take to prefill, each at its speed alone:
    # the least a new prompt waits there. The TPOT prediction does not see it (requests
    # beyond the batch cap only wait), so without it a loose request is packed onto a
    # replica whose queue already makes every first token late.
    backlog_s: float = 0.0
    # Seconds a prompt like the ones it holds (their mean, up to PROMPT_SAMPLE of them) takes
    # to prefill alone: what each request routed here since this snapshot adds to its
    # backlog until the next one shows it (0: holds nothing, nothing known).
    prompt_s: float = 0.0


def replica_stats(admission: Admission) -> ReplicaStats:
    """What a replica publishes, from its own admission's view of its load."""
    running, prefilling, waiting = admission.queues()
    reqs = [*running, *prefilling, *waiting]
    one, two = admission.predicted_tpot_s(1), admission.predicted_tpot_s(2)
    tpot_ms = 1000.0 * one if one is not None else 0.0
    slope_ms = 1000.0 * (two - one) if one is not None and two is not None else 0.0
    slos = [r.params.slo_tpot_ms for r in reqs if r.params.slo_tpot_ms is not None]
    backlog_s = prompt_s = 0.0
    if admission.cost is not None:
        for r in (*prefilling, *waiting):
            left = max(1, r.num_tokens - r.num_cached)
            pairs = left * r.num_cached + left * (left + 1) // 2
            backlog_s += admission.iteration_s(left, r.num_cached, left, pairs)
        sample = [max(1, len(r.prompt_token_ids)) for r in reqs[:PROMPT_SAMPLE]]
        if sample:
            prompt_s = sum(admission.iteration_s(n, 0, n, n * (n + 1) // 2) for n in sample)
            prompt_s /= len(sample)
    return ReplicaStats(
        len(reqs), tpot_ms, max(0.0, slope_ms), min(slos, default=math.inf), backlog_s, prompt_s
    )


def loose_aversion(holding: int, feasible: int) -> float:
    """How many times as loaded a loose request counts a feasible replica that holds tighter
    requests: LOOSE_AVERSION while at most half of the feasible replicas do, falling to 1 (no
    aversion) as all of them do. Where most replicas hold a tight request, the few that hold
    none would otherwise take the loose class's prompts until their load doubles and their
    prompts queue past first-token objectives (64 simulated replicas, stats 0.5 s old);
    with two replicas the rule is LOOSE_AVERSION's as before (one of two holding is half)."""
    if feasible <= 0:
        return 1.0
    return 1.0 + (LOOSE_AVERSION - 1.0) * min(1.0, 2.0 * (1.0 - holding / feasible))


class Router:
    """Ranks replicas for each request; `refresh` takes new stats and clears reservations."""

    def __init__(
        self,
        policy: str,
        num_replicas: int,
        headroom: float = 0.85,
        seed: int = 0,
        ttft_budget_s: float = 1.0,
    ) -> None:
        if policy not in ROUTERS:
            raise ValueError(f"unknown router {policy!r}; one of {', '.join(ROUTERS)}")
        if num_replicas < 1:
            raise ValueError(f"a router needs at least one replica, got {num_replicas}")
        self.policy, self.num_replicas, self.headroom = policy, num_replicas, headroom
        self.ttft_budget_s = ttft_budget_s
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

    def backlog_s(self, i: int) -> float:
        """Replica i's prompt backlog with a typical prompt for each request reserved there:
        between snapshots the backlog check must see a burst, or a replica that looked free
        takes every prompt of it (64 replicas, stats 0.5 s old: the loose class piled onto
        the few replicas holding no tight request and missed its first tokens)."""
        s = self.stats[i]
        return s.backlog_s + s.prompt_s * self.reserved[i]

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
        feasible = [
            i for i in range(n) if tpot[i] <= bound[i] and self.backlog_s(i) <= self.ttft_budget_s
        ]
        if slo_tpot_ms is None:
            # No SLO of its own: the least loaded replica that keeps the others' SLOs.
            return sorted(feasible, key=lambda i: (load[i], tpot[i], i))
        tight = slo_tpot_ms <= TIGHT_FACTOR * min(tpot)
        if tight:
            return sorted(feasible, key=lambda i: (tpot[i], load[i], i))
        # Loose: away from replicas that hold tighter requests (whose SLOs a loose stream would
        # eat into), then the fewest requests; the aversion shrinks as such replicas become
        # the rule (`loose_aversion`).
        held = {i for i in feasible if self.stats[i].tightest_slo_ms < slo_tpot_ms}
        aversion = loose_aversion(len(held), len(feasible))
        return sorted(
            feasible, key=lambda i: (load[i] * (aversion if i in held else 1), tpot[i], i)
        )

    def fallback(self) -> int:
        """Where a request goes when no replica is feasible and nothing is refused: the one
        with the shortest prompt backlog, then the lowest predicted TPOT."""
        return min(
            range(self.num_replicas),
            key=lambda i: (self.backlog_s(i), self.predicted_tpot_ms(i), i),
        )

    def routed(self, i: int) -> None:
        """A request went to replica `i`: reserve its share until the next refresh."""
        self.reserved[i] += 1
