"""Smoke runs against live servers: `adaserve bench` on 10 requests of the shared trace (default
model), and `adaserve bench sweep` over two policies on a tiny model. Every request must be
accounted for and every result line complete."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from adaserve.bench import command
from adaserve.bench.report import load_results
from tests.e2e.harness import serve_subprocess

pytestmark = pytest.mark.slow

WORKLOADS = Path(__file__).parents[2].parent / "shared" / "workloads"
TRACE = WORKLOADS / "mixed_rps3.0_ol256.json"
NUM_REQUESTS, OUTPUT_LENGTH = 10, 8

RESULT_KEYS = {
    "run_id", "label", "url", "model", "trace", "started_at", "rps", "offered_rps", "options",
    "notes", "duration_s", "requests", "completed", "failed", "attained", "slo_attainment",
    "per_category", "goodput_tok_s", "throughput_tok_s", "output_tokens", "tpot_ms_mean",
    "ttft_ms_p99", "errors", "server_metrics", "max_send_lag_ms",
}  # fmt: skip


def check_result(result: dict, requests: list[dict], n: int, tokens: int) -> None:
    missing = RESULT_KEYS - set(result)
    assert not missing, f"result line lacks {sorted(missing)}"
    assert result["requests"] == n and result["failed"] == 0, result["errors"]
    assert sum(c["requests"] for c in result["per_category"].values()) == n
    assert result["output_tokens"] == n * tokens, "ignore_eos: every request gives max_tokens"
    assert 0.0 <= result["slo_attainment"] <= 1.0
    assert result["goodput_tok_s"] <= result["throughput_tok_s"] + 1e-9
    counters = result["server_metrics"]
    assert counters is not None and counters["decode_iterations"] > 0, counters
    mine = [r for r in requests if r["run_id"] == result["run_id"]]
    assert len(mine) == n, f"{len(mine)} request records for {n} requests"
    for r in mine:
        assert r["completed"] and r["output_tokens"] == tokens, r
        assert len(r["token_times_s"]) == tokens and r["tpot_ms"] is not None


def test_bench_replays_ten_trace_requests_against_adaserve_serve(tmp_path: Path) -> None:
    if not TRACE.exists():
        pytest.skip(f"shared workload {TRACE} is not on this machine")
    out = tmp_path / "results.jsonl"
    # Plain queueing: this test counts the bench's bookkeeping, every request served.
    with serve_subprocess("--policy", "incremental", "--admission", "queue") as url:
        rc = command.main(
            ["--url", url, "--trace", str(TRACE), "--max-requests", str(NUM_REQUESTS)]
            + ["--output-length", str(OUTPUT_LENGTH), "--rps", "5", "--baseline-latency-ms", "100"]
            + ["--out", str(out), "--plot", str(tmp_path / "fig.png"), "--no-progress"]
        )
    assert rc == 0
    (result,) = load_results(out)
    requests = load_results(tmp_path / "results.requests.jsonl")
    check_result(result, requests, NUM_REQUESTS, OUTPUT_LENGTH)
    assert sorted(r["index"] for r in requests) == list(range(NUM_REQUESTS))
    assert set(result["per_category"]) <= {"ratio=1.2", "abs=50ms", "abs=150ms"}
    assert any("--output-length" in n for n in result["notes"]), result["notes"]
    assert (tmp_path / "fig.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_runs_every_policy_at_every_rate(tiny_llama: Path, tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.json"
    entries = [
        {"emission_time_ms": 100.0 * i, "prompt": "t5 t6 t7 t8", "output_length": 6}
        | {"slo_ratio": -50.0 if i % 2 else 2.0}
        for i in range(3)
    ]
    trace.write_text(json.dumps(entries))
    out = tmp_path / "sweep.jsonl"
    rc = command.main(
        ["sweep", "--model", str(tiny_llama), "--draft-model", str(tiny_llama)]
        + ["--policies", "incremental,sequence", "--rps", "5,20", "--trace", str(trace)]
        + ["--baseline-latency-ms", "40", "--server-args", "--num-blocks 64 --max-model-len 256"]
        + ["--out", str(out), "--server-log-dir", str(tmp_path / "logs"), "--no-progress"]
    )
    assert rc == 0, capsys.readouterr().err
    results = load_results(out)
    assert [(r["label"], r["rps"]) for r in results] == [
        ("incremental", 5.0),
        ("incremental", 20.0),
        ("sequence", 5.0),
        ("sequence", 20.0),
    ]
    requests = load_results(tmp_path / "sweep.requests.jsonl")
    for r in results:
        check_result(r, requests, 3, 6)
    spec = results[2]["server_metrics"]
    assert spec["draft_tokens"] > 0, f"the sequence policy's server did not speculate: {spec}"
    table = capsys.readouterr().out
    assert "| incremental | 5.00 |" in table and "| sequence | 20.00 |" in table, table
    assert (tmp_path / "sweep.png").exists(), "the sweep draws its plot by default"


def test_compare_calibrates_slos_then_runs_a_fresh_server_per_point(
    tiny_llama: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    """Without llama-server among the systems the first system is measured; every point
    (system x rate) gets its own server, and every record is judged on TTFT too. A point
    during which the machine ran slow (the speed probe after it 2x the fastest seen) is run
    again on a fresh server, its first line kept in the results but marked and not counted."""
    from adaserve.bench import compare

    # The probes in the order the comparison takes them: the reference, then before and after
    # each point; the first point's after-probe is slow (a shared host's load), once.
    probes = iter([(5.0, 10.0), (5.0, 10.0), (10.0, 11.0)] + [(5.2, 9.0)] * 20)
    monkeypatch.setattr(compare, "machine_speed", lambda: next(probes))
    trace = tmp_path / "trace.json"
    entries = [
        {"emission_time_ms": 100.0 * i, "prompt": f"t{i} t6 t7 t8", "output_length": 6}
        | {"slo_ratio": -50.0 if i % 2 else 2.0}
        for i in range(3)
    ]
    trace.write_text(json.dumps(entries))
    out, logs = tmp_path / "compare.jsonl", tmp_path / "logs"
    rc = command.main(
        ["compare", "--model", str(tiny_llama), "--systems", "incremental,adaserve"]
        + ["--rps", "5,20", "--trace", str(trace), "--calibration-requests", "2"]
        # Plain queueing: this test counts the comparison's bookkeeping, every request served
        # (on a tiny model the calibrated SLOs are a few ms, where refusals are a coin flip).
        + ["--server-args", "--num-blocks 64 --max-model-len 256 --admission queue"]
        + ["--out", str(out), "--server-log-dir", str(logs), "--no-progress"]
    )
    captured = capsys.readouterr()
    err = captured.err
    assert rc == 0, err
    lines = load_results(out)
    assert [(r["label"], r["rps"], r["rerun"]) for r in lines] == [
        ("incremental", 5.0, True),
        ("incremental", 5.0, False),
        ("adaserve", 5.0, False),
        ("incremental", 20.0, False),
        ("adaserve", 20.0, False),
    ]
    assert lines[0]["machine_slowdown"] == pytest.approx(2.0), "10 ms of products over 5"
    assert "ran 2.00x slower" in err and "run again on a fresh server" in err, err
    # The rerun's probes were fast; the reference follows the fastest probe (copies: 9 ms).
    assert lines[1]["machine_slowdown"] == pytest.approx(5.2 / 5.0)
    assert lines[1]["machine_probe_ms"]["reference"] == [5.0, 9.0]
    assert "ran while the machine was slow" not in captured.out, "the rerun was not slow"
    results = [r for r in lines if not r["rerun"]]
    assert len(list(logs.glob("*-rps*.log"))) == 5, "one fresh server per point and rerun"
    assert (logs / "calibration.log").exists(), "the SLOs were not calibrated on a server"
    baseline = results[0]["slo_baseline_ms"]
    assert all(r["slo_baseline_ms"] == baseline for r in results), "one scale for every system"
    assert results[0]["options"]["slo_scale"] == pytest.approx(baseline / 30.0)
    requests = load_results(tmp_path / "compare.requests.jsonl")
    for r in results:
        check_result(r, requests, 3, 6)
        assert r["prefill_ms_per_token"] > 0 and r["ttft_judged"] == 3
    for q in requests:
        expected = 1000.0 + 4.0 * q["prompt_tokens"] * q["prefill_ms_per_token"]
        assert q["ttft_objective_ms"] == pytest.approx(expected)
        assert q["slo_attained"] == (q["tpot_attained"] and q["ttft_ms"] <= expected)
    assert (tmp_path / "compare.png").exists()


def test_compare_names_what_is_missing_without_a_llama_server(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(
        json.dumps([{"emission_time_ms": 0, "prompt": "a", "output_length": 2, "slo_ratio": 0}])
    )
    rc = command.main(
        ["compare", "--trace", str(trace), "--systems", "llama-server", "--llama-server", ""]
    )
    assert rc == 2 and "--llama-server PATH" in capsys.readouterr().err


def test_llama_server_runs_the_same_gguf_with_its_slots_and_ngram_flags() -> None:
    from adaserve.bench.compare import system_command

    args = command_args(["compare", "--model", "m.gguf", "--llama-server", "/bin/ls"])
    plain = system_command(args, "llama-server", 8100)
    assert plain[:3] == ["/bin/ls", "-m", "m.gguf"] and "--spec-type" not in plain
    assert plain[plain.index("-np") + 1] == "16" and plain[plain.index("--port") + 1] == "8100"
    ngram = system_command(args, "llama-server-ngram", 8101)
    assert ngram[-2:] == ["--spec-type", "ngram-simple"]
    ada = system_command(args, "incremental", 8102)
    assert "m.gguf" in ada and ada[ada.index("--policy") + 1] == "incremental"


def test_the_comparison_plot_shows_every_system_inside_every_panel() -> None:
    from adaserve.bench.compare import compare_figure
    from adaserve.bench.plot import pyplot

    def point(system: str, rps: float, tpot: float, ttft: float, tok_s: float) -> dict:
        return {
            "system": system, "rps": rps, "slo_attainment": 0.5, "tpot_slo_attainment": 0.6,
            "goodput_tok_s": tok_s / 2, "throughput_tok_s": tok_s, "ttft_ms_p50": ttft,
            "ttft_ms_p99": 3 * ttft, "tpot_ms_p50": tpot, "tpot_ms_p90": 2 * tpot,
        }  # fmt: skip

    # adaserve is drawn first and is the smaller on every panel but attainment: the panels
    # must still reach llama-server's 300 ms TPOT and 22 s TTFT.
    results = [
        point("adaserve", 0.5, 53.0, 1_000.0, 14.0),
        point("adaserve", 1.0, 54.0, 1_000.0, 18.0),
        point("llama-server", 0.5, 300.0, 9_700.0, 26.0),
        point("llama-server", 1.0, 290.0, 22_000.0, 31.0),
    ]
    fig = compare_figure(results)
    try:
        tops = [ax.get_ylim()[1] for ax in fig.axes[:4]]
    finally:
        pyplot().close(fig)
    assert tops[0] >= 60.0  # TPOT-only attainment, %
    assert tops[1] >= 31.0  # llama-server's throughput
    assert tops[2] >= 66.0  # its TTFT p99, s
    assert tops[3] >= 600.0  # its TPOT p90, ms


def test_rounds_rotate_the_systems_and_the_table_shows_each_points_mean() -> None:
    """With --rounds each system takes each slot of a rate in turn, and the table pools a
    point's rounds: mean figures, the attainment's range, and adaserve's ratios to the better
    llama-server and to incremental."""
    from adaserve.bench.compare import compare_table, point_order, pooled

    order = point_order(["adaserve", "incremental", "llama-server"], [0.5, 1.0], 3)
    assert len(order) == 18
    firsts = [system for r, rps, system in order if rps == 0.5][::3]
    assert firsts == ["adaserve", "incremental", "llama-server"], order
    assert [rps for _, rps, _ in order[:6]] == [0.5] * 3 + [1.0] * 3, "rate by rate"

    def point(system: str, att: float, ttft: float, tok_s: float, rnd: int) -> dict:
        return {
            "system": system, "rps": 0.5, "round": rnd, "slo_attainment": att,
            "tpot_slo_attainment": att, "ttft_ms_p50": ttft, "ttft_ms_p99": 2 * ttft,
            "tpot_ms_p50": 10.0, "tpot_ms_p90": 20.0, "throughput_tok_s": tok_s,
            "goodput_tok_s": att * tok_s, "refused": 2 * rnd,
            "per_category": {"ratio=1.2": {"slo_attainment": att}},
        }  # fmt: skip

    results = [
        point("adaserve", 0.75, 400.0, 30.0, 0),
        point("adaserve", 0.95, 600.0, 34.0, 1),
        point("incremental", 0.80, 500.0, 30.0, 0),
        point("incremental", 0.80, 500.0, 30.0, 1),
        point("llama-server", 0.50, 300.0, 40.0, 0),
        point("llama-server", 0.70, 300.0, 40.0, 1),
        point("llama-server-ngram", 0.60, 250.0, 40.0, 0),
    ]
    by = {r["system"]: r for r in pooled(results)}
    ada = by["adaserve"]
    assert ada["rounds"] == 2 and ada["slo_attainment"] == pytest.approx(0.85)
    assert ada["slo_attainment_range"] == (0.75, 0.95) and ada["refused"] == pytest.approx(1.0)
    assert ada["per_category"]["ratio=1.2"]["slo_attainment"] == pytest.approx(0.85)
    assert by["llama-server-ngram"] is results[-1], "a point run once stays as it ran"
    table = compare_table(results)
    assert "| adaserve | 0.50 | 85.0% (75.0%-95.0%, 2 rounds) |" in table, table
    assert table.count("| adaserve |") == 1, "one row per point"
    # The better peer is plain llama-server (60% mean against ngram's 60%: the first wins a
    # tie); 0.85 / 0.60, TTFT 500 / 300, throughput 32 / 40; incremental 0.85 / 0.80.
    assert (
        "adaserve at 0.50 rps vs llama-server: attainment 1.42x, TTFT p50 1.67x, throughput "
        "0.80x; vs incremental: attainment 1.06x" in table
    ), table


def test_the_table_names_points_kept_while_the_machine_was_slow() -> None:
    """A point slow again after its rerun is kept, and the table says so; one within
    --max-slowdown, or measured with the check off (0), is not named."""
    from adaserve.bench.compare import compare_table, faster, slowdown

    assert slowdown([(5.0, 10.0), (6.0, 25.0)], (5.0, 10.0)) == pytest.approx(2.5), "copies"
    assert faster((5.0, 12.0), (6.0, 10.0)) == (5.0, 10.0)

    def point(system: str, slow: float, limit: float) -> dict:
        return {
            "system": system, "rps": 1.0, "round": 0, "slo_attainment": 0.5,
            "throughput_tok_s": 30.0, "machine_slowdown": slow, "max_slowdown": limit,
        }  # fmt: skip

    table = compare_table(
        [point("adaserve", 1.6, 1.3), point("incremental", 1.2, 1.3), point("llama-server", 3, 0)]
    )
    assert (
        "ran while the machine was slow (a fixed CPU task over --max-slowdown): adaserve @ "
        "1.00 rps round 0 (1.60x)" in table
    ), table
    assert "incremental @" not in table and "llama-server @" not in table


def command_args(argv: list[str]):
    import argparse

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    return p.parse_args(argv)
