"""SLO attainment, goodput and throughput arithmetic on records with known answers."""

from __future__ import annotations

import pytest

from adaserve.bench.report import RequestRecord, format_table, summarize


def rec(
    index: int,
    category: str,
    slo_ms: float | None,
    sent: float,
    first: float,
    last: float,
    tokens: int,
    error: str | None = None,
) -> RequestRecord:
    """A request sent at `sent` whose tokens arrived evenly from `first` to `last`."""
    times = [first + (last - first) * i / max(1, tokens - 1) for i in range(tokens)]
    return RequestRecord(
        index=index,
        slo_category=category,
        slo_tpot_ms=slo_ms,
        max_tokens=tokens,
        scheduled_s=sent,
        sent_s=sent,
        token_times_s=times,
        output_tokens=tokens,
        end_s=last if tokens else first,
        finish_reason=None if error else "length",
        error=error,
    )


# A 10-second run (first send at 0, last reply at 10).
RECORDS = [
    # abs=50ms: TPOT 40 ms (met), 60 ms (missed).
    rec(0, "abs=50ms", 50.0, 0.0, 0.5, 0.5 + 0.04 * 10, 11),
    rec(1, "abs=50ms", 50.0, 1.0, 1.2, 1.2 + 0.06 * 10, 11),
    # ratio=1.25 (62.5 ms): TPOT exactly at the SLO (met), one token (met trivially).
    rec(2, "ratio=1.25", 62.5, 2.0, 2.5, 3.5, 17),
    rec(3, "ratio=1.25", 62.5, 3.0, 3.1, 3.1, 1),
    # abs=150ms: failed (HTTP 429, no tokens) -> counted, not attained; a met one ends at 10 s.
    rec(4, "abs=150ms", 150.0, 4.0, 4.0, 4.0, 0, error="HTTP 429: queue full"),
    rec(5, "abs=150ms", 150.0, 5.0, 6.0, 10.0, 41),
]


def test_attainment_counts_failures_and_one_token_requests() -> None:
    s = summarize(RECORDS)
    assert s["requests"] == 6 and s["completed"] == 5 and s["failed"] == 1
    assert s["attained"] == 4, "met: #0 (40 ms), #2 (at the SLO), #3 (one token), #5 (100 ms)"
    assert s["slo_attainment"] == pytest.approx(4 / 6)
    per = s["per_category"]
    assert per["abs=50ms"]["slo_attainment"] == pytest.approx(0.5)
    assert per["ratio=1.25"]["slo_attainment"] == pytest.approx(1.0)
    assert per["abs=150ms"]["slo_attainment"] == pytest.approx(0.5), "a failure is not attained"
    assert per["abs=150ms"]["failed"] == 1
    assert per["abs=50ms"]["slo_tpot_ms"] == 50.0
    assert s["errors"] == {"HTTP 429: queue full": 1}


def test_goodput_counts_only_attaining_requests_over_the_run() -> None:
    s = summarize(RECORDS)
    assert s["duration_s"] == pytest.approx(10.0)
    # Output tokens: 11 + 11 + 17 + 1 + 0 + 41 = 81; of attaining requests 11 + 17 + 1 + 41 = 70.
    assert s["output_tokens"] == 81 and s["attained_output_tokens"] == 70
    assert s["throughput_tok_s"] == pytest.approx(8.1)
    assert s["goodput_tok_s"] == pytest.approx(7.0)
    assert s["per_category"]["abs=50ms"]["goodput_tok_s"] == pytest.approx(1.1)
    assert s["request_throughput_rps"] == pytest.approx(0.5)


def test_tpot_and_ttft_are_measured_from_token_arrivals() -> None:
    r = RECORDS[1]
    assert r.tpot_ms == pytest.approx(60.0) and r.ttft_s == pytest.approx(0.2)
    assert RECORDS[3].tpot_ms is None, "one token has no TPOT"
    s = summarize(RECORDS)
    # TPOTs of requests with >= 2 tokens: 40, 60, 62.5, 100.
    assert s["tpot_ms_mean"] == pytest.approx(65.625)
    assert s["tpot_ms_p50"] == pytest.approx(61.25)


def test_no_slo_attains_when_completed() -> None:
    ok = rec(0, "none", None, 0.0, 1.0, 9.0, 5)
    bad = rec(1, "none", None, 0.0, 0.0, 0.0, 0, error="boom")
    assert ok.slo_attained and not bad.slo_attained


def test_record_json_has_derived_fields() -> None:
    d = RECORDS[0].to_json()
    for key in ("tpot_ms", "ttft_ms", "e2e_ms", "slo_attained", "completed", "token_times_s"):
        assert key in d, f"record JSON lacks {key}"
    assert d["slo_attained"] is True and d["tpot_ms"] == pytest.approx(40.0)


def test_table_has_a_row_per_run_with_every_category() -> None:
    s = summarize(RECORDS)
    runs = [{**s, "label": "adaserve", "rps": 2.0}, {**s, "label": "incremental", "rps": 1.0}]
    lines = format_table(runs).splitlines()
    assert len(lines) == 4, lines
    assert "att. abs=50ms" in lines[0] and "att. ratio=1.25" in lines[0]
    assert lines[2].startswith("| adaserve | 2.00 |") and "66.7%" in lines[2]


def test_refused_requests_are_counted_apart_from_the_admitted() -> None:
    records = [
        rec(0, "urgent", 100.0, 0.0, 0.1, 1.0, 10),  # 100 ms TPOT: attained
        rec(1, "urgent", 100.0, 0.0, 0.1, 3.0, 10),  # 322 ms: missed
        rec(2, "urgent", 100.0, 0.0, 0.0, 0.0, 0, error="HTTP 429: slo_tpot_ms 100 cannot ..."),
        rec(3, "urgent", 100.0, 0.0, 0.0, 0.0, 0, error="HTTP 503: draining"),
        rec(4, "urgent", 100.0, 0.0, 0.0, 0.0, 0, error="ReadTimeout: ..."),
    ]
    s = summarize(records)
    assert s["refused"] == 2
    assert s["slo_attainment"] == pytest.approx(1 / 5)
    assert s["admitted_slo_attainment"] == pytest.approx(1 / 3), "a timeout is no refusal"
    assert s["best_effort"] == 0 and s["promised_slo_attainment"] == pytest.approx(1 / 3)
    # The server said it served request 1 best effort: the promised ones met theirs.
    records[1].best_effort = True
    s = summarize(records)
    assert s["best_effort"] == 1 and s["promised_slo_attainment"] == pytest.approx(1 / 2)
    assert s["admitted_slo_attainment"] == pytest.approx(1 / 3)


def test_attainment_counts_the_first_token_against_its_objective() -> None:
    """TPOT met in every case; TTFT decides. Objective: floor 1000 ms + 4 x prompt x 2 ms."""

    def with_ttft(sent: float, first: float, prompt: int, own: float | None = None):
        r = rec(0, "abs=50ms", 50.0, sent, first, first + 0.04 * 10, 11)
        r.prompt_tokens, r.prefill_ms_per_token, r.slo_ttft_ms = prompt, 2.0, own
        return r

    fast = with_ttft(0.0, 0.5, 100)  # objective 1000 + 800 = 1800 ms, TTFT 500 ms: met
    late = with_ttft(0.0, 2.0, 100)  # TTFT 2000 ms > 1800 ms: the stream is lost
    long = with_ttft(0.0, 2.0, 500)  # objective 1000 + 4000 ms: a long prompt may take longer
    own = with_ttft(0.0, 0.5, 500, own=400.0)  # its own slo_ttft_ms 400 ms beats the default
    assert [r.ttft_objective_ms for r in (fast, late, long, own)] == [1800, 1800, 5000, 400]
    s = summarize([fast, late, long, own])
    assert [r.slo_attained for r in (fast, late, long, own)] == [True, False, True, False]
    assert s["slo_attainment"] == pytest.approx(0.5), "joint attainment counts the first token"
    assert s["tpot_slo_attainment"] == pytest.approx(1.0), "the TPOT-only figure ignores it"
    assert s["ttft_judged"] == 4
    unjudged = rec(1, "abs=50ms", 50.0, 0.0, 9.0, 9.4, 11)  # no prefill speed known
    assert unjudged.ttft_objective_ms is None and unjudged.slo_attained


def test_figures_without_matplotlib_name_the_extra_to_install(monkeypatch):
    """matplotlib is the `plot` extra, not a core dependency: asking for a figure without it
    says what to install instead of failing on a bare import."""
    import sys

    from adaserve.bench.plot import pyplot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ImportError, match=r"pip install 'adaserve\[plot\]'"):
        pyplot()
