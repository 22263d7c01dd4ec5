"""Admission's TPOT prediction on a controlled cost model: prompt tokens that a TTFT objective
forces into the forwards slow a new stream only while those prompts are being prefilled."""

from __future__ import annotations

import math

import pytest

from adaserve import SamplingParams
from adaserve.config import SchedulerConfig
from adaserve.request_manager.admission import Admission, forced_share, mean_depth
from adaserve.request_manager.request import Request
from adaserve.request_manager.stats import IterationStats

NOW = 100.0


class LinearCost:
    """20 ms a forward plus 1 ms a token; prompt tokens and their keys cost nothing more."""

    def predict(self, tokens: int, context: int, silent: int = 0, silent_pairs: int = 0) -> float:
        return 0.02 + 0.001 * tokens


def _admission(prefilling: list[Request]) -> Admission:
    return Admission(SchedulerConfig(), LinearCost(), lambda: ([], prefilling, []), lambda: NOW)


def _prompt(tokens: int, due_in_s: float) -> Request:
    """A prompt being prefilled whose first token is due `due_in_s` from now (and whose
    stream outlasts every newcomer's here: its row is in every batch they decode in)."""
    params = SamplingParams(max_tokens=4096)
    r = Request("p", list(range(1, tokens + 1)), params, arrival_time=NOW - 1.0)
    r.ttft_objective_ms = 1000.0 * (1.0 + due_in_s)
    return r


def test_forced_prompt_tokens_are_spread_over_the_life_of_a_request_that_names_its_length():
    # 480 prompt tokens due in 1.2 s: the smallest c with ceil(480 / c) x (0.022 + 0.001 c)
    # <= 1.2 is 15 (32 iterations of 37 ms = 1.18 s); a plain decode of the two rows: 22 ms.
    prompt = _prompt(480, due_in_s=1.2)
    adm = _admission([prompt])
    plain, slowed = 0.022, 0.022 + 0.001 * 15
    unknown = adm.predicted_tpot_s()
    assert abs(unknown - slowed) < 1e-9, "length unknown: every iteration carries the chunk"
    assert forced_share([prompt], 15, 64, 1.0) == 32 / 64
    short = adm.predicted_tpot_s(max_tokens=64)
    assert abs(short - (plain + 32 / 64 * (slowed - plain))) < 1e-9
    assert adm.predicted_tpot_s(max_tokens=640) < short, "a longer life dilutes the prompts more"
    assert abs(adm.predicted_tpot_s(max_tokens=16) - slowed) < 1e-9, "over before they are in"
    # Speculation's tokens per iteration shorten the life in iterations: 96 tokens at 2 per
    # iteration are 48 iterations, 32 of them slowed.
    adm.tokens_per_request = 2.0
    two = adm.predicted_tpot_s(max_tokens=96)
    assert abs(two - (plain + 32 / 48 * (slowed - plain)) / 2) < 1e-9


def test_a_request_that_outlasts_the_prefill_is_admitted_where_the_forced_chunk_refuses_it():
    adm = _admission([_prompt(480, due_in_s=1.2)])
    slo_ms = 35.0  # 0.85 x 35 = 29.75 ms: between 22 ms plain and 37 ms slowed
    assert adm.refusal(slo_ms) is not None, "length unknown: priced at 37 ms, refused"
    why = adm.refusal(slo_ms, max_tokens=16)
    assert why is not None and "cannot be met" in why, "16 tokens: every one slowed"
    assert adm.refusal(slo_ms, max_tokens=256) is None, "256 tokens: 32 of them slowed (25.75 ms)"


def test_prompts_due_before_the_first_token_delay_it_and_do_not_slow_the_stream():
    # A is due in 1.2 s and forces 15 tokens into each forward (above); B, due in 3 s, is
    # prefilled after it. A new request with a 100-token prompt whose first token is due in
    # 1.5 s is ranked after A (not OVERTAKE_S sooner) and before B: A is in before it decodes
    # (its first token: 580 tokens at 833 a second, 0.7 s), B's 480 tokens take 32 of its
    # iterations at 15 a forward.
    a, b = _prompt(480, due_in_s=1.2), _prompt(480, due_in_s=3.0)
    alone = _admission([a])
    assert alone.refusal(35.0, max_tokens=16) is not None, "no first token known: A counts"
    assert alone.refusal(35.0, 100, slo_ttft_ms=1500, max_tokens=16) is None, "A is in first"
    due = NOW + 1.5
    assert alone.predicted_tpot_s(max_tokens=16, first_token_due=due) == 0.022
    both = _admission([a, b])
    plain, slowed = 0.023, 0.023 + 0.001 * 15
    expected = plain + 32 / 64 * (slowed - plain)
    got = both.predicted_tpot_s(max_tokens=64, first_token_due=due)
    assert abs(got - expected) < 1e-9, "B's prefill over half of the request's 64 iterations"
    assert both.predicted_tpot_s(first_token_due=NOW + 5.0) == plain, "due after both"


def test_a_yielding_prompt_forces_nothing_until_it_starves():
    from adaserve.request_manager.prefill import forced_chunk, starving

    def cost(tokens: int, context: int, silent: int, silent_pairs: int) -> float:
        return LinearCost().predict(tokens, context, silent, silent_pairs)

    a = _prompt(480, due_in_s=1.2)
    assert forced_chunk(cost, [a], 2, 0, NOW, 256, 16) == 15, "A's objective: 15 a forward"
    a.prefill_yields = True
    assert forced_chunk(cost, [a], 2, 0, NOW, 256, 16) == 0, "yielding: slack only"
    # A prompt behind it still forces what its own objective needs, A's tokens included
    # (they are prefilled first): 960 tokens in 3 s.
    b = _prompt(480, due_in_s=3.0)
    c = forced_chunk(cost, [a, b], 2, 0, NOW, 256, 16)
    assert c == forced_chunk(cost, [_prompt(960, due_in_s=3.0)], 2, 0, NOW, 256, 16) and c > 0
    # Twice its objective (2.2 s) after arrival, A starves: its objective is lost, so the
    # minimum chunk keeps it moving again.
    late = NOW - 1.0 + 2 * 2.2
    assert not starving(a, late - 0.01) and starving(a, late)
    assert forced_chunk(cost, [a], 2, 0, late, 256, 16) == 16


def test_the_forced_chunk_meets_every_prompt_whose_first_token_can_still_be_on_time():
    from adaserve.request_manager.prefill import forced_chunk

    def cost(tokens: int, context: int, silent: int, silent_pairs: int) -> float:
        return LinearCost().predict(tokens, context, silent, silent_pairs)

    # A lost prompt at the head (480 tokens in 0.1 s: no chunk does it) forces nothing of its
    # own, but B behind it, due in 1.5 s, needs A's 480 tokens and its own: the queue moves at
    # B's pace (40 a forward), not at the 16-token minimum (which left every prompt behind a
    # late one late).
    lost, b = _prompt(480, due_in_s=0.1), _prompt(480, due_in_s=1.5)
    c = forced_chunk(cost, [lost, b], 2, 0, NOW, 256, 16)
    assert c == forced_chunk(cost, [_prompt(960, due_in_s=1.5)], 2, 0, NOW, 256, 16) == 40
    # A alone needs 15 a forward (480 in 1.2 s); C behind it, 100 tokens due in 1.3 s, needs
    # 580 tokens in 1.3 s: 19 a forward (31 forwards of 41 ms). The chunk meets both.
    a, c100 = _prompt(480, due_in_s=1.2), _prompt(100, due_in_s=1.3)
    assert forced_chunk(cost, [a], 2, 0, NOW, 256, 16) == 15
    assert forced_chunk(cost, [a, c100], 2, 0, NOW, 256, 16) == 19


def test_a_stream_refused_only_for_prompts_behind_it_is_admitted_over_them():
    # A, due in 1.2 s, forces 15 tokens a forward (37 ms); a request with a 1.5 s first-token
    # objective goes ahead of it. Its TPOT at 2 rows: 22 ms without A's chunks.
    a = _prompt(480, due_in_s=1.2)
    b = _prompt(480, due_in_s=3.0)
    ahead = _admission([a])
    assert ahead.refusal(30.0, 100, slo_ttft_ms=1500, max_tokens=64) is None, "A is ahead"
    adm = _admission([a, b])
    assert adm.refusal(30.0, 100, slo_ttft_ms=1500, max_tokens=64) is None
    assert b.prefill_yields and not a.prefill_yields, "B, behind it, yields; A is ahead"
    # Its first token would come too late: refused, and nobody yields for it.
    c = _prompt(480, due_in_s=3.0)
    adm = _admission([a, c])
    assert adm.refusal(30.0, 2000, slo_ttft_ms=1500, max_tokens=64) is not None
    assert not c.prefill_yields, "refused: nothing yields"
    # With prompts_yield off it is refused for B's chunks, as before.
    d = _prompt(480, due_in_s=3.0)
    off = Admission(
        SchedulerConfig(prompts_yield=False), LinearCost(), lambda: ([], [a, d], []), lambda: NOW
    )
    why = off.refusal(30.0, 100, slo_ttft_ms=1500, max_tokens=64)
    assert why is not None and "cannot be met" in why and not d.prefill_yields


def test_a_newcomer_is_priced_at_plain_decoding_when_the_trees_do_not_pay():
    """Streams verify ~4-token trees (forward_tokens_per_request 4) that yield 1.2 tokens an
    iteration: scaling the measured period to 4 tokens for every request would price a new
    stream at what trees cost, though control drops trees that do not pay. The prediction is
    the faster of the trees and plain decoding; where trees pay, the trees."""
    running = [Request(f"r{i}", [1] * 100, SamplingParams()) for i in range(3)]
    adm = Admission(SchedulerConfig(), LinearCost(), lambda: (running, [], []), lambda: NOW)
    adm.forward_tokens_per_request = 4.0
    adm.decode_slowdown = 2.0  # iterations took twice the forward (drafting, host)
    adm.tokens_per_request = 1.2
    trees = 2 * (0.02 + 0.001 * 16) / 1.2  # 4 requests x 4 tokens, 1.2 tokens each
    plain = 2 * (0.02 + 0.001 * 4)  # 4 requests x 1 token, the same slowdown
    assert plain < trees
    assert abs(adm.predicted_tpot_s() - plain) < 1e-9
    adm.tokens_per_request = 3.5  # trees that pay: 3.5 tokens for 4 verified
    assert abs(adm.predicted_tpot_s() - 2 * (0.02 + 0.001 * 16) / 3.5) < 1e-9
    # Incremental (one token a request, one emitted): both estimates are the same one.
    adm.forward_tokens_per_request = adm.tokens_per_request = 1.0
    assert abs(adm.predicted_tpot_s() - 2 * (0.02 + 0.001 * 4)) < 1e-9


def _decode_iteration(rows: int, seconds: float) -> IterationStats:
    """A decode-only iteration of `rows` one-token rows that took `seconds`."""
    return IterationStats(
        kind="decode",
        num_requests=rows,
        num_tokens=rows,
        padded_tokens=rows,
        emitted_tokens=rows,
        total_s=seconds,
        forward_s=seconds,
    )


def test_a_newcomer_is_priced_by_the_batch_it_joins_not_the_batch_that_was():
    """Iterations of 8 streams ran 10% over their prediction (30.8 ms where 28 was
    predicted); then 6 of the streams ended. A newcomer joins 2 streams: 3 rows, 23 ms
    predicted, 25.3 ms at the measured slowdown. The period of the 8-row batch, scaled by the
    cost model from the 2 rows running now to 3, had priced it at 32.2 ms (30.8 x 23 / 22):
    the old batch's time, not the new one's."""
    running = [Request(f"r{i}", [1] * 100, SamplingParams()) for i in range(8)]
    adm = Admission(SchedulerConfig(), LinearCost(), lambda: (running, [], []), lambda: NOW)
    eight = 1.1 * (0.02 + 0.001 * 8)
    for _ in range(50):
        # The gap before the next iteration is host time; here none.
        adm.observe(_decode_iteration(8, eight), 0.0, 8, context=800)
    assert adm.decode_slowdown is not None and abs(adm.decode_slowdown - 1.1) < 1e-6
    del running[2:]  # six streams end
    assert abs(adm.predicted_tpot_s() - 1.1 * (0.02 + 0.001 * 3)) < 1e-6
    # An iteration whose context is unknown is no sample.
    adm.observe(_decode_iteration(2, 1.0), 0.0, 2)
    assert abs(adm.decode_slowdown - 1.1) < 1e-6


def test_under_overload_the_requests_needing_the_least_compute_are_served_first():
    # 20 ms + 1 ms a token: a 100-token prompt with 64 tokens needs 0.12 + 64 x 0.021 =
    # 1.464 s alone; a 4,000-token one 4.02 + 1.344 = 5.364 s. Budget: 0.5 x 10 s = 5 s.
    clock = [NOW]
    cfg = SchedulerConfig(admission_work_share=0.5, admission_work_window_s=10.0)
    queued = [Request("q", [1, 2], SamplingParams(max_tokens=8))]  # the server is busy
    adm = Admission(cfg, LinearCost(), lambda: ([], [], queued), lambda: clock[0])
    short, long = 1.464, 5.364
    assert abs(adm.work_s(100, 64) - short) < 1e-9 and abs(adm.work_s(4000, 64) - long) < 1e-9
    for i in range(3):
        assert adm.judge(None, 100, max_tokens=64, key=f"s{i}") is None
    assert adm.work_limit_s(clock[0]) is None, "3 short ones fill 4.4 of 5 s: no limit"
    # The long one would take the window's arrivals past the budget: the server is
    # overloaded and sheds it, before any request was refused for its SLO (waiting for one
    # had let such prompts in with their promise, and the arrivals after them were refused).
    refused = adm.judge(None, 4000, max_tokens=64, key="l0")
    assert refused is not None and "least compute" in refused.message, refused
    assert "5.4 s" in refused.message and "4000-token prompt" in refused.message
    assert refused.first_token, "not held: waiting for its turn cannot come while overloaded"
    assert refused.work, "served best effort, it would spend that compute"
    assert abs(adm.work_limit_s(clock[0]) - short) < 1e-9, "the short ones fit, the long not"
    assert adm.judge(None, 100, max_tokens=64, key="s3") is None, "a cheap one is admitted"
    why = adm.judge(1.0, 100, max_tokens=64, key="tight")
    assert why is not None and "slo_tpot_ms" in why.message and not why.work
    # Judged again (held), a request is one arrival, not two.
    n = len(adm._arrivals)
    adm.judge(None, 100, max_tokens=64, key="s3")
    assert len(adm._arrivals) == n
    # Once the window's arrivals are past, the long one is alone in it: larger than the
    # budget, but there is nothing cheaper to serve instead.
    clock[0] += 10.5
    assert adm.judge(None, 4000, max_tokens=64, key="l2") is None
    assert adm.judge(None, 100, max_tokens=64, key="s4") is None
    assert adm.judge(None, 4000, max_tokens=64, key="l3") is not None, "now there is"
    # A server with nothing to do serves what it is sent, whatever max_tokens says.
    queued.clear()
    assert adm.judge(None, 4, max_tokens=2**70, key="huge") is None
    off = Admission(
        SchedulerConfig(admission_work_share=0.0), LinearCost(), lambda: ([], [], []), lambda: NOW
    )
    off.judge(1.0, 100, max_tokens=64)
    assert all(off.judge(None, 4000, max_tokens=64) is None for _ in range(20)), "0: off"


class PairCost(LinearCost):
    """LinearCost plus 5 us for every key a prompt token attends."""

    def predict(self, tokens: int, context: int, silent: int = 0, silent_pairs: int = 0) -> float:
        return 0.02 + 0.001 * tokens + 5e-6 * silent_pairs


def test_forced_chunks_are_priced_at_the_depth_they_will_run_at_not_where_the_prompt_begins():
    # A 1,000-token document just begun (its first 10 tokens in), due in 8 s: its objective
    # forces 4 tokens into every forward (248 forwards of ~26 ms). Over a new stream's life
    # those chunks attend on average (10 + 1000) / 2 = 505 keys each, not the 10 where the
    # document stands now: 4 x 505 + 10 pairs, 10 ms a forward more than priced at its start.
    doc = _prompt(1000, due_in_s=8.0)
    doc.num_cached = 10
    assert mean_depth([doc]) == 505
    adm = Admission(SchedulerConfig(), PairCost(), lambda: ([], [doc], []), lambda: NOW)
    deep = 0.02 + 0.001 * (2 + 4) + 5e-6 * (4 * 505 + 10)
    got = adm.predicted_tpot_s()
    assert got is not None and abs(got - deep) < 1e-9, f"{got} s, not {deep} s at depth 505"
    # Nearly done: the chunks left attend ~995 keys each.
    doc.num_cached = 990
    assert mean_depth([doc]) == 995
    assert mean_depth([]) == 0


def test_a_request_the_load_cannot_promise_is_served_best_effort_while_few_are():
    """Three 100 ms streams run (a decode of the four rows a newcomer would make: 24 ms). A
    23 ms request is refused for its TPOT; its SLO could be met alone (21 ms a token), so it
    is served best effort while fewer than `admission_best_effort` are. Once served so, it
    prices no newcomer and holds no one's SLO: its row sits out first."""
    streams = [Request(f"r{i}", [1] * 10, SamplingParams(slo_tpot_ms=100)) for i in range(3)]
    prompts: list[Request] = []
    adm = Admission(
        SchedulerConfig(admission_best_effort=1, admission_best_effort_wait=2.0),
        LinearCost(),
        lambda: (streams, prompts, []),
        lambda: NOW,
    )
    why = adm.judge(23.0, 100)
    assert why is not None and "cannot be met" in why.message and not why.first_token
    assert adm.best_effort_refusal(23.0, 100, None) is None
    why = adm.best_effort_refusal(20.0, 100, None)
    assert why == "its SLO cannot be met even alone (21 ms)", why
    # The first token: 100 tokens at 833 a second (0.12 s alone) behind a 480-token prompt
    # that is prefilling: 0.7 s, against twice the default objective (1 s + 4 x 0.12 s).
    prompts.append(_prompt(480, due_in_s=1.2))
    assert adm.best_effort_refusal(23.0, 100, None, waited_s=2.2) is None
    why = adm.best_effort_refusal(23.0, 100, None, waited_s=2.4)
    assert why == "its first token would come after 3.1 s (limit 3.0)", why
    # The default `admission_best_effort_wait`, 4: four times the objective (5.9 s).
    adm.cfg = SchedulerConfig(admission_best_effort=1)
    assert adm.best_effort_refusal(23.0, 100, None, waited_s=2.4) is None
    why = adm.best_effort_refusal(23.0, 100, None, waited_s=5.3)
    assert why == "its first token would come after 6.0 s (limit 5.9)", why
    with pytest.raises(ValueError, match="admission_best_effort_wait must be > 0"):
        SchedulerConfig(admission_best_effort_wait=0.0)
    prompts.clear()
    # Served best effort (with a 10 ms SLO no load meets, to show it holds nobody's).
    spare = Request("b", [1] * 10, SamplingParams(slo_tpot_ms=10))
    before = adm.predicted_tpot_s()
    streams.append(spare)
    assert adm.refusal(100.0) is not None, "a 10 ms stream served with its SLO refuses all"
    spare.best_effort = True
    assert adm.predicted_tpot_s() == before, "a best-effort row prices no newcomer"
    assert adm.refusal(100.0) is None
    why = adm.best_effort_refusal(23.0, 100, None)
    assert why == "--admission-best-effort 1: as many are served best effort already", why
    off = Admission(
        SchedulerConfig(admission_best_effort=0), LinearCost(), lambda: ([], [], []), lambda: NOW
    )
    assert off.best_effort_refusal(23.0, 100, None) == "best effort is off"


def test_a_prompt_the_prefix_cache_holds_is_priced_by_what_is_left_to_compute():
    """A 2,000-token prompt takes 2 s to prefill here: with a 1 s first-token objective it is
    refused. When the prefix cache holds all but its last 16 tokens, the first token takes
    what those cost, and it is admitted; its objective is still its own."""
    adm = _admission([])
    why = adm.judge(None, 2000, slo_ttft_ms=1000.0)
    assert why is not None and why.first_token, why
    assert adm.judge(None, 2000, slo_ttft_ms=1000.0, cached_tokens=1984) is None
    assert adm.best_effort_refusal(None, 2000, 300.0, cached_tokens=1984) is None
    why_be = adm.best_effort_refusal(None, 2000, 300.0)
    assert why_be is not None and "first token would come after" in why_be, why_be


def _stream(slo_tpot_ms: float | None, max_tokens: int, emitted: int) -> Request:
    """A running request that has emitted `emitted` tokens of its `max_tokens`."""
    r = Request("s", [1, 2], SamplingParams(max_tokens=max_tokens, slo_tpot_ms=slo_tpot_ms))
    for i in range(emitted):
        r.append_token(3, NOW - 0.1 * (emitted - i))
    return r


def _running(streams: list[Request]) -> Admission:
    return Admission(SchedulerConfig(), LinearCost(), lambda: (streams, [], []), lambda: NOW)


def test_a_newcomer_is_priced_by_the_batch_it_will_decode_in_as_streams_end():
    # Three streams with 8 tokens left each (at most: max_tokens 10, 2 emitted). A newcomer of
    # 64 tokens decodes 8 iterations beside them (4 rows: 24 ms) and 56 alone (21 ms): 21.375
    # ms a token on average, not the 24 ms of the batch of now.
    adm = _running([_stream(None, 10, 2) for _ in range(3)])
    assert adm.predicted_tpot_s(max_tokens=64, over_life=False) == pytest.approx(0.024)
    assert adm.predicted_tpot_s() == pytest.approx(0.024), "length unknown: the batch of now"
    assert adm.predicted_tpot_s(max_tokens=64) == pytest.approx((8 * 0.024 + 56 * 0.021) / 64)
    assert adm.predicted_tpot_s(max_tokens=8) == pytest.approx(0.024), "over before they end"
    # A 23 ms SLO fits the newcomer's life, not the batch of now.
    assert adm.refusal(23.0, max_tokens=64) is None
    why = adm.refusal(23.0)
    assert why is not None and "cannot be met" in why
    # Speculation's tokens per iteration shorten every life in iterations alike.
    adm.tokens_per_request = 2.0
    assert adm.life_factor(32, 1, 32) == pytest.approx((4 * 0.024 + 28 * 0.021) / 32 / 0.024)


def test_admitted_streams_are_protected_over_what_they_have_left():
    # A 23 ms stream T with 998 tokens left, three streams without an SLO, and a newcomer
    # (no SLO, 64 tokens): the batch of now (5 rows) is 25 ms, over T's SLO.
    def admission(others_left: int) -> Admission:
        others = [_stream(None, others_left + 2, 2) for _ in range(3)]
        return _running([_stream(23.0, 1000, 2), *others])

    # The others run as long as T: T decodes beside the newcomer at 25 ms for its first 64
    # tokens, then at 24 ms: refused for T's sake.
    why = admission(998).refusal(None, max_tokens=64)
    assert why is not None and "slow the requests being served past their slo_tpot_ms 23" in why
    # The others end in 8 tokens: T's remaining 998 tokens average
    # (8 x 25 + 56 x 22 + 934 x 21) / 998 = 21.1 ms with the newcomer: admitted.
    assert admission(8).refusal(None, max_tokens=64) is None
    # T itself ends in 8 tokens: its last 8 tokens at 25 ms are over its SLO, so refused.
    short = _running([_stream(23.0, 10, 2), *[_stream(None, 1000, 2) for _ in range(3)]])
    assert short.refusal(None, max_tokens=64) is not None
    # On its last token, T's mean no longer moves: nothing to protect.
    last = _running([_stream(23.0, 3, 2), *[_stream(None, 1000, 2) for _ in range(3)]])
    assert last.refusal(None, max_tokens=64) is None


def _drained_backlog(backlog: Request) -> Admission:
    """Four streams (no SLO, 100 tokens each) and a backlog `backlog` whose chunks wait until a
    whole tile fits the streams' paces (prefill.tile_or_wait): 40 iterations of 50 ms carry
    none of it, then one of 250 ms carries 64 tokens, six times over."""
    streams = [_stream(None, 1000, 98) for _ in range(4)]
    now = [NOW]
    adm = Admission(
        SchedulerConfig(), LinearCost(), lambda: (streams, [backlog], []), lambda: now[0]
    )
    waiting, tile = _decode_iteration(4, 0.05), _decode_iteration(4, 0.25)
    tile.prefill_tokens, tile.prefill_requests = 64, 1
    for _ in range(6):
        for stats in [tile, *[waiting] * 40]:
            adm.observe(stats, 0.0, 4, context=400)
            now[0] += stats.total_s
    return adm


def test_best_effort_prices_a_backlog_drained_a_tile_at_a_time_by_tokens_over_seconds():
    """The backlog drains 64 tokens every 2.25 s (28 a second). The average of per-iteration
    rates that `judge` refuses by falls ~0.8^40 between tiles; the best-effort decision, which
    takes only the time the admitted leave, prices the first token at the rate the backlog
    really drains (`drain_rate`, over the last 5 s of it; 23.5 tokens a second right before a
    tile): a 100-token prompt behind 936 is 44 s away, within 4 x a 12 s objective, not 4 x
    9 s; by the average, hours away."""
    adm = _drained_backlog(_prompt(936, due_in_s=60.0))
    assert adm.drain_rate is not None and adm.prefill_rate is not None
    drained = 64 / (40 * 0.05 + 0.25)
    assert abs(adm.drain_rate - drained) < 0.2 * drained, adm.drain_rate
    assert adm.prefill_rate < 1e-3 * drained, "the average of per-iteration rates, between tiles"
    by_average = adm.predicted_ttft_s(100, math.inf)
    assert by_average is not None and by_average > 3600.0
    by_drain = adm.predicted_ttft_s(100, math.inf, adm.drain_rate)
    assert by_drain is not None and abs(by_drain - 1036 / adm.drain_rate) < 1e-6
    assert adm.best_effort_refusal(None, 100, 12_000.0) is None
    why = adm.best_effort_refusal(None, 100, 9_000.0)
    assert why is not None and "limit 36.0" in why, why
    # `judge` still refuses a prompt longer than two forced chunks (600 tokens, the backlog
    # due after it) by the average, but its 429 names no first token hours away: the seconds
    # at the real rate when those are past the objective too (~25 s against 3 s), else why
    # it is refused.
    why_429 = adm.judge(None, 600, 3_000.0)
    assert why_429 is not None and why_429.first_token
    assert why_429.message.startswith(
        f"the first token would come after about {600 / adm.drain_rate:.1f} s"
    ), why_429.message
    why_429 = adm.judge(None, 600, 30_000.0)
    assert why_429 is not None and why_429.message.startswith(
        "the first token would not come within this request's time-to-first-token objective "
        "of 30.0 s (slo_ttft_ms): the requests being served have left prompts almost no time"
    ), why_429.message


def test_a_prompt_the_forced_chunks_prefill_is_priced_by_those_chunks_not_the_drain():
    """Beside the streams of the test above, with the rate averaged near zero between tiles:
    a 100-token question due in 2 s that nothing due sooner stands before is prefilled by the
    chunk its objective forces (prefill.forced_chunk), whatever the streams' slack: the
    iteration under way (4 rows, 24 ms) and one forward of 4 rows and its 100 tokens (124
    ms), so it is admitted. Up to two chunks (max_prefill_chunk, 256, beside streams) are
    priced so; past them the drain decides as before: 600 tokens, or the 100 behind a
    936-token backlog due sooner."""
    adm = _drained_backlog(_prompt(936, due_in_s=60.0))
    assert adm.predicted_ttft_s(100, 2.0) == pytest.approx(0.024 + 0.124)
    assert adm.judge(None, 100, 2_000.0) is None
    # The chunks are the newcomer's and every prompt's due before it: 156 + 100 fit one.
    early = _drained_backlog(_prompt(156, due_in_s=1.0))
    assert early.predicted_ttft_s(100, 2.0) == pytest.approx(0.024 + 0.280)
    assert early.judge(None, 100, 2_000.0) is None
    # 300 tokens: a chunk of 256, then 44.
    assert adm.predicted_ttft_s(300, 2.0) == pytest.approx(0.024 + 0.280 + 0.068)
    assert adm.judge(None, 300, 2_000.0) is None
    longer = adm.judge(None, 600, 2_000.0)
    assert longer is not None and longer.first_token, "600 tokens: past two chunks"
    behind = _drained_backlog(_prompt(936, due_in_s=1.0))
    why = behind.judge(None, 100, 2_000.0)
    assert why is not None and why.first_token, "behind 936 tokens due sooner: the drain"


class KeyCost(LinearCost):
    """LinearCost plus 12 us for every key the forward's rows attend (ggml on this machine:
    ~12 ms an iteration for 1,000 keys)."""

    def predict(self, tokens: int, context: int, silent: int = 0, silent_pairs: int = 0) -> float:
        return super().predict(tokens, context) + 12e-6 * context


def test_a_newcomer_is_priced_with_the_keys_its_prompt_adds_to_every_forward():
    # A 35 ms stream T with 64 tokens left and a 302-token context, and a newcomer with no
    # SLO and 64 tokens. Its row alone would make the batch 2 rows: 22 + 3.6 ms = 25.6 ms. A
    # 1,000-token prompt adds 12 ms to every forward it is in (37.6 ms over T's whole rest,
    # past its SLO): refused for T's sake; a 20-token prompt adds 0.24 ms: admitted.
    t = _stream(35.0, 66, 2)
    t.prompt_token_ids.extend(range(298))
    assert t.num_tokens == 302
    adm = Admission(SchedulerConfig(), KeyCost(), lambda: ([t], [], []), lambda: NOW)
    assert adm.judge(None, 20, max_tokens=64) is None
    why = adm.judge(None, 1000, max_tokens=64)
    assert why is not None, "priced as a row with no keys, it was admitted"
    assert "slow the requests being served past their slo_tpot_ms 35" in why.message, why
    assert adm.predicted_tpot_s(max_tokens=64, extra_context=1000) == pytest.approx(
        0.022 + 12e-6 * 1302
    )
    # Its own SLO too: 30 ms fits a 20-token prompt's batch (26 ms), not a 1,000-token one's.
    assert adm.judge(30.0, 20, max_tokens=64) is None
    own = adm.judge(30.0, 1000, max_tokens=64)
    assert own is not None and "slo_tpot_ms 30 cannot be met" in own.message, own
