"""Admission: the load averages, the TPOT a request admitted now would see, and refusal.

The scheduler feeds it every iteration (`observe`); the API asks it whether a request should
be refused (`refusal`, `--admission slo`) and never reads the scheduler's internals. Chunked
prefill prices iterations through `iteration_s` (the cost model's forward plus host time).
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from adaserve.config import SchedulerConfig
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.prefill import (
    OVERTAKE_S,
    forced_chunk,
    prefill_deadline,
    prefill_target,
)
from adaserve.request_manager.request import Request
from adaserve.request_manager.slo import ttft_objective_ms
from adaserve.request_manager.stats import IterationStats

# Seconds of backlog time over which `drain_rate` measures how fast prompts drained: several
# tiles' waits (each up to a second or two beside streams), short enough to follow the load.
DRAIN_WINDOW_S = 5.0

# (running, prefilling, waiting): the scheduler's queues as they stand.
Queues = Callable[[], tuple[Sequence[Request], Sequence[Request], Sequence[Request]]]


def behind(prefilling: Sequence[Request], first_token_due: float) -> list[Request]:
    """The prompts a request whose first token is due at `first_token_due` goes ahead of
    (`prefill.prefill_order`): those due more than OVERTAKE_S later."""
    return [r for r in prefilling if prefill_deadline(r) > first_token_due + OVERTAKE_S]


def forced_share(
    prefilling: Sequence[Request],
    forced: int,
    max_tokens: int | None,
    tokens_per_request: float,
    first_token_due: float | None = None,
) -> float:
    """The share of a new request's decode iterations that carry `forced` prompt tokens each.
    A prompt due before the new request's first token (`first_token_due`, as
    `prefill.prefill_order` ranks them) is prefilled before it decodes: it delays that first
    token, not the tokens after it. The others take ceil(their tokens / forced) iterations,
    over the iterations the request will decode (`max_tokens` at the recent tokens per request
    and iteration), at most all of them; all of them when its length is unknown (as if the
    prompts never ended)."""
    if forced <= 0:
        return 0.0
    if first_token_due is not None:
        prefilling = behind(prefilling, first_token_due)
        if not prefilling:
            return 0.0
    if max_tokens is None:
        return 1.0
    pending = sum(prefill_target(r) - r.num_cached for r in prefilling)
    slowed = -(-max(0, pending) // forced)  # iterations until the prompts are in
    life = max(1.0, max_tokens / max(tokens_per_request, 1.0))
    return min(1.0, slowed / life)


def mean_depth(prefilling: Sequence[Request]) -> int:
    """Tokens already in its prompt ahead of a pending prompt token, on average over the
    prompt tokens still to prefill: how many keys a chunk attends over the prompts' prefill."""
    pending = weighted = 0
    for r in prefilling:
        left = max(0, prefill_target(r) - r.num_cached)
        pending += left
        weighted += left * (r.num_cached + prefill_target(r)) // 2
    return weighted // pending if pending else 0


def iterations_left(req: Request, tokens_per_request: float) -> float:
    """Decode iterations a request admitted here still holds a row for, at most: its
    `max_tokens` not yet emitted at the recent tokens per request and iteration (it may stop
    sooner, never later)."""
    left = max(0, req.params.max_tokens - len(req.output_token_ids))
    return left / max(tokens_per_request, 1.0)


def batch_over_time(
    ends: Sequence[tuple[float, int]],
    extra: int,
    extra_until: float,
    cap: int,
    extra_context: int = 0,
) -> list[tuple[float, float, int, int]]:
    """The batch as the requests here end: (start, stop, rows, context) segments of
    iterations from now, each row present until its end (`ends`: (iterations left, context
    tokens) per request), `extra` more rows (newcomers, attending `extra_context` tokens
    between them) until `extra_until`; rows at most `cap`, the segments until every row has
    ended."""
    marks = sorted({0.0, extra_until, *(k for k, _ in ends)})
    segments = []
    for start, stop in zip(marks, marks[1:]):
        present = [c for k, c in ends if k > start]
        joined = extra_until > start
        rows = len(present) + (extra if joined else 0)
        if rows:
            context = sum(present) + (extra_context if joined else 0)
            segments.append((start, stop, min(rows, cap), context))
    return segments


# The most forced chunks a first token is priced by (`Admission.forced_reach_s`); a longer
# backlog is priced by the drain (arrivals due sooner overtake it). Two, measured against one
# in paired replays (docs/results.md, "First tokens priced by the forced chunk").
FORCED_REACH_CHUNKS = 2


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused now; `first_token`: its first token's objective refused it
    (waiting for the load to change cannot help), else its TPOT or an admitted request's;
    `work`: the overload rule refused it for the compute it needs (`work_refusal`), which
    serving it best effort would spend all the same."""

    message: str
    first_token: bool = False
    work: bool = False


class Admission:
    """Load averages over the iterations as they ran, and the admission decision."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        cost: ForwardCostModel | None,
        queues: Queues,
        clock: Callable[[], float],
    ):
        self.cfg, self.cost, self.queues, self.clock = cfg, cost, queues, clock
        # Tokens a decoding request has recently got per iteration (EMA; >= 1: speculation's
        # gain), for predicting the TPOT of a request admitted now (`predicted_tpot_s`).
        self.tokens_per_request = 1.0
        # Recent decode-only iterations as they ran (EMA, None before the first): wall time
        # from one start to the next (forward, drafting, host time) over what `iteration_s`
        # predicts for the forward each ran, and forward tokens per decoding request. A ratio,
        # not the period itself: the period of a batch that has since lost or gained streams
        # priced a newcomer by the old batch (after streams ended, 80-100 ms predicted where
        # iterations took 35).
        self.decode_slowdown: float | None = None
        self.forward_tokens_per_request = 1.0
        # Host seconds per iteration (EMA of IterationStats.host_s): an iteration lasts the
        # forward the cost model predicts plus this, which TPOT predictions must count.
        self.host_s = 0.0
        self._host_samples = 0
        self.busy_until: float | None = None  # end of the last iteration, while work remains
        # Prompt tokens per second the prefill backlog recently drained at (EMA over the
        # iterations that had prompts to prefill; None before the first): below the speed of
        # a prompt alone while streams' SLOs keep the chunks small.
        self.prefill_rate: float | None = None
        # The same drain as a rate: prompt tokens over backlog seconds, both decayed over
        # DRAIN_WINDOW_S (None before the first). Chunks beside streams wait for a whole tile
        # (prefill.tile_or_wait), so most iterations drain nothing and `prefill_rate`, an
        # average of per-iteration rates, falls ~0.8^40 between tiles: as a rate it priced
        # first tokens hours away. It stays what `judge` refuses by (it is low exactly while
        # the streams leave prompts no time; an honest rate there admitted more and lost at 1
        # rps, docs/results.md); a request served best effort takes only the time the
        # admitted leave, so its first token is priced by this one (`best_effort_refusal`).
        self.drain_rate: float | None = None
        self._drained_tokens = 0.0
        self._drained_s = 0.0
        # Arrivals judged in the last admission_work_window_s: (time, work seconds, key).
        self._arrivals: deque[tuple[float, float, Hashable]] = deque()
        # What the last TPOT prediction was made of (ms and counts), for the refusal's log line.
        self.last_prediction: dict[str, float] = {}

    # ------------------------------------------------------------------ predictions
    def iteration_s(
        self, tokens: int, context: int, silent: int = 0, silent_pairs: int = 0
    ) -> float:
        """Predicted wall time of an iteration whose forward runs `tokens` tokens, `silent` of
        them without logits (prompt-chunk tokens) computing `silent_pairs` query-key pairs."""
        assert self.cost is not None
        return self.cost.predict(tokens, context, silent, silent_pairs) + self.host_s

    def predicted_tpot_s(
        self,
        extra: int = 1,
        max_tokens: int | None = None,
        first_token_due: float | None = None,
        prompts_yield: bool = False,
        over_life: bool = True,
        extra_context: int = 0,
    ) -> float | None:
        """Seconds per output token a request admitted now (with `extra` - 1 more after it)
        would see once it decodes, over
        the tokens per request iterations have recently emitted. The iteration: the cost
        model's time of a decode iteration over everyone here plus it (at most max_num_seqs,
        one token each), or, while requests decode, that batch with the recent forward tokens
        per request, times how much longer recent decode-only iterations took than predicted
        for the batches they ran, if longer (it has what the cost of one token each misses:
        tree tokens, drafting, host time).
        Speculation is priced both ways, the recent trees (scaled to the batch, over the
        tokens per request they yielded) and plain decoding (one token each), and the faster
        counts: control drops trees that do not pay, and ~4-token trees over long contexts
        had priced a newcomer at seconds per token.
        Prompt tokens a TTFT objective forces into the forward slow the iterations until the
        prompts being prefilled are in: only those due after this request's first token
        (`first_token_due`, a time on `clock`) slow its stream, and a request that names
        `max_tokens` pays that slowdown over its whole life (a time per output token is its
        mean), so it is spread over the iterations it will decode (`forced_share`). With
        `prompts_yield`, those prompts yield to it (`refusal`) and slow nothing.
        Requests served best effort do not count: their rows sit out first and their
        prompts go last. Every other row counts, also those row deferral (`pacing.py`) would
        let sit out: priced
        at the rows its streams could give away, the tight streams admitted into that time
        left the prompts little, and the 0.5-rps replay met 79-81% of SLOs against 87.5%
        (docs/results.md, "Streams ahead of their pace").
        `extra_context`: the tokens the newcomers' rows attend (their prompts): every key is
        priced in every forward it is in (on ggml ~12 ms an iteration for 1,000 of them,
        docs/results.md), and a 976-token prompt priced as a row with no keys was admitted
        beside 60-ms streams that its keys then pushed past their SLO.
        With `over_life` and `max_tokens`, the batch is the one it will decode in, on average
        over its life: the requests here end (at most their `max_tokens`), so a request
        admitted beside streams with a few tokens left is priced by the batch after them
        (`life_factor`). None without a cost model (nothing to predict from)."""
        if self.cost is None:
            return None
        running, prefilling, waiting = ([r for r in q if not r.best_effort] for q in self.queues())
        reqs = [*running, *prefilling, *waiting]
        n = min(len(reqs) + extra, self.cfg.max_num_seqs)
        context = sum(r.num_tokens for r in reqs[:n]) + extra_context
        iteration = self.iteration_s(n, context)
        if self.cfg.chunked_prefill and prefilling:
            # Prompt tokens that ride along whatever the SLOs allow (a TTFT objective's due)
            # slow every stream, this one included.
            forced = forced_chunk(
                self.iteration_s,
                prefilling,
                n,
                context,
                self.clock(),
                self.cfg.max_prefill_chunk,
                0,  # a late prompt's minimum chunk passes with it: not what a stream will see
            )
            if forced and not (prompts_yield and first_token_due is not None):
                # The chunks run ever deeper into their prompts over the stream's life (each
                # chunk token attends every key before it): priced where the queue's head
                # stands now, two 22 ms streams let in beside a 1,124-token document just
                # begun then ran at 58-70 ms behind its 16-token chunks 1,000 tokens in.
                pairs = forced * mean_depth(prefilling) + forced * (forced + 1) // 2
                slowed = self.iteration_s(n + forced, context, forced, pairs)
                share = forced_share(
                    prefilling, forced, max_tokens, self.tokens_per_request, first_token_due
                )
                iteration += share * max(0.0, slowed - iteration)
        speculating = plain = iteration
        slowdown = self.decode_slowdown
        if running and slowdown is not None:
            after = self.iteration_s(max(1, round(self.forward_tokens_per_request * n)), context)
            speculating = max(iteration, slowdown * after)
            # The same with every request decoding one token (no tree nodes).
            plain = max(iteration, slowdown * self.iteration_s(n, context))
        # Control verifies trees only while they yield more tokens per second than plain
        # decoding (`SpeculationController.prune`: k = 0 is always a candidate), so a stream
        # admitted now is never slower than plain decoding of the batch would make it.
        self.last_prediction = {
            "rows": n,
            "running": len(running),
            "context": context,
            "iteration_ms": 1000.0 * iteration,
            "speculating_ms": 1000.0 * speculating,
            "plain_ms": 1000.0 * plain,
            "tokens_per_request": self.tokens_per_request,
            "decode_slowdown": self.decode_slowdown or 0.0,
            "forward_tokens_per_request": self.forward_tokens_per_request,
            "host_ms": 1000.0 * self.host_s,
        }
        tpot = min(speculating / self.tokens_per_request, plain)
        if over_life and max_tokens is not None:
            life = max_tokens / max(self.tokens_per_request, 1.0)
            factor = self.life_factor(life, extra, life, extra_context)
            self.last_prediction["life_factor"] = factor
            tpot *= factor
        return tpot

    def life_factor(
        self, horizon: float, extra: int, extra_until: float, extra_context: int = 0
    ) -> float:
        """The mean predicted iteration over the next `horizon` decode iterations, as the
        requests here end (`iterations_left`: each at most its `max_tokens`) with `extra` more
        rows (attending `extra_context` tokens) until `extra_until`, over the iteration of
        everyone now (<= 1). Requests served best effort do not count (their rows sit out
        first)."""
        return self.life_curve(extra, extra_until, extra_context)(horizon)

    def life_curve(
        self, extra: int, extra_until: float, extra_context: int = 0
    ) -> Callable[[float], float]:
        """`life_factor` for any horizon, from one pass over the batch's segments."""
        assert self.cost is not None
        reqs = [r for q in self.queues() for r in q if not r.best_effort]
        cap = self.cfg.max_num_seqs
        now = self.iteration_s(
            min(len(reqs) + extra, cap),
            sum(r.num_tokens for r in reqs[: max(0, cap - extra)]) + extra_context,
        )
        ends = [(iterations_left(r, self.tokens_per_request), r.num_tokens) for r in reqs]
        starts: list[float] = []
        times: list[float] = []  # predicted seconds of each segment's iterations
        totals: list[float] = []  # their sum up to each segment's start
        total = 0.0
        segments = batch_over_time(ends, extra, extra_until, cap, extra_context)
        for start, stop, rows, context in segments:
            t = self.iteration_s(rows, context)
            starts.append(start)
            times.append(t)
            totals.append(total)
            if math.isinf(stop):
                break
            total += (stop - start) * t

        def factor(horizon: float) -> float:
            if horizon <= 0 or now <= 0 or not starts:
                return 1.0
            i = bisect.bisect_left(starts, horizon) - 1  # the segment the horizon ends in
            if i < 0:
                return 1.0
            mean = (totals[i] + (horizon - starts[i]) * times[i]) / horizon
            return min(1.0, mean / now)

        return factor

    def ttft_objective_ms(self, prompt_tokens: int, slo_ttft_ms: float | None) -> float | None:
        """A request's TTFT objective: its slo_ttft_ms, else the default from the time its
        prompt takes to prefill alone here (`slo.ttft_objective_ms`); None without a cost
        model."""
        if slo_ttft_ms is not None:
            return slo_ttft_ms
        if self.cost is None:
            return None
        n = prompt_tokens
        alone_s = self.cost.predict(n, 0, n, n * (n + 1) // 2)
        return ttft_objective_ms(
            1000.0 * alone_s, self.cfg.default_ttft_factor, self.cfg.default_ttft_floor_ms
        )

    def predicted_ttft_s(
        self, prompt_tokens: int, objective_s: float, drained: float | None = None
    ) -> float | None:
        """Seconds until the first token of a request with this prompt admitted now, whose
        first token is due in `objective_s`: the prompts prefilled before it (earlier TTFT
        deadlines, as `prefill.prefill_order` takes them) and its own, at the slower of the
        speed of prompts alone and the rate the backlog recently drained (`drained`, default
        `prefill_rate`); or, when a forced chunk or two take those tokens (`forced_reach_s`),
        the forwards that prefill them, whichever is sooner. None without a cost model."""
        if self.cost is None:
            return None
        running, prefilling, waiting = self.queues()
        due = self.clock() + objective_s + OVERTAKE_S
        ahead = sum(
            prefill_target(r) - r.num_cached
            for r in (*prefilling, *waiting)
            if prefill_deadline(r) <= due
        )
        n = prompt_tokens
        alone_rate = n / max(self.cost.predict(n, 0, n, n * (n + 1) // 2), 1e-9)
        rate = alone_rate
        drained = self.prefill_rate if drained is None else drained
        if drained is not None and (running or prefilling or waiting):
            rate = min(rate, drained)
        by_rate = (ahead + n) / rate + self.host_s
        forced = self.forced_reach_s(ahead + n, running)
        return by_rate if forced is None else min(by_rate, forced)

    def forced_reach_s(self, tokens: int, running: Sequence[Request]) -> float | None:
        """Seconds until `tokens` prompt tokens due first are prefilled when at most
        FORCED_REACH_CHUNKS forwards take them (chunks of the scheduler's cap:
        max_prefill_chunk beside streams, max_num_batched_tokens alone), None when they need
        more: the iteration under way, then those forwards, each of the streams' rows and a
        chunk. The scheduler forces what a reachable TTFT objective needs whatever the
        streams' slack (`prefill.forced_chunk`), so such a prompt does not wait on the rate
        the backlog drained, which is near zero while the streams leave prompts no slack
        (`prefill_rate`): by that rate, questions of 19-144 tokens with 1.3-3.1 s objectives
        were refused in replays where another server of the same round, which had admitted
        the same questions, gave them their first tokens in 0.3-1.3 s. A longer backlog
        keeps the rate: long prompts admitted by what forced chunks could do were overtaken
        by arrivals due sooner and missed (docs/results.md, "Tried and reverted: the
        first-token drain rate as tokens over seconds")."""
        assert self.cost is not None
        cap = self.cfg.max_prefill_chunk if running else self.cfg.max_num_batched_tokens
        chunks = -(-tokens // cap)
        if tokens <= 0 or chunks > FORCED_REACH_CHUNKS:
            return None
        rows = len(running)
        context = sum(r.num_tokens for r in running)
        seconds = self.iteration_s(rows, context) if rows else 0.0  # the iteration under way
        done = 0
        for _ in range(chunks):
            c = min(cap, tokens - done)
            pairs = c * done + c * (c + 1) // 2
            seconds += self.iteration_s(rows + c, context + done, c, pairs)
            done += c
        return seconds

    def work_s(self, prompt_tokens: int, max_tokens: int | None) -> float | None:
        """Seconds of compute a request needs: its prompt prefilled alone, plus max_tokens
        (0 when unknown) at the marginal cost of one more decode row beside the running ones,
        over the tokens per request iterations recently emitted. None without a cost model."""
        if self.cost is None:
            return None
        n, m = prompt_tokens, max_tokens or 0
        work = self.cost.predict(n, 0, n, n * (n + 1) // 2)
        if m:
            running, _, _ = self.queues()
            rows = len(running)
            context = sum(r.num_tokens for r in running)
            row_s = self.cost.predict(rows + 1, context + n + m // 2)
            if rows:
                row_s -= self.cost.predict(rows, context)
            work += m * max(row_s, 0.0) / max(self.tokens_per_request, 1.0)
        return work

    def work_limit_s(self, now: float) -> float | None:
        """The most work an arrival may need now (`work_refusal`), None for no limit: the
        window's arrivals taken cheapest first until they fill admission_work_share of the
        window's seconds; the last that fits sets it. None when they all fit, or when not
        even the cheapest does (nothing cheaper to serve instead: one prompt larger than the
        budget, alone in the window, is served)."""
        budget = self.cfg.admission_work_share * self.cfg.admission_work_window_s
        total = 0.0
        limit = None
        for work in sorted(w for _, w, _ in self._arrivals):
            total += work
            if total > budget:
                return limit
            limit = work
        return None

    def work_refusal(
        self, work: float, prompt_tokens: int, max_tokens: int | None
    ) -> Refusal | None:
        """Under overload (the window's arrivals need more than admission_work_share of its
        seconds), one whose work is above `work_limit_s` is refused: each request counts one
        SLO, and the compute of one long prompt serves several short requests
        (docs/scheduling.md, "Work"). The arrivals' work says so as they come; waiting for a
        refusal for an SLO (the rule before) let long prompts in with their promise at the
        start of an overload, and the arrivals behind them were refused. A server with nothing
        to do is not overloaded, whatever a request declares it may need (a `max_tokens` of
        2^70 is valid): it serves the request."""
        if not any(self.queues()):
            return None
        now = self.clock()
        limit = self.work_limit_s(now)
        if limit is None or work <= limit:
            return None
        tokens = f"{prompt_tokens}-token prompt" + (
            f" and {max_tokens} tokens" if max_tokens else ""
        )
        return Refusal(
            f"the server is overloaded and serves the requests that need the least compute "
            f"first: this one needs about {work:.1f} s (its {tokens}), over the {limit:.1f} s "
            f"the load allows now; retry later or send a shorter prompt",
            first_token=True,
            work=True,
        )

    def _note_arrival(self, work: float, key: Hashable) -> float:
        """Record an arrival's work; one judged again (same `key`) keeps the work it was
        recorded with, which is returned (its rows' marginal cost moves with the batch)."""
        now = self.clock()
        window = self.cfg.admission_work_window_s
        while self._arrivals and now - self._arrivals[0][0] > window:
            self._arrivals.popleft()
        if key is not None:
            for _, seen, k in self._arrivals:
                if k == key:
                    return seen
        self._arrivals.append((now, work, key))
        return work

    def refusal(
        self,
        slo_tpot_ms: float | None,
        prompt_tokens: int | None = None,
        slo_ttft_ms: float | None = None,
        max_tokens: int | None = None,
    ) -> str | None:
        """`judge`'s message: why this request should be refused now, or None to admit it."""
        why = self.judge(slo_tpot_ms, prompt_tokens, slo_ttft_ms, max_tokens)
        return None if why is None else why.message

    def hold_s(
        self, slo_tpot_ms: float | None, prompt_tokens: int, slo_ttft_ms: float | None
    ) -> float:
        """Seconds a request refused for its TPOT may be held, waiting for the load to allow
        it: `admission_hold` of its TTFT objective; 0 without one, or when its SLO could not
        be met even alone (no load that ends can make room for it)."""
        objective_ms = self.ttft_objective_ms(prompt_tokens, slo_ttft_ms)
        if objective_ms is None or self.cost is None:
            return 0.0
        alone_s = self.iteration_s(1, prompt_tokens) / self.tokens_per_request
        if slo_tpot_ms is not None and 1000.0 * alone_s > self.cfg.slo_headroom * slo_tpot_ms:
            return 0.0
        return self.cfg.admission_hold * objective_ms / 1000.0

    def best_effort_refusal(
        self,
        slo_tpot_ms: float | None,
        prompt_tokens: int,
        slo_ttft_ms: float | None,
        waited_s: float = 0.0,
        cached_tokens: int = 0,
    ) -> str | None:
        """Why a request admission refuses (`judge`: for its TPOT once its hold is over
        (`hold_s`) or for its first token; not one refused for its work, `Refusal.work`) cannot
        be served best effort instead;
        None when it can: while fewer than `admission_best_effort` requests are served so, when
        its SLO could be met alone (one no load can meet is refused: retrying will not help,
        relaxing it will), and when its first token, its prompt prefilled after every other
        at the rate the backlog recently drained (`drain_rate`), is predicted within
        `admission_best_effort_wait` x its TTFT objective (later, it would be queued). Its
        row sits out before any stream's (`pacing.deferred_rows`) and its prompt takes only
        the time the streams' paces leave (prefill.py), so the SLOs admitted keep what they
        were admitted with; it gets the time they leave, and its output counts (a 429 serves
        none of it)."""
        cap = self.cfg.admission_best_effort
        if cap <= 0 or self.cost is None:
            return "best effort is off"
        running, prefilling, waiting = self.queues()
        if sum(r.best_effort for r in (*running, *prefilling, *waiting)) >= cap:
            return f"--admission-best-effort {cap}: as many are served best effort already"
        alone_s = self.iteration_s(1, prompt_tokens) / self.tokens_per_request
        if slo_tpot_ms is not None and 1000.0 * alone_s > self.cfg.slo_headroom * slo_tpot_ms:
            return f"its SLO cannot be met even alone ({1000.0 * alone_s:.0f} ms)"
        objective_ms = self.ttft_objective_ms(prompt_tokens, slo_ttft_ms)
        if objective_ms is None:
            return None
        ttft = self.predicted_ttft_s(prompt_tokens - cached_tokens, math.inf, self.drain_rate)
        limit_s = self.cfg.admission_best_effort_wait * objective_ms / 1000.0
        if ttft is not None and waited_s + ttft > limit_s:
            return f"its first token would come after {waited_s + ttft:.1f} s (limit {limit_s:.1f})"
        return None

    def judge(
        self,
        slo_tpot_ms: float | None,
        prompt_tokens: int | None = None,
        slo_ttft_ms: float | None = None,
        max_tokens: int | None = None,
        waited_s: float = 0.0,
        key: Hashable = None,
        cached_tokens: int = 0,
    ) -> Refusal | None:
        """Why a request with this TPOT SLO (and prompt) should be refused now, or None to
        admit it; `waited_s`: how long ago it arrived (a held request's first token is due
        that much sooner); `cached_tokens`: how many of its prompt's the prefix cache holds
        (its work and its first token are priced without them, its TTFT objective is not).

        Refused when the predicted TPOT with it admitted (over its life, `life_factor`)
        exceeds `slo_headroom` of its own SLO, or when an admitted request would see over
        `slo_headroom` of its SLO over the iterations it has left: a lenient request that
        would push the others past theirs is refused too, so admitted requests keep their
        SLOs. Given its prompt's length, also refused when its first token would come
        after `slo_headroom` of its TTFT objective (slo_ttft_ms, else the default one): queued
        for tens of seconds it is lost to its user whatever its TPOT, and its prefill would be
        paid by the requests behind it. The same headroom as for TPOT: both predictions miss
        what arrives after them (a prompt due sooner overtakes this one). The TPOT prediction
        counts only the prompts due after this request's first token, over its life when it
        names `max_tokens` (`predicted_tpot_s`). When those prompts' forced chunks are all
        that refuses it (`prompts_yield`, the default), it is admitted over them: they yield
        (`Request.prefill_yields`) and ride in the streams' slack until they starve
        (`prefill.starving`), trading a first token that is far off, and may still come in
        time, for a stream that would otherwise be turned away; the streams admitted while
        they yield are let in the same way. Under overload, one that needs more compute than
        the load allows is refused too (`work_refusal`); `key` names the request so that one
        judged again (held) is one arrival."""
        work = None
        if prompt_tokens is not None and self.cfg.admission_work_share > 0:
            work = self.work_s(prompt_tokens - cached_tokens, max_tokens)
            if work is not None:
                work = self._note_arrival(work, key)
                if (why := self.work_refusal(work, prompt_tokens, max_tokens)) is not None:
                    return why
        return self._judge(
            slo_tpot_ms, prompt_tokens, slo_ttft_ms, max_tokens, waited_s, cached_tokens
        )

    def _judge(
        self,
        slo_tpot_ms: float | None,
        prompt_tokens: int | None,
        slo_ttft_ms: float | None,
        max_tokens: int | None,
        waited_s: float,
        cached_tokens: int = 0,
    ) -> Refusal | None:
        objective_ms = None
        if prompt_tokens is not None:
            objective_ms = self.ttft_objective_ms(prompt_tokens, slo_ttft_ms)
        left_s = None if objective_ms is None else objective_ms / 1000.0 - waited_s
        due = None if left_s is None else self.clock() + left_s
        keys = prompt_tokens or 0  # the newcomer's row attends its prompt in every forward
        why = self._tpot_refusal(slo_tpot_ms, max_tokens, due, keys=keys)
        over: list[Request] = []
        if why is not None and due is not None and self.cfg.prompts_yield:
            # What the prompts behind it force into every forward is all that stands in its
            # way: let it in over them, and they ride in the streams' slack from now on.
            _, prefilling, _ = self.queues()
            over = [r for r in behind(prefilling, due) if not r.prefill_yields]
            if over and self._tpot_refusal(slo_tpot_ms, max_tokens, due, True, keys) is None:
                why = None
            else:
                over = []
        if why is not None:
            return Refusal(why)
        if objective_ms is None or left_s is None or prompt_tokens is None:
            return None
        ttft = self.predicted_ttft_s(prompt_tokens - cached_tokens, left_s)
        limit_s = self.cfg.slo_headroom * objective_ms / 1000.0
        if ttft is not None and waited_s + ttft > limit_s:
            named = "slo_ttft_ms" if slo_ttft_ms is not None else "the default for its prompt"
            objective = (
                f"this request's time-to-first-token objective of "
                f"{objective_ms / 1000.0:.1f} s ({named})"
            )
            # Refused by `prefill_rate`, which is low while the streams leave prompts no
            # time; the seconds the message names are those at the rate prompts really
            # drained (`drain_rate`), where the average would name hours.
            real = self.predicted_ttft_s(prompt_tokens - cached_tokens, left_s, self.drain_rate)
            if real is not None and waited_s + real > limit_s:
                message = (
                    f"the first token would come after about {waited_s + real:.1f} s at the "
                    f"current load, past {objective}; retry later"
                )
            else:
                message = (
                    f"the first token would not come within {objective}: the requests being "
                    f"served have left prompts almost no time lately; retry later"
                )
            return Refusal(message, first_token=True)
        for r in over:
            r.prefill_yields = True
        return None

    def _tpot_refusal(
        self,
        slo_tpot_ms: float | None,
        max_tokens: int | None,
        first_token_due: float | None,
        prompts_yield: bool = False,
        keys: int = 0,
    ) -> str | None:
        """Why the newcomer's TPOT, or an admitted request's, would be past its SLO; `keys`:
        the tokens the newcomer's row attends (its prompt), priced in every batch it is in."""
        tpot = self.predicted_tpot_s(
            max_tokens=max_tokens,
            first_token_due=first_token_due,
            prompts_yield=prompts_yield,
            over_life=False,
            extra_context=keys,
        )
        if tpot is None:
            return None
        # The batch of now, then each request priced over the iterations it will decode in
        # (`life_factor`): the newcomer over its max_tokens, each admitted request over what
        # it has left, as the others end.
        ms_now = 1000.0 * tpot
        life = math.inf
        ms = ms_now
        if max_tokens is not None:
            life = max_tokens / max(self.tokens_per_request, 1.0)
            ms = ms_now * self.life_factor(life, 1, life, keys)
        headroom = self.cfg.slo_headroom
        if slo_tpot_ms is not None and ms > headroom * slo_tpot_ms:
            return (
                f"slo_tpot_ms {slo_tpot_ms:g} cannot be met at the current load (about "
                f"{ms:.0f} ms per token predicted); retry later or relax slo_tpot_ms"
            )
        running, prefilling, waiting = self.queues()
        curve = None
        for r in sorted(
            (r for r in (*running, *prefilling, *waiting) if r.paced_slo_tpot_ms is not None),
            key=lambda r: r.paced_slo_tpot_ms or 0.0,
        ):
            held = r.paced_slo_tpot_ms
            assert held is not None
            if ms_now <= headroom * held:
                break  # the batch of now already fits it and every looser one
            left = iterations_left(r, self.tokens_per_request)
            if left <= 1.0:
                continue  # its last token comes before the newcomer's row joins
            curve = curve or self.life_curve(1, life, keys)
            theirs = ms_now * curve(left)
            if theirs > headroom * held:
                return (
                    f"admitting this request would slow the requests being served past their "
                    f"slo_tpot_ms {held:g} (about {theirs:.0f} ms per token predicted); "
                    f"retry later"
                )
        return None

    # ------------------------------------------------------------------ observations
    def gap_s(self, now: float) -> float | None:
        """Seconds since the previous iteration ended (None: the engine was idle)."""
        return None if self.busy_until is None else now - self.busy_until

    def observe(
        self,
        stats: IterationStats,
        gap_s: float | None,
        num_decoding: int,
        context: int | None = None,
    ) -> None:
        """Fold a finished iteration into the averages (sets its `host_s`); `context`: the
        cached tokens its forward attended (None: unknown, no slowdown sample)."""
        a = self.cfg.admission_ema
        if gap_s is not None:
            stats.host_s = max(0.0, gap_s + stats.total_s - stats.forward_s - stats.draft_s)
            rate = max(self.cfg.host_ema, 1.0 / (self._host_samples + 1))  # the mean at first
            self.host_s += rate * (stats.host_s - self.host_s)
            self._host_samples += 1
        _, prefilling, _ = self.queues()
        # A prompt served best effort waits for time no pace needs: no backlog of the load's.
        backlog = any(not r.best_effort for r in prefilling)
        if gap_s is not None and (stats.prefill_tokens or backlog):
            # A backlog was there for this whole period: how fast it drained (counted while
            # a best-effort prompt waited, the rate fell toward 0 and arrivals were refused
            # for first tokens predicted tens of seconds away).
            period = stats.total_s + gap_s
            rate = stats.prefill_tokens / max(period, 1e-9)
            last = self.prefill_rate
            self.prefill_rate = rate if last is None else last + a * (rate - last)
            keep = math.exp(-period / DRAIN_WINDOW_S)
            self._drained_tokens = keep * self._drained_tokens + stats.prefill_tokens
            self._drained_s = keep * self._drained_s + period
            self.drain_rate = self._drained_tokens / max(self._drained_s, 1e-9)
        if not num_decoding:
            return
        per = (stats.emitted_tokens - stats.prefill_requests) / num_decoding
        self.tokens_per_request += self.cfg.tokens_per_request_ema * (
            max(per, 1.0) - self.tokens_per_request
        )
        if gap_s is not None and not stats.prefill_tokens:
            # Busy since the last iteration (a true period) and decode only: prompt chunks
            # ride in the time the running SLOs leave (prefill.py), so a period stretched by
            # one is what a prompt borrows, not what a newly admitted stream will see; counted,
            # one long prompt made the server refuse at a tenth of its capacity.
            period = stats.total_s + gap_s
            forward = stats.padded_tokens or stats.num_tokens
            predicted = 0.0
            if self.cost is not None and context is not None:
                predicted = self.iteration_s(forward, context)
            if predicted > 0:
                ratio = period / predicted
                last = self.decode_slowdown
                self.decode_slowdown = ratio if last is None else last + a * (ratio - last)
            tokens = stats.num_tokens / num_decoding
            self.forward_tokens_per_request += a * (tokens - self.forward_tokens_per_request)
