"""`adaserve simulate --admission slo`: the server's default admission on the virtual clock."""

from __future__ import annotations

from adaserve.bench.report import summarize
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
    # Queueing everyone puts every stream past 40 ms; refusing keeps the admitted within it.
    assert q["tpot_slo_attainment"] < 0.5
    assert s["admitted_slo_attainment"] > 0.9
    assert s["slo_attainment"] > q["slo_attainment"]
