"""A request attains its SLO as its user sees it: TPOT within slo_tpot_ms and the first token
within its objective; the TPOT-only figure is kept beside it."""

from __future__ import annotations

import pytest

from adaserve.request_manager.request import RequestMetrics


def metrics(ttft_s: float, tpot_ms: float, tokens: int = 11, **kw: float) -> RequestMetrics:
    m = RequestMetrics(100.0, **kw)
    first = 100.0 + ttft_s
    m.first_token_time, m.num_output_tokens = first, tokens
    m.last_token_time = first + tpot_ms * (tokens - 1) / 1000.0
    return m


@pytest.mark.parametrize(
    ("ttft_s", "tpot_ms", "tpot_ok", "ttft_ok", "joint"),
    [
        (0.5, 40.0, True, True, True),  # both met
        (0.5, 60.0, False, True, False),  # TPOT missed
        (3.0, 40.0, True, False, False),  # TPOT met, first token 3 s against a 2 s objective
        (3.0, 60.0, False, False, False),
        (2.0, 50.0, True, True, True),  # exactly at both bounds counts as met
    ],
)
def test_joint_attainment_by_hand(ttft_s, tpot_ms, tpot_ok, ttft_ok, joint) -> None:
    m = metrics(ttft_s, tpot_ms, slo_tpot_ms=50.0, ttft_objective_ms=2000.0)
    assert m.tpot_attained is tpot_ok
    assert m.ttft_attained is ttft_ok
    assert m.slo_attained is joint


def test_an_explicit_ttft_slo_is_the_objective_until_the_scheduler_sets_one() -> None:
    m = metrics(1.5, 40.0, slo_tpot_ms=50.0, slo_ttft_ms=1000.0)
    assert m.ttft_attained is False and m.slo_attained is False
    m.ttft_objective_ms = 2000.0
    assert m.ttft_attained is True and m.slo_attained is True


def test_no_tpot_slo_is_no_attainment_but_the_first_token_is_still_judged() -> None:
    m = metrics(3.0, 40.0, ttft_objective_ms=2000.0)
    assert m.slo_attained is None and m.tpot_attained is None
    assert m.ttft_attained is False


def test_without_an_objective_only_tpot_decides() -> None:
    m = metrics(30.0, 40.0, slo_tpot_ms=50.0)
    assert m.ttft_attained is None and m.slo_attained is True
