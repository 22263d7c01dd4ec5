"""`adaserve simulate --admission slo`: the server's default admission on the virtual clock."""

from __future__ import annotations

import pytest
import tqdm

import adaserve.sim.loop as loop
from adaserve.bench.report import summarize
from adaserve.config import SchedulerConfig
from adaserve.sim.run import simulate
from tests.sim.test_simulate import LinearCost, bench_requests, setup


def test_overload_refuses_at_arrival_and_the_admitted_keep_their_slo() -> None:
    # 40 ms SLO; a forward costs 20 ms + 0.5 ms per token, so ~36 streams fit under it, and
    # 120 requests of 64 tokens arriving every 10 ms overload it.
    reqs = bench_requests(120, 0.01, prompt_words=16, out=64, slo=40.0)
    queued = simulate(reqs, setup("incremental", LinearCost(), max_num_seqs=256))
    slo = simulate(reqs, setup("incremental", LinearCost(), max_num_seqs=256, admission="slo"))
    assert [r.index for r in slo.records] == [r.index for r in queued.records] == list(range(120))
    refused = [r for r in slo.records if r.error is not None]
    assert refused, "nothing refused under 3x overload"
    assert all(r.error.startswith("HTTP 429") and "slo_tpot_ms" in r.error for r in refused)
    assert all(r.output_tokens == 0 for r in refused)
    q, s = summarize(queued.records), summarize(slo.records)
    assert s["refused"] == len(refused) and q["refused"] == 0
    # Queueing everyone puts every stream past 40 ms; refusing keeps the admitted within it
    # (those admitted with their SLO promised: the best-effort ones beside them are not).
    assert q["tpot_slo_attainment"] < 0.5
    assert s["promised_slo_attainment"] > 0.9
    assert s["slo_attainment"] > q["slo_attainment"]


def test_best_effort_serves_what_admission_refuses_and_takes_nothing_from_the_admitted() -> None:
    # The overload above: admission admits 39 of the 120 at their 40 ms SLO. Served best
    # effort (at most eight at a time, the default) instead of refused, eight more run in the
    # time left at every admitted stream's pace: each admitted request still meets its SLO,
    # its first token exactly when it came without them, and the eight complete all their
    # tokens.
    reqs = bench_requests(120, 0.01, prompt_words=16, out=64, slo=40.0)
    off = simulate(
        reqs,
        setup(
            "incremental", LinearCost(), max_num_seqs=256, admission="slo", admission_best_effort=0
        ),
    ).records
    on = simulate(
        reqs, setup("incremental", LinearCost(), max_num_seqs=256, admission="slo")
    ).records
    admitted = [(a, b) for a, b in zip(off, on) if a.error is None]
    assert len(admitted) == 39 and all(b.error is None for _, b in admitted)
    assert all(b.tpot_ms <= 40.0 and b.ttft_s == a.ttft_s for a, b in admitted)
    spared = [b for a, b in zip(off, on) if a.error is not None and b.error is None]
    assert len(spared) == SchedulerConfig.admission_best_effort == 8
    assert all(b.output_tokens == 64 for b in spared)
    assert summarize(on)["slo_attainment"] >= summarize(off)["slo_attainment"]


def test_a_request_refused_for_its_first_token_is_served_best_effort_within_the_wait() -> None:
    # Ten 2,000-token prompts at once: each prefills in ~1 s alone, against a default
    # objective of ~5 s, so the later ones are refused for their first token. Served best
    # effort (their prompts after every admitted one's) while their first token is predicted
    # within `admission_best_effort_wait` x the objective, they complete; the admitted get
    # their first tokens exactly when they got them without them.
    reqs = bench_requests(10, 0.0, prompt_words=2000, out=16)
    kw = dict(max_num_seqs=256, admission="slo")
    off = simulate(reqs, setup("incremental", LinearCost(), admission_best_effort=0, **kw))
    refused = [r for r in off.records if r.error is not None]
    assert refused and all("first token" in r.error for r in refused), [r.error for r in refused]
    on = simulate(
        reqs,
        setup(
            "incremental",
            LinearCost(),
            admission_best_effort=10,
            admission_best_effort_wait=4.0,  # the default
            **kw,
        ),
    )
    spared = [b for a, b in zip(off.records, on.records) if a.error is not None]
    assert spared and all(b.error is None and b.output_tokens == 16 for b in spared)
    assert all(b.best_effort for b in spared)
    admitted = [(a, b) for a, b in zip(off.records, on.records) if a.error is None]
    assert all(b.ttft_s == a.ttft_s and not b.best_effort for a, b in admitted)
    # Within twice the objective, fewer are served so.
    two = simulate(
        reqs,
        setup(
            "incremental",
            LinearCost(),
            admission_best_effort=10,
            admission_best_effort_wait=2.0,
            **kw,
        ),
    )
    assert sum(r.error is None for r in two.records) < sum(r.error is None for r in on.records)


def test_the_progress_bar_counts_refused_requests_as_done(monkeypatch: pytest.MonkeyPatch) -> None:
    # The overload of the first test refuses most requests: the bar must still reach every
    # request (it counted only finished ones and stopped at 43 of 120 here), and it shows the
    # simulated clock (nothing finishes in a large run's first simulated seconds).
    seen = []

    class Recorded(tqdm.tqdm):
        def close(self) -> None:
            seen.append((self.n, self.total, self.postfix))
            super().close()

    monkeypatch.setattr(loop, "tqdm", Recorded)
    reqs = bench_requests(120, 0.01, prompt_words=16, out=64, slo=40.0)
    run = simulate(
        reqs, setup("incremental", LinearCost(), max_num_seqs=256, admission="slo"), progress=True
    )
    assert any(r.error is not None for r in run.records)
    assert seen  # (tqdm closes again when collected)
    n, total, postfix = seen[0]
    assert n == total == 120
    assert postfix.endswith("s simulated")
