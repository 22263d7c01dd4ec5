"""`adaserve simulate --replicas N --router R`: replicas run in parallel in virtual time."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from adaserve.bench.report import summarize
from adaserve.request_manager.control.profile import LatencyPoint, Profile
from adaserve.sim.run import RateFound, find_rate, simulate
from tests.sim.test_simulate import ConstantCost, LinearCost, bench_requests, setup


def test_two_replicas_serve_two_requests_as_fast_as_one_serves_one() -> None:
    c = 0.02
    alone = simulate(bench_requests(1, 0.0), setup("incremental", ConstantCost(c)))
    both = simulate(bench_requests(2, 0.0), setup("incremental", ConstantCost(c), replicas=2))
    one = alone.records[0]
    for r in both.records:
        assert r.token_times_s == pytest.approx(one.token_times_s), "replicas did not overlap"
    assert both.iterations == 2 * alone.iterations


def test_a_second_replica_doubles_what_meets_the_slo_under_overload() -> None:
    reqs = bench_requests(80, 0.01, prompt_words=16, out=48, slo=40.0)
    base = setup("incremental", LinearCost(), max_num_seqs=256)
    one = summarize(simulate(reqs, base).records)
    two = summarize(simulate(reqs, replace(base, replicas=2)).records)
    assert two["tpot_slo_attainment"] > one["tpot_slo_attainment"] + 0.3, (one, two)


@pytest.mark.parametrize("router", ["round_robin", "pow2", "slo"])
def test_every_request_is_served_or_refused_once(router: str) -> None:
    reqs = bench_requests(60, 0.01, prompt_words=16, out=32, slo=40.0)
    s = setup("incremental", LinearCost(), replicas=3, router=router, admission="slo")
    run = simulate(reqs, s)
    assert [r.index for r in run.records] == list(range(60))
    for r in run.records:
        assert (r.error is None and r.output_tokens == 32) or r.error.startswith("HTTP 429")


def test_the_slo_router_meets_more_slos_than_power_of_two_on_mixed_slos() -> None:
    # Three classes (30 / 80 / 400 ms), 4 replicas, 33 requests/s, every replica's admission
    # on and deciding at arrival: where each request goes decides whether the tight ones fit
    # anywhere. (Holding refused requests, the default, lets a replica take them once its
    # streams end, which here leaves every router at 96-100%: the next test.)
    reqs = [
        replace(b, slo_tpot_ms=[30.0, 80.0, 400.0][b.trace.index % 3])
        for b in bench_requests(240, 0.03, prompt_words=16, out=48)
    ]
    base = setup(
        "incremental",
        LinearCost(),
        max_num_seqs=256,
        replicas=4,
        admission="slo",
        admission_hold=0.0,
        # Refused, not served best effort: a replica that serves the tight requests it cannot
        # promise in the time its streams leave meets 99% under any router.
        admission_best_effort=0,
        # A 15% admission margin (the default before 2026-11-29): at the default 1.0 this
        # load fits under every router (100% each), and the test is about where it binds.
        slo_headroom=0.85,
    )
    got = {
        router: summarize(simulate(reqs, replace(base, router=router)).records)
        for router in ("round_robin", "pow2", "slo")
    }
    att = {router: got[router]["slo_attainment"] for router in got}
    assert att["slo"] > att["pow2"] + 0.05 and att["slo"] > att["round_robin"] + 0.05, att
    assert got["slo"]["refused"] < got["pow2"]["refused"] / 2, got


def test_holding_refused_requests_serves_them_once_streams_end() -> None:
    # The same load on power-of-two routing: a request its replica refuses for its TPOT is
    # held there (half its TTFT objective) and admitted when a stream ends, not refused.
    reqs = [
        replace(b, slo_tpot_ms=[30.0, 80.0, 400.0][b.trace.index % 3])
        for b in bench_requests(240, 0.03, prompt_words=16, out=48)
    ]
    got = {
        hold: summarize(
            simulate(
                reqs,
                setup(
                    "incremental",
                    LinearCost(),
                    max_num_seqs=256,
                    replicas=4,
                    admission="slo",
                    router="pow2",
                    admission_hold=hold,
                    admission_best_effort=0,  # what the hold alone does, against refusing
                    slo_headroom=0.85,  # where this load binds (the test above)
                ),
            ).records
        )
        for hold in (0.0, 0.5)
    }
    assert got[0.5]["refused"] < got[0.0]["refused"] / 2, got
    assert got[0.5]["slo_attainment"] > got[0.0]["slo_attainment"] + 0.05, got
    assert got[0.5]["slo_attainment"] >= 0.95, "the held requests met TTFT and TPOT once in"


def test_find_rate_brackets_the_rate_where_attainment_crosses_the_target() -> None:
    # A cluster whose attainment falls linearly from 100% at 10 rps to 0% at 50 rps meets 95%
    # up to 12 rps.
    seen = []

    def attainment(rps: float) -> float:
        seen.append(rps)
        return min(1.0, max(0.0, (50.0 - rps) / 40.0))

    found = find_rate(attainment, 0.95, 5.0, 80.0, tolerance=0.02)
    assert found.met is not None and found.missed is not None
    assert found.met <= 12.0 < found.missed <= found.met * 1.02
    assert [r for r, _ in found.probes] == seen, "every probe is reported, in order"
    assert all((att >= 0.95) == (r <= 12.0) for r, att in found.probes)
    # Out of the range on either side: said so, not clamped to a made-up rate.
    assert find_rate(attainment, 0.95, 20.0, 40.0) == RateFound(None, 20.0, ((20.0, 0.75),))
    assert find_rate(attainment, 0.95, 2.0, 8.0).met == 8.0
    assert find_rate(attainment, 0.95, 2.0, 8.0).missed is None
    with pytest.raises(ValueError, match="0 < low <= high"):
        find_rate(attainment, 0.95, 8.0, 2.0)
    with pytest.raises(ValueError, match="fraction"):
        find_rate(attainment, 95.0, 2.0, 8.0)


def write_linear_server(tmp_path: Path, n: int, gap_ms: float) -> None:
    """tmp_path/t.json: `n` requests `gap_ms` apart, 16-token prompts, 64 tokens out, 40-ms
    SLOs; tmp_path/p.json: a profile whose forward costs 20 ms + 0.5 ms a token."""
    trace = [
        {
            "emission_time_ms": gap_ms * i,
            "prompt": "word " * 16,
            "input_length": 16,
            "output_length": 64,
            "slo_ratio": -40.0,
        }
        for i in range(n)
    ]
    (tmp_path / "t.json").write_text(json.dumps(trace))
    target = tuple(LatencyPoint(t, 256, 20.0 + 0.5 * t) for t in (1, 2, 4, 8, 16, 32, 64, 128))
    Profile("cpu", "m", "d", target, (), 16, 1.5, 256, 20.5).save(tmp_path / "p.json")


def test_simulate_find_rate_reports_each_router_s_capacity(tmp_path: Path, capsys) -> None:
    from adaserve.cli import main

    # 2 replicas of a server whose forward is 20 ms + 0.5 ms a token, 40-ms streams (at most
    # 40 rows a replica, ~30 rps between the two): the search's probes are result lines, and
    # the table's bracket agrees with them.
    write_linear_server(tmp_path, 160, 100.0)
    out = tmp_path / "r.jsonl"
    argv = ["simulate", "--trace", str(tmp_path / "t.json"), "--policy", "incremental"]
    argv += ["--cost-model", str(tmp_path / "p.json"), "--replicas", "2"]
    argv += ["--router", "slo,pow2", "--admission", "slo", "--rps", "5,400"]
    argv += ["--find-rate", "0.95", "--rate-tolerance", "0.25", "--out", str(out)]
    assert main([*argv, "--no-progress"]) == 0
    table = capsys.readouterr().out
    results = [json.loads(x) for x in out.read_text().splitlines()]
    for router in ("slo", "pow2"):
        probes = {
            r["rps"]: r["slo_attainment"]
            for r in results
            if r["label"] == f"incremental x2 {router} (sim)"
        }
        assert probes[5.0] >= 0.95 > probes[400.0], probes
        met = max(rps for rps, att in probes.items() if att >= 0.95)
        missed = min(rps for rps, att in probes.items() if rps > met)
        assert probes[missed] < 0.95 and missed <= 1.25 * met, probes
        assert f"| incremental | {router} | 2 | {met:g} | {missed:g} |" in table, table
