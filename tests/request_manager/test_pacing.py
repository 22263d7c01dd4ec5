"""Row deferral: a stream far ahead of its pace sits out iterations a tighter stream needs short,
and only then."""

from __future__ import annotations

from dataclasses import replace

import pytest

from adaserve import SamplingParams
from adaserve.request_manager.pacing import deferred_rows
from adaserve.request_manager.request import Request
from adaserve.sim.run import simulate
from tests.conftest import make_tiny_checkpoint
from tests.request_manager.test_chunked_prefill import _streamed, engine, generate, slowed
from tests.sim.test_simulate import LinearCost, bench_requests, setup

NOW = 50.0
MARGIN, REPAY, SPEND = 0.05, 0.5, 0.5


def per_row(seconds: float):
    """A compute-bound forward (a CPU): every row costs the same, context is free."""
    return lambda rows, context: seconds * rows


def defer(cost, running):
    return deferred_rows(cost, running, NOW, MARGIN, REPAY, SPEND)


def test_loose_streams_far_ahead_sit_out_until_the_tight_one_meets_its_pace():
    # The 22 ms stream is exactly at its 20.9 ms pace; three 91 ms streams are 0.66 s,
    # 0.33 s and 0.15 s ahead of theirs.
    tight = _streamed(22, 10, 0.209, NOW)
    a, b, c = _streamed(91, 10, 0.2, NOW), _streamed(91, 5, 0.1, NOW), _streamed(91, 2, 0.02, NOW)
    # 6 ms a row: four rows take 24 ms, past the tight pace; three take 18 ms. The stream
    # with the largest bank sits out, and only it.
    assert defer(per_row(0.006), [tight, a, b, c]) == [a]
    # 8 ms a row: 32 ms, then 24 ms: two sit out, largest bank first.
    assert defer(per_row(0.008), [tight, a, b, c]) == [a, b]
    # 20 ms a row: even two rows pass the pace, but the tight stream itself never sits out
    # and c's bank (0.15 s) covers two 40 ms iterations: only the tight stream is left.
    assert defer(per_row(0.020), [tight, a, b, c]) == [a, b, c]


def test_a_row_that_emits_two_tokens_an_iteration_affords_twice_the_time():
    # Speculation: the tight stream's row emits ~2 tokens an iteration, so a 24 ms iteration
    # is 12 ms a token, under its pace: nobody sits out (priced as one token a row, rows sat
    # out that a GPU batch had room for).
    tight = _streamed(22, 10, 0.209, NOW)
    a, b, c = _streamed(91, 10, 0.2, NOW), _streamed(91, 5, 0.1, NOW), _streamed(91, 2, 0.02, NOW)
    rows = [tight, a, b, c]
    assert deferred_rows(per_row(0.006), rows, NOW, MARGIN, REPAY, SPEND, 2.0) == []
    # Two paces are 41.8 ms: at 12 ms a row four rows take 48 ms, and one sits out (36 ms).
    assert deferred_rows(per_row(0.012), rows, NOW, MARGIN, REPAY, SPEND, 2.0) == [a]


def test_nothing_sits_out_when_every_pace_affords_the_batch():
    loose = [_streamed(91, 10, 0.2, NOW), _streamed(91, 5, 0.1, NOW), _streamed(91, 2, 0.02, NOW)]
    # 3 x 6 ms = 18 ms against 86 ms paces: no stream gains, so none is slowed.
    assert defer(per_row(0.006), loose) == []
    # A tight stream well ahead of its pace affords the 24 ms batch on its bank.
    ahead = _streamed(22, 10, 0.15, NOW)
    assert defer(per_row(0.006), [ahead, *loose]) == []


def test_a_stream_sits_out_only_with_two_iterations_of_bank():
    # 12 ms a row: two rows take 24 ms, past the tight stream's 20.9 ms pace.
    tight = _streamed(22, 10, 0.209, NOW)
    banked = _streamed(91, 10, 0.2, NOW)  # 0.66 s ahead of its pace
    assert defer(per_row(0.012), [tight, banked]) == [banked]
    fresh = _streamed(91, 1, 0.08, NOW)  # 6 ms ahead: not two 24 ms iterations
    assert defer(per_row(0.012), [tight, fresh]) == []
    no_slo = Request("n", [1, 2], SamplingParams())
    no_slo.append_token(3, NOW - 1.0)
    assert defer(per_row(0.012), [tight, no_slo]) == [], "a stream without an SLO has no pace"


def test_a_stream_its_own_row_cannot_save_does_not_hold_the_others_back():
    lost = _streamed(5, 10, 0.2, NOW)  # 4.75 ms pace under a 6 ms row
    loose = _streamed(91, 10, 0.2, NOW)
    assert defer(per_row(0.006), [lost, loose]) == []


class PerRowCost(LinearCost):
    """A CPU-like forward: 6 ms a token (rows cost what they compute), nothing fixed."""

    name = "per-row"

    def seconds(self, tokens, context, pairs, silent=0, silent_pairs=0, tree_pairs=0) -> float:
        return 0.006 * tokens + 1e-7 * context


def _mixed(slo_tight: float, slo_loose: float) -> list:
    # Three loose streams start first and get ahead of their pace; a tight one joins later.
    reqs = bench_requests(4, 0.3, prompt_words=8, out=400, slo=slo_loose)
    return [*reqs[:3], replace(reqs[3], slo_tpot_ms=slo_tight, max_tokens=96)]


@pytest.mark.parametrize("policy", ["incremental", "adaserve"])
def test_a_tight_stream_meets_its_slo_beside_loose_ones_that_keep_theirs(policy: str):
    # On the virtual clock: four rows take 24 ms, over a 22 ms SLO. With deferral the three
    # 91 ms streams give rows away and everyone meets its SLO; without it the tight one misses.
    reqs = _mixed(22.0, 91.0)
    on = simulate(reqs, setup(policy, PerRowCost(), PerRowCost()))
    off = simulate(reqs, setup(policy, PerRowCost(), PerRowCost(), slo_defer_rows=False))
    by = {r.index: r for r in on.records}
    assert [r.output_tokens for r in on.records] == [400, 400, 400, 96]
    assert by[3].tpot_ms <= 22.0, f"tight stream at {by[3].tpot_ms:.1f} ms with deferral"
    assert all(by[i].tpot_ms <= 91.0 for i in range(3)), "a loose stream lost its SLO"
    tight_off = {r.index: r for r in off.records}[3]
    assert tight_off.tpot_ms > 22.0, f"without deferral {tight_off.tpot_ms:.1f} ms: no test"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("pacing"), max_position_embeddings=1024)


@pytest.mark.parametrize("policy", ["incremental", "adaserve"])
def test_streams_that_sit_out_emit_exactly_their_greedy_output(target, policy: str):
    # The real engine and model, forwards at 6 ms a token on the engine's clock: three 91 ms
    # streams get ahead of their pace, then a 22 ms one joins and four rows (24 ms) would
    # pass its pace. Rows sit out, the tight stream meets its SLO, and every request's tokens
    # are what it generates alone with no SLO.
    prompts = [[(7 * i + j) % 90 + 2 for j in range(12 + i)] for i in range(4)]
    slos, lengths = [91.0, 91.0, 91.0, 22.0], [80, 80, 80, 30]
    e = slowed(engine(target, policy, chunked=True), 0.006, 0.0)
    reqs = []
    for p, slo, n in zip(prompts, slos, lengths):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, slo_tpot_ms=slo)
        reqs.append(e.add_request(p, params))
        if slo > 22.0:  # each loose stream decodes a while before the next arrives
            for _ in range(10):
                e.step()
    deferred = 0
    while e.has_unfinished():
        e.step()
        deferred += e.last_stats.deferred_rows
    assert deferred > 0, "no stream sat out: the test does not test deferral"
    tight = reqs[3].metrics.tpot_ms
    assert tight is not None and tight <= 22.0, f"the 22 ms stream ran at {tight:.1f} ms"
    plain = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    alone = [
        generate(engine(target, policy, chunked=True), [p], [sp])[0]
        for p, sp in zip(prompts, plain)
    ]
    assert [r.output_token_ids for r in reqs] == alone, "deferral changed a greedy output"


def test_a_stream_served_best_effort_sits_out_first_and_sets_no_limit():
    # 6 ms a row: the tight stream (at its 20.9 ms pace) affords three rows, not four.
    tight = _streamed(22, 10, 0.209, NOW)
    banked = _streamed(91, 10, 0.2, NOW)  # 0.66 s ahead of its pace
    spare = _streamed(22, 10, 0.5, NOW)  # far behind its pace: admission could not meet it
    other = _streamed(91, 1, 0.08, NOW)  # 6 ms ahead: no bank to give
    spare.best_effort = True
    assert spare.paced_slo_tpot_ms is None and spare.params.slo_tpot_ms == 22
    # Served best effort it goes before the banked stream, though it has no bank at all.
    assert defer(per_row(0.006), [tight, banked, spare, other]) == [spare]
    # Not served best effort, it is a stream 0.3 s behind its pace: it sets the tightest
    # limit (half a pace, 10.5 ms, repaying its deficit), never sits out itself, and the
    # banked stream goes instead.
    spare.best_effort = False
    assert defer(per_row(0.006), [tight, banked, spare, other]) == [banked]
    # Whatever best-effort streams there are, none sits out while every pace affords the
    # batch: best effort gets the time the SLOs leave.
    spare.best_effort = True
    assert defer(per_row(0.006), [tight, spare]) == []
    assert defer(per_row(0.004), [tight, banked, spare, other]) == []
