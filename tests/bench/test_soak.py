"""The soak tool against a real server over a tiny model: every outcome expected, resources
sampled, KV back to zero, exit 0 after SIGTERM (the 30-minute run is in docs/results.md)."""

from __future__ import annotations

import json

from adaserve.bench.soak import main, summarize


def test_a_short_soak_sees_only_expected_outcomes(tiny_llama, tmp_path, capsys) -> None:
    out = tmp_path / "soak.jsonl"
    code = main(
        [str(tiny_llama), "--duration-s", "12", "--interval-s", "2", "--clients", "3"]
        + ["--out", str(out), "--plot", str(tmp_path / "soak.png"), "--warmup-s", "2"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["exit_code"] == 0 and report["kv_used_after"] == 0, report
    kinds = {k.split(":")[0] for k in report["outcomes"]}
    assert kinds == {"stream", "plain", "chat", "drop", "bad"}, report["outcomes"]
    samples = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(samples) >= 4 and all(s["rss_mib"] > 0 and s["fds"] > 0 for s in samples)
    assert (tmp_path / "soak.png").stat().st_size > 0


def test_growth_is_flagged() -> None:
    flat = [{"t_s": i, "rss_mib": 500.0, "fds": 20, "threads": 9, "kv_used": 3} for i in range(40)]
    leak = [{**s, "rss_mib": 500.0 + 10 * s["t_s"], "fds": 20 + s["t_s"]} for s in flat]
    assert all(r["flat"] for r in summarize(flat, 0).values())
    grown = summarize(leak, 0)
    assert not grown["rss_mib"]["flat"] and not grown["fds"]["flat"]
    assert grown["threads"]["flat"]
