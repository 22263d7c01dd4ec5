"""`adaserve simulate --rate-ceiling A`: the rate no router can sustain at attainment A."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from adaserve.bench.report import RequestRecord
from adaserve.sim.run import Saturation, cheapest_share, saturation
from tests.sim.test_sim_replicas import write_linear_server
from tests.sim.test_simulate import bench_requests


def record(i: int, sent: float, end: float | None) -> RequestRecord:
    r = RequestRecord(i, "-", None, 4, sent, sent_s=sent)
    if end is not None:
        r.end_s, r.output_tokens, r.token_times_s = end, 4, [end]
    return r


def test_saturation_counts_what_completes_while_a_request_waits_behind_a_full_batch() -> None:
    # Batch 1. Sent at 0, 1, 2, ..., 8; each takes 2 s once started (finishes 2, 4, 6, ...):
    # from t = 1 on two or more are in (one running, one waiting) until the last arrival at 8;
    # counted from the first completion then (2): completions in (2, 8] at 4, 6, 8 -> 3 in 6 s.
    recs = [record(i, float(i), 2.0 * (i + 1)) for i in range(9)]
    assert saturation(recs, batch=1, served=9) == Saturation(3 / 6, 2.0, 8.0, 9)


def test_saturation_is_none_when_the_queue_runs_dry() -> None:
    # Each request finishes before the next arrives: never more than one in.
    recs = [record(i, float(i), i + 0.5) for i in range(9)]
    assert saturation(recs, batch=1, served=9).rate is None
    # Backlogged only over the last eighth of the arrivals: too short to measure a rate.
    recs = [record(i, float(i), i + 0.5) for i in range(8)] + [
        record(8, 7.5, 20.0),
        record(9, 7.9, 21.0),
        record(10, 8.0, 22.0),
    ]
    assert saturation(recs, batch=1, served=11).rate is None


def test_the_cheapest_share_keeps_the_least_work_in_arrival_order() -> None:
    reqs = bench_requests(6, 0.1, slo=40.0)
    words = [50, 10, 40, 30, 20, 60]
    reqs = [
        type(b)(
            type(b.trace)(i, b.trace.emission_time_ms, "w " * n, n, 24, 0.0),
            b.send_time_s,
            24,
            40.0,
        )
        for i, (b, n) in enumerate(zip(reqs, words))
    ]
    kept = cheapest_share(reqs, 0.5)
    assert [b.trace.index for b in kept] == [1, 3, 4]  # 10, 30, 20 words, in arrival order
    assert all(b.slo_tpot_ms is None for b in kept)
    assert [b.slo_tpot_ms for b in cheapest_share(reqs, 0.5, keep_slos=True)] == [40.0] * 3
    assert len(cheapest_share(reqs, 1.0)) == 6
    with pytest.raises(ValueError, match="fraction"):
        cheapest_share(reqs, 95.0)


def test_simulate_ceiling_reports_the_rate_a_backlogged_replica_completes(
    tmp_path: Path, capsys
) -> None:
    from adaserve.cli import main

    # One replica of batch 8, forward 20 ms + 0.5 ms a token, 16-token prompts, 64 tokens
    # out: a full batch decodes 8 rows in 24 ms, so it completes at most 8 / (64 x 24 ms)
    # = 5.2 requests a second (a little less: prompt chunks ride along). Offered 40 rps.
    write_linear_server(tmp_path, 400, 25.0)
    argv = ["simulate", "--trace", str(tmp_path / "t.json"), "--policy", "incremental"]
    argv += ["--cost-model", str(tmp_path / "p.json"), "--replicas", "4", "--max-num-seqs", "8"]
    argv += ["--rps", "40", "--rate-ceiling", "0.95", "--no-progress"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    rows = re.findall(
        r"\| incremental \| (dropped|kept) \| 380 \| 40 \| ([0-9.]+) .*\| (.*) \|", table
    )
    assert [r[0] for r in rows] == ["dropped", "kept"], table
    for _, rate, cap in rows:
        assert 4.5 < float(rate) <= 8 / (64 * 0.024), table
        assert float(re.sub(r"[^0-9.]", "", cap.split("rps")[0])) == pytest.approx(
            4 * float(rate) / 0.95, rel=2e-3
        )
    # Offered too little to queue: said so, no rate.
    assert main([*argv[:-5], "--rps", "1", "--rate-ceiling", "0.95", "--no-progress"]) == 0
    assert "not backlogged long enough: offer more than 1 rps" in capsys.readouterr().out
