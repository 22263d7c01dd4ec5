"""Admission's TPOT prediction on a controlled cost model: prompt tokens that a TTFT objective
forces into the forwards slow a new stream only while those prompts are being prefilled."""

from __future__ import annotations

from adaserve import SamplingParams
from adaserve.config import SchedulerConfig
from adaserve.request_manager.admission import Admission, forced_share
from adaserve.request_manager.request import Request

NOW = 100.0


class LinearCost:
    """20 ms a forward plus 1 ms a token; prompt tokens and their keys cost nothing more."""

    def predict(self, tokens: int, context: int, silent: int = 0, silent_pairs: int = 0) -> float:
        return 0.02 + 0.001 * tokens


def _admission(prefilling: list[Request]) -> Admission:
    return Admission(SchedulerConfig(), LinearCost(), lambda: ([], prefilling, []), lambda: NOW)


def _prompt(tokens: int, due_in_s: float) -> Request:
    """A prompt being prefilled whose first token is due `due_in_s` from now."""
    r = Request("p", list(range(1, tokens + 1)), SamplingParams(), arrival_time=NOW - 1.0)
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
