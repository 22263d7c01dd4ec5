"""Trace parsing (both SLO kinds), RPS rescaling, and the options that shrink a trace."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from adaserve.bench.trace import (
    TraceOptions,
    describe_options,
    load_trace,
    mean_rate,
    parse_trace,
    prepare,
    rescale_rps,
)


def entry(t_ms: float, slo_ratio: float, out: int = 16, prompt: str = "hi") -> dict:
    return {
        "emission_time_ms": t_ms,
        "prompt": prompt,
        "input_length": 3,
        "output_length": out,
        "slo_ratio": slo_ratio,
    }


TRACE = [entry(0.0, 1.2), entry(500.0, -50.0), entry(1000.0, -150.0), entry(4000.0, 1.2, out=64)]


def test_parse_both_slo_kinds_and_name_categories(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    path.write_text(json.dumps(TRACE))
    reqs = load_trace(path)
    assert [r.slo_category for r in reqs] == ["ratio=1.2", "abs=50ms", "abs=150ms", "ratio=1.2"]
    opts = TraceOptions(baseline_latency_ms=40.0, slo_scale=2.0)
    slos = [b.slo_tpot_ms for b in prepare(reqs, opts)]
    # ratio x baseline for relative SLOs; -ratio ms x slo_scale for absolute ones.
    assert slos == pytest.approx([48.0, 100.0, 300.0, 48.0]), slos


def test_relative_slo_without_baseline_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match="--baseline-latency-ms"):
        prepare(parse_trace(TRACE), TraceOptions())
    # Absolute SLOs alone need no baseline.
    assert len(prepare(parse_trace(TRACE[1:3]), TraceOptions())) == 2


def test_zero_ratio_means_no_slo() -> None:
    (req,) = prepare(parse_trace([entry(0.0, 0.0)]), TraceOptions())
    assert req.slo_tpot_ms is None and req.slo_category == "none"


@pytest.mark.parametrize(
    "bad, message",
    [
        ([], "non-empty JSON list"),
        ([{"prompt": "x"}], "lacks emission_time_ms"),
        ([entry(-1.0, 1.0)], "emission_time_ms must be >= 0"),
        ([entry(0.0, 1.0, out=0)], "output_length must be >= 1"),
        ([{**entry(0.0, 1.0), "output_length": "many"}], "wrong type"),
    ],
)
def test_bad_traces_are_refused_with_the_reason(bad: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_trace(bad)


def test_shared_trace_parses_if_present() -> None:
    path = Path(__file__).parents[2].parent / "shared" / "workloads" / "mixed_rps3.0_ol256.json"
    if not path.exists():
        pytest.skip(f"shared workload {path} is not on this machine")
    reqs = load_trace(path)
    cats = {r.slo_category for r in reqs}
    assert cats == {"ratio=1.2", "abs=50ms", "abs=150ms"}, cats
    rate = mean_rate([r.emission_time_ms / 1000 for r in reqs])
    assert rate == pytest.approx(3.0, rel=0.05), f"the rps3.0 trace has rate {rate}"


@settings(max_examples=60, deadline=None)
@given(
    gaps=st.lists(st.floats(0.0, 10.0), min_size=2, max_size=40),
    rps=st.floats(0.05, 50.0),
)
# A span so short its rate overflows to inf: the old factor rate/rps made 0 x inf = NaN.
@example(gaps=[0.0, 5e-324, 5e-324], rps=1.0)
def test_rescaling_keeps_order_and_reaches_the_mean_rate(gaps: list[float], rps: float) -> None:
    times = [sum(gaps[: i + 1]) for i in range(len(gaps))]
    scaled = rescale_rps(times, rps)
    assert scaled[0] == 0.0, "the replay starts with the first request"
    assert all(a <= b for a, b in zip(scaled, scaled[1:])), "arrival order changed"
    if mean_rate(times) is not None:
        assert mean_rate(scaled) == pytest.approx(rps, rel=1e-9), "mean rate is not the target"
        # Same pattern: every gap is the same fraction of the span as before.
        span, new_span = times[-1] - times[0], scaled[-1]
        for t, s in zip(times, scaled):
            assert s / new_span == pytest.approx((t - times[0]) / span, abs=1e-9)


def test_count_cut_then_rescale_then_duration_cut() -> None:
    reqs = parse_trace(TRACE)  # native rate: 3 gaps over 4 s = 0.75 rps
    # At 1.5 rps everything happens twice as fast: sends at 0, 0.25, 0.5, 2.0 s.
    out = prepare(reqs, TraceOptions(rps=1.5, duration_s=1.0, baseline_latency_ms=10.0))
    assert [r.send_time_s for r in out] == pytest.approx([0.0, 0.25, 0.5])
    # The first 3 (sends at 0, 0.5, 1.0 s) rescaled to 4 rps: the replayed part has that rate.
    out = prepare(reqs, TraceOptions(rps=4.0, max_requests=3, baseline_latency_ms=10.0))
    assert [r.send_time_s for r in out] == pytest.approx([0.0, 0.25, 0.5])
    assert mean_rate([r.send_time_s for r in out]) == pytest.approx(4.0)
    out = prepare(reqs, TraceOptions(max_requests=2, output_length=20, baseline_latency_ms=10.0))
    assert [r.trace.index for r in out] == [0, 1], "max_requests keeps the first N"
    assert [r.max_tokens for r in out] == [16, 16], "output_length caps, never raises"
    capped = prepare(reqs, TraceOptions(output_length=20, baseline_latency_ms=10.0))
    assert capped[-1].max_tokens == 20


def test_every_shrinking_option_is_stated() -> None:
    opts = TraceOptions(
        rps=2.0,
        duration_s=30.0,
        max_requests=5,
        output_length=8,
        baseline_latency_ms=40.0,
        slo_scale=3.0,
        repeat=2,
    )
    text = " ".join(describe_options(opts, parse_trace(TRACE)))
    for flag in (
        "--rps",
        "--duration",
        "--max-requests",
        "--output-length",
        "--slo-scale",
        "--repeat",
    ):
        assert flag in text, f"{flag} is not reported: {text}"
    assert "40 ms" in text, "the baseline used for relative SLOs is not reported"


def test_repeat_plays_the_trace_back_to_back() -> None:
    reqs = parse_trace(TRACE)  # sends at 0, 0.5, 1, 4 s: span 4 s, mean gap 4 / 3 s
    out = prepare(reqs, TraceOptions(repeat=3, baseline_latency_ms=10.0))
    times = [r.send_time_s for r in out]
    period = 4.0 + 4.0 / 3
    assert len(out) == 12 and times == sorted(times), times
    assert times[4:8] == pytest.approx([t + period for t in times[:4]]), "copy 2 is copy 1 later"
    assert [r.trace.index for r in out] == list(range(12)), "every copy's requests their own index"
    assert [r.slo_tpot_ms for r in out[8:]] == [r.slo_tpot_ms for r in out[:4]]
    # Then the other options as before: the first 6 of the tiled trace, at 2 rps.
    out = prepare(reqs, TraceOptions(repeat=3, max_requests=6, rps=2.0, baseline_latency_ms=10))
    assert len(out) == 6 and mean_rate([r.send_time_s for r in out]) == pytest.approx(2.0)


@pytest.mark.parametrize(
    "kw",
    [
        {"rps": 0.0},
        {"slo_scale": -1.0},
        {"max_requests": 0},
        {"duration_s": float("inf")},
        {"repeat": 0},
    ],
)
def test_bad_options_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError, match="must be"):
        TraceOptions(**kw)
