"""Chunked prefill: how many prompt tokens ride along with this iteration's decode forward.

A TPOT SLO is a promise about every gap between tokens, so a prompt is prefilled in chunks
that travel in the same forward as the running requests' verification trees, each chunk as
large as the running requests' SLOs allow (docs/scheduling.md has the rule with examples):

    expected tokens of running request r this iteration:  e_r = 1 + sum of its nodes' f(v)
    pace_r  = (1 - margin) * slo_r    (a little under the SLO: forwards vary around their
                                       prediction)
    bank_r  = pace_r * o_r - l_r      (time ahead of its pace, negative when behind; o_r
                                       tokens after the first in l_r seconds since it)
    time r may spend on this iteration:
        allow_r = max(T(n_tree, ctx), pace_r * e_r + clamp(bank_r, -repay * pace_r * e_r, pace_r))
    T_max   = min of allow_r over running requests with an SLO that the decode part alone
              can still meet (pace_r * e_r + min(max(bank_r, 0), pace_r) >= T(n_tree, ctx);
              a TPOT already lost does not hold prompts back)      (none: no TPOT limit),
              and at most prefill_iteration_ms (500), idle or not: a prompt arriving now
              waits for this whole iteration, and a short one's TTFT objective is ~1 s
    chunk   = largest c <= cap with T(n_tree + c, ctx + p, c, c p + c (c + 1) / 2) <= T_max
              (T(n, c, s, q): the cost model; the c prompt tokens, p tokens into their
              prompt, are silent: no logits, and they attend c p + c (c + 1) / 2 keys)
    cap     = max_prefill_chunk while anything decodes (requests without an SLO tolerate that
              much), max_num_batched_tokens when nothing does
    chunk   = max(chunk, c_ttft) while some prompt's TTFT objective can be met (below),
              else max(chunk, min_prefill_chunk)                   (prefill never starves)
    chunk   = a whole attention tile, or only the forced part, when streams decode and the
              chunk falls short of the runner's tile (`tile_or_wait`); raised to the tile
              when nothing decodes (`tiled_chunk`)

with allow_r's bank term clamped to [-repay * pace_r * e_r, max(pace_r, spend * bank_r)]
(margin = slo_pace_margin 5%, repay = slo_repay 0.5, spend = slo_bank_spend 0.5 in
SchedulerConfig): a request spends one extra pace of banked time on a gap, or a share of a
larger bank (TPOT is a mean over the stream: a stream far ahead of its pace affords one long
gap that finishes a prompt in one go, and big chunks prefill faster per token than many
small ones), and a request behind its pace takes time back from the prompts until it has
caught up: a deficit is repaid, not carried to the end of the stream.

TTFT deadlines weigh in (`Request.ttft_objective_ms`: slo_ttft_ms, or the default objective
from the prompt length that every request gets, `slo.ttft_objective_ms`): for each prefilling
request with one, the smallest chunk that still finishes its prompt and the prompts ahead of
it in the queue in time, ceil(R / c) * T(n_tree + c, ...) <= deadline - now; the largest of
these, c_ttft, raises the chunk (capped). A deadline no chunk can meet any more forces nothing
(a first token already late does not outrank TPOTs), but its tokens still count as ahead of
the prompts behind it, whose deadlines do; with no deadline left to meet, the minimum chunk
keeps the queue moving. A prompt that
yields to streams admission let in over it (`Request.prefill_yields`) forces nothing: it
rides in the streams' slack until it has waited STARVE_FACTOR (2) x its objective, then
forces as any other. A prompt served best effort (`Request.best_effort`) forces nothing,
ever, goes after every prompt with a deadline, and takes none of the time sized for them;
at the head of the queue it gets no banked time and no stream is left out as lost: T_max
over every stream of max(T(n_tree, ctx), pace_r * e_r + clamp(bank_r, -repay * pace_r * e_r,
0)), only the time left at every stream's pace.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from adaserve.config import SchedulerConfig
from adaserve.request_manager.request import Request

# Predicted seconds of a forward of (tokens, context tokens, silent tokens, keys the silent
# ones attend): silent tokens return no logits, as prompt-chunk tokens do not.
CostFn = Callable[[int, int, int, int], float]


def chunk_cost(cost: CostFn, tree_tokens: int, context: int, cached: int, c: int) -> float:
    """A forward of the decode part and a c-token chunk of a prompt `cached` tokens in."""
    return cost(tree_tokens + c, context + cached, c, c * cached + c * (c + 1) // 2)


def prefill_target(req: Request) -> int:
    """KV entries a request needs before it decodes: every token, but a resumed request's
    last token (its next root) is fed by the decode step instead."""
    return req.num_tokens - 1 if req.output_token_ids else req.num_tokens


# A prompt overtakes an earlier one only when its TTFT deadline is this much sooner: near-equal
# deadlines keep arrival order (reordering them buys nothing and changes batch layouts).
OVERTAKE_S = 0.25


def prefill_deadline(req: Request) -> float:
    """When a prefilling request's first token is due: -inf for a preempted stream's
    recomputation (its user is already reading), +inf without a TTFT objective or served best
    effort (its prompt goes after every prompt with a deadline)."""
    if req.output_token_ids:
        return -math.inf
    if req.ttft_objective_ms is None or req.best_effort:
        return math.inf
    return req.metrics.arrival_time + req.ttft_objective_ms / 1000.0


def prefill_order(prefilling: Sequence[Request]) -> list[Request]:
    """The prefilling queue, earliest TTFT deadline first: in arrival order, each prompt moves
    ahead of the earlier ones whose deadline is more than OVERTAKE_S later (a 14-token
    question does not wait 4 s behind a 900-token document whose objective is 18 s away; the
    default objective grows with the prompt, so a long one still goes once its deadline is
    the nearest).

    A passed deadline keeps its place: sending late prompts to the back (tried first) starved
    short questions that missed their 1.3 s objective by one long chunk behind every later
    document, 13 s instead of 3.6 s."""
    order: list[Request] = []
    for r in sorted(prefilling, key=lambda q: q.metrics.arrival_time):
        due, i = prefill_deadline(r), len(order)
        while i > 0 and prefill_deadline(order[i - 1]) > due + OVERTAKE_S:
            i -= 1
        order.insert(i, r)
    return order


def tpot_time_limit(
    running: Sequence[Request],
    expected_tokens: Sequence[float],
    now: float,
    floor_s: float = 0.0,
    margin: float = SchedulerConfig.slo_pace_margin,
    repay: float = SchedulerConfig.slo_repay,
    spend: float = SchedulerConfig.slo_bank_spend,
    banked: bool = True,
    future: float = SchedulerConfig.slo_future_lend,
) -> float | None:
    """T_max: the longest iteration every running request with an SLO can afford (seconds).

    Requests that cannot afford even `floor_s` (the decode part alone) are left out. Without
    `banked` (what best effort gets), no stream lends banked time and none is left out: only
    the time left at every stream's pace, a stream behind its pace repaying first. With
    `future` > 0 (and banked), a stream's bank also counts that share of the slack its
    remaining tokens leave at its pace when each costs what this iteration's decode part
    costs it (`future_slack`).
    """
    limit = None
    for r, e in zip(running, expected_tokens):
        slo_ms, first = r.paced_slo_tpot_ms, r.metrics.first_token_time
        if slo_ms is None or first is None:
            continue
        pace = (1.0 - margin) * slo_ms / 1000.0
        bank = pace * (len(r.output_token_ids) - 1) - (now - first)
        due = pace * e  # this iteration's share at its pace
        if banked and due + min(max(bank, 0.0), pace) < floor_s:
            continue  # lost even without prefill: it does not hold prompts back
        if banked and future > 0.0:
            bank += future * future_slack(r, e, pace, floor_s)
        if banked:
            # Banked time is spent on prompts: one pace, or a share of a larger bank (TPOT is
            # the stream's mean: a stream well ahead affords one longer gap that finishes a
            # prompt).
            allow = max(floor_s, due + min(max(bank, -repay * due), max(pace, spend * bank)))
        else:
            allow = max(floor_s, due + max(min(bank, 0.0), -repay * due))
        limit = allow if limit is None else min(limit, allow)
    return limit


def future_slack(req: Request, expected_tokens: float, pace_s: float, floor_s: float) -> float:
    """Seconds the tokens `req` has left after this iteration's leave at its pace, each
    costing what this iteration's decode part costs it (floor_s / expected_tokens): time it
    would bank later, lent now. EOS may end the stream sooner; max_tokens bounds it."""
    left = req.params.max_tokens - len(req.output_token_ids) - expected_tokens
    if left <= 0 or expected_tokens <= 0:
        return 0.0
    return left * max(0.0, pace_s - floor_s / expected_tokens)


def pace_allowance(
    req: Request,
    expected_tokens: float,
    margin: float = SchedulerConfig.slo_pace_margin,
) -> float | None:
    """The longest iteration that keeps `req` within its pace at the tokens it expects from
    it: (1 - margin) * slo_r * e_r, seconds; None without a paced SLO (best effort) or before
    its first token. No bank is lent and no deficit repaid here: this bounds only what a
    forward past B may add (`controller.prune`)."""
    slo_ms = req.paced_slo_tpot_ms
    if slo_ms is None or req.metrics.first_token_time is None:
        return None
    return (1.0 - margin) * slo_ms / 1000.0 * expected_tokens


def largest_chunk(
    cost: CostFn, tree_tokens: int, context: int, limit_s: float, cap: int, cached: int = 0
) -> int:
    """Largest c in [0, cap] with chunk_cost(..., c) <= limit_s (0 if none)."""
    if cap <= 0 or chunk_cost(cost, tree_tokens, context, cached, 1) > limit_s:
        return 0
    lo, hi = 1, cap  # cost(lo) fits; find the last c that fits (cost grows with c)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if chunk_cost(cost, tree_tokens, context, cached, mid) <= limit_s:
            lo = mid
        else:
            hi = mid - 1
    return lo


def ttft_chunk(
    cost: CostFn,
    tree_tokens: int,
    context: int,
    remaining: int,
    time_left_s: float,
    cap: int,
    cached: int = 0,
) -> int | None:
    """Smallest chunk that finishes `remaining` prompt tokens within `time_left_s`, or None
    (each chunk priced as the next one, `cached` tokens into its prompt)."""

    def in_time(c: int) -> bool:
        each = chunk_cost(cost, tree_tokens, context, cached, c)
        return math.ceil(remaining / c) * each <= time_left_s

    hi = min(cap, remaining)  # a chunk larger than what is left buys nothing
    if hi <= 0 or time_left_s <= 0 or not in_time(hi):
        return None
    lo = 1  # in_time(hi) holds; fewer tokens per chunk means more iterations
    while lo < hi:
        mid = (lo + hi) // 2
        if in_time(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def forced_chunk(
    cost: CostFn,
    prefilling: Sequence[Request],
    tree_tokens: int,
    context: int,
    now: float,
    cap: int,
    min_prefill_chunk: int,
) -> int:
    """Prompt tokens the next forward takes whatever the streams' SLOs allow: what every TTFT
    objective that can still be met needs (each prompt's with the prompts ahead of it), else
    min_prefill_chunk; 0 with nothing to prefill. A prompt that yields to streams
    admitted over it (`Request.prefill_yields`) forces nothing until it starves
    (`starving`): it rides in the time the streams' SLOs leave, and 0 when every prompt
    yields."""
    pending = sum(prefill_target(r) - r.num_cached for r in prefilling)
    if pending <= 0:
        return 0
    cached = prefilling[0].num_cached  # where the next chunk starts (queue order)
    ahead = 0  # prompt tokens of requests ahead in the queue, prefilled first
    floor, due = 0, None
    for r in prefilling:
        remaining = ahead + prefill_target(r) - r.num_cached
        ahead = remaining
        if r.best_effort or (r.prefill_yields and not starving(r, now)):
            continue  # best effort never forces: it takes only time no stream's pace needs
        floor = min_prefill_chunk
        ttft_ms = r.ttft_objective_ms
        if ttft_ms is not None:
            left = r.metrics.arrival_time + ttft_ms / 1000.0 - now
            needed = ttft_chunk(cost, tree_tokens, context, remaining, left, cap, cached)
            if needed is not None:
                # The objective can still be met: it, not a fixed minimum, keeps the prompt
                # moving, so a tight stream is never made impossible by a minimum chunk.
                due = needed if due is None else max(due, needed)
            # A lost deadline forces nothing, but the prompts behind it, whose objectives
            # count its tokens as ahead of theirs, still can be met: before, one late prompt
            # at the head left the whole queue at the minimum chunk, and every prompt behind
            # it missed its first token too.
    return min(pending, floor if due is None else due)


# A yielding prompt that has waited this many times its TTFT objective (from its arrival)
# forces chunks again, whatever the streams' SLOs: it rides in their slack until then.
STARVE_FACTOR = 2.0


def starving(req: Request, now: float) -> bool:
    """The prompt has waited STARVE_FACTOR x its TTFT objective (False without one)."""
    ms = req.ttft_objective_ms
    return ms is not None and now >= req.metrics.arrival_time + STARVE_FACTOR * ms / 1000.0


def chunk_tokens(
    cost: CostFn,
    running: Sequence[Request],
    expected_tokens: Sequence[float],
    prefilling: Sequence[Request],
    tree_tokens: int,
    context: int,
    now: float,
    max_prefill_chunk: int,
    max_batched_tokens: int,
    min_prefill_chunk: int,
    margin: float = SchedulerConfig.slo_pace_margin,
    repay: float = SchedulerConfig.slo_repay,
    spend: float = SchedulerConfig.slo_bank_spend,
    iteration_cap_s: float | None = None,
    tile_tokens: int | None = None,
    future: float = SchedulerConfig.slo_future_lend,
) -> int:
    """Prompt tokens to prefill in this iteration (the rule in the module docstring);
    `tile_tokens`: the runner's `attention_tile_tokens` (`tiled_chunk`). A queue headed by a
    prompt served best effort (every prompt in it is: they go last) gets no banked time."""
    pending = sum(prefill_target(r) - r.num_cached for r in prefilling)
    if pending <= 0:
        return 0
    cap = max_prefill_chunk if running else max_batched_tokens
    floor = cost(max(tree_tokens, 1), context, 0, 0) if running else 0.0
    banked = not prefilling[0].best_effort
    limit = tpot_time_limit(
        running, expected_tokens, now, floor, margin, repay, spend, banked, future
    )
    if iteration_cap_s:
        # A prompt arriving now waits for this whole iteration: never longer than the cap
        # (a TTFT objective's forced chunk below still may be).
        limit = iteration_cap_s if limit is None else min(limit, iteration_cap_s)
    cached = prefilling[0].num_cached  # where the next chunk starts (queue order)
    chunk = cap if limit is None else largest_chunk(cost, tree_tokens, context, limit, cap, cached)
    forced = forced_chunk(cost, prefilling, tree_tokens, context, now, cap, min_prefill_chunk)
    chunk = max(chunk, forced)
    if not running:
        chunk = tiled_chunk(chunk, tree_tokens, cap, tile_tokens)
    elif tile_tokens is not None and 0 < chunk < tile_tokens <= cap:
        head_left = prefill_target(prefilling[0]) - cached
        if head_left >= tile_tokens:
            chunk = tile_or_wait(
                cost, tree_tokens, context, cached, chunk, forced, tile_tokens, limit
            )
    return min(pending, chunk)


def tile_or_wait(
    cost: CostFn,
    tree_tokens: int,
    context: int,
    cached: int,
    chunk: int,
    forced: int,
    tile_tokens: int,
    limit: float | None,
) -> int:
    """A chunk beside decoding streams, short of the runner's attention tile, of a prompt
    with a tile or more left: a whole tile when it fits the streams' time limit, else only
    what a TTFT objective forces (0 when nothing is). Under the tile llama.cpp's CPU
    attention walks each query row alone: 56 prompt tokens 500 tokens into a prompt took 439
    ms, 64 tokens 208 ms (7.8 against 3.3 ms a token; docs/results.md, "Prompt chunks a tile
    at a time"). A slack chunk under the tile spends the streams' banked time at twice the
    price a token; withheld, the banks grow until a tile fits (`tpot_time_limit` lends them),
    and the streams decode ahead of their pace meanwhile."""
    if limit is None or chunk_cost(cost, tree_tokens, context, cached, tile_tokens) <= limit:
        return tile_tokens
    return forced


def tiled_chunk(chunk: int, tree_tokens: int, cap: int, tile_tokens: int | None) -> int:
    """A chunk of an iteration that decodes nothing, raised so the forward takes a whole
    attention tile (`Runner.attention_tile_tokens`) when it would fall short of one: below
    the tile llama.cpp's CPU attention computes each query row on its own, and deep in a
    prompt a 63-token forward there took ~3x as long as a 64-token one (600 tokens in: 1.1 s
    against 0.34-0.41 s). No stream's SLO pays for the forward; the time limit of an idle
    iteration is only the wait of a prompt arriving meanwhile, and the larger chunk shortens
    it. `chunk` 0 (nothing fits the limit, nothing forced) stays 0."""
    if tile_tokens is None or chunk <= 0 or tree_tokens + chunk >= tile_tokens:
        return chunk
    return max(chunk, min(cap, tile_tokens - tree_tokens))
