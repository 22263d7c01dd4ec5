"""The counter names the benchmark reads are the ones the server exports."""

from __future__ import annotations

import pytest

from adaserve.api.metrics import ServerMetrics
from adaserve.bench.server_metrics import (
    ACCEPTED_TOKENS,
    DRAFT_TOKENS,
    DRAFTS,
    HOST_SECONDS,
    ITERATIONS,
    delta_summary,
    parse_counters,
)
from adaserve.config import ServerConfig
from adaserve.request_manager.stats import IterationStats


def test_names_match_what_the_server_renders() -> None:
    m = ServerMetrics(ServerConfig().slo_classes)
    for _ in range(2):
        stats = IterationStats(
            "decode", num_requests=3, num_tokens=12, tree_tokens=9, accepted_tokens=4, depth=2
        )
        stats.host_s = 0.004
        m.observe_iteration(stats)
    m.observe_iteration(IterationStats("prefill", num_requests=1, num_tokens=30, host_s=0.001))
    m.observe_iteration(IterationStats("decode", num_requests=1, num_tokens=1))  # after idle
    text = m.render().decode()
    for name in (ACCEPTED_TOKENS, DRAFT_TOKENS, DRAFTS, ITERATIONS, HOST_SECONDS):
        assert name in text, f"the server no longer exports {name}; update server_metrics.py"
    got = parse_counters(text)
    assert got.pop("host_seconds") == pytest.approx(0.009)
    assert got == {
        "decode_iterations": 3.0,
        "accepted_tokens": 8.0,
        "draft_tokens": 18.0,
        "drafts": 6.0,
        "host_iterations": 3.0,  # the iteration after an idle engine has no host time
    }, got
    before = {**got, "host_seconds": 0.0, "host_iterations": 0.0}
    after = {**got, "host_seconds": 0.009}
    assert delta_summary(before, after)["mean_host_overhead_ms"] == pytest.approx(3.0)


def test_foreign_prefixes_are_found_and_absence_is_empty() -> None:
    vllm = "vllm:spec_decode_num_accepted_tokens_total 7\nvllm:spec_decode_num_drafts_total 2\n"
    assert parse_counters(vllm) == {"accepted_tokens": 7.0, "drafts": 2.0}
    assert parse_counters("some_other_metric 1\n") == {}
