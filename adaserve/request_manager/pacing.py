"""Row deferral: a stream far ahead of its pace sits out an iteration a tighter stream needs short.

On a machine whose decode forward is compute-bound (a CPU: one row ~6 ms, four rows ~17 ms
with ggml), every row a forward carries lengthens the gap of every stream in it. A loose
stream (a 91 ms SLO) that decodes every iteration beside a tight one (22 ms) runs far ahead of
its own pace while pushing the tight one past its SLO. Such a stream gives its row away:

    pace_r  = (1 - margin) * slo_r                  (the pace chunked prefill keeps, prefill.py)
    bank_r  = pace_r * o_r - l_r                    (time ahead of that pace: o_r tokens after
                                                     the first in l_r seconds since it)
    T(rows) = the cost model's forward of the rows (at the forward tokens a row recently
              ran: its tree) over their contexts, + host time
    limit   = min over the rows kept of allow_r     (`prefill.tpot_time_limit`: the longest
                                                     iteration each stream's pace affords; a
                                                     stream that could not afford T of its row
                                                     alone is lost to it and left out)
    while T(kept) > limit: defer the kept row with the largest bank among those with
        bank_r >= 2 * T(kept)                       (it sits out this iteration and, if it
                                                     must, the next, and is still ahead of its
                                                     pace), never the row that sets the limit

A stream served best effort (`Request.best_effort`: admission could not meet its SLO and
served it anyway) keeps no pace: it sets no limit, and its row sits out before any other, the
latest admitted first, whatever its bank.

Nothing is deferred while every stream's pace affords the whole batch: streams are not slowed
toward their SLO when no other stream gains by it. A deferred stream comes back as soon as its
bank falls under two iterations, so it keeps its own pace; the time it gives shortens the
iterations of the streams that need them (and what chunked prefill may add to them).

Admission still prices every row (`Admission.predicted_tpot_s`): newcomers priced at the
rows the streams could give away were admitted into time the prompts then lacked (the
0.5-rps replay met 79-81% of SLOs against 87.5%; docs/results.md).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from adaserve.request_manager.prefill import tpot_time_limit
from adaserve.request_manager.request import Request

# Predicted seconds of an iteration decoding `rows` rows (one token each) over `context`
# cached tokens, host time included.
RowCostFn = Callable[[int, int], float]

# A stream is deferred only while its bank covers this many iterations: the one it sits out
# and the next, in case it must sit that out too.
DEFER_BANK_ITERATIONS = 2.0


def bank_s(req: Request, now: float, margin: float) -> float | None:
    """Seconds the stream is ahead of (1 - margin) x its SLO pace (negative: behind); None
    without an SLO or before its first token."""
    slo_ms, first = req.paced_slo_tpot_ms, req.metrics.first_token_time
    if slo_ms is None or first is None:
        return None
    pace = (1.0 - margin) * slo_ms / 1000.0
    return pace * (len(req.output_token_ids) - 1) - (now - first)


def deferred_rows(
    cost: RowCostFn,
    running: Sequence[Request],
    now: float,
    margin: float,
    repay: float,
    spend: float,
    tokens_per_row: float = 1.0,
    slowdown: float = 1.0,
) -> list[Request]:
    """The running streams that sit out this iteration (the rule in the module docstring);
    `cost`: the iteration of that many rows with their trees, `tokens_per_row`: the tokens a
    row recently emitted an iteration (speculation's e_r; a pace is per token), `slowdown`:
    how much longer recent iterations ran than `cost` said (>= 1), by which a row served best
    effort is priced: it takes the time the paces leave as it will run, not as predicted."""
    if len(running) < 2:
        return []
    banks = {id(r): bank_s(r, now, margin) for r in running}
    kept = list(running)
    deferred: list[Request] = []
    # Rows served best effort go first, while the batch is over some paced stream's pace:
    # best effort takes no banked time (that is the prompts'), and a stream behind its pace
    # repays its deficit from the time best effort would take.
    spare = [r for r in kept if r.best_effort]
    while spare and len(kept) > 1:
        t = max(1.0, slowdown) * cost(len(kept), sum(r.num_cached for r in kept))
        if t <= _paced_limit(cost, kept, now, margin, repay, tokens_per_row):
            break
        pick = spare.pop()
        kept.remove(pick)
        deferred.append(pick)
    while len(kept) > 1:
        t = cost(len(kept), sum(r.num_cached for r in kept))
        # The tightest allowance among the kept streams that their row alone could meet.
        holder, limit = None, math.inf
        for r in kept:
            allow = tpot_time_limit([r], [tokens_per_row], now, 0.0, margin, repay, spend)
            if allow is None or allow < cost(1, r.num_cached):
                continue
            if allow < limit:
                holder, limit = r, allow
        if t <= limit:
            break
        # A stream served best effort keeps no pace: its row goes first, bank or not.
        spare = [r for r in kept if r.best_effort]
        able = spare or [
            r
            for r in kept
            if r is not holder
            and (b := banks[id(r)]) is not None
            and b >= DEFER_BANK_ITERATIONS * t
        ]
        if not able:
            break
        pick = spare[-1] if spare else max(able, key=lambda r: banks[id(r)] or 0.0)
        kept.remove(pick)
        deferred.append(pick)
    return deferred


def _paced_limit(
    cost: RowCostFn,
    rows: Sequence[Request],
    now: float,
    margin: float,
    repay: float,
    tokens_per_row: float,
) -> float:
    """The longest iteration that keeps every paced stream among `rows` at its pace without
    lending its bank (`prefill.tpot_time_limit`, not banked: a stream behind its pace still
    repays), never under one row of its own; a stream whose pace cannot afford its own row
    is left out. inf when none is paced."""
    limit = math.inf
    for r in rows:
        slo_ms, floor = r.paced_slo_tpot_ms, cost(1, r.num_cached)
        if slo_ms is None or (1.0 - margin) * slo_ms / 1000.0 * tokens_per_row < floor:
            continue
        allow = tpot_time_limit([r], [tokens_per_row], now, floor, margin, repay, 0.0, False)
        if allow is not None:
            limit = min(limit, allow)
    return limit
