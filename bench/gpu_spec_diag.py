"""Where speculative policies spend an iteration's time on a GPU, against incremental.

On the first H100 run, adaserve with the default draft model ran 0.67x incremental at 1 and
4 requests with no draft step recorded (docs/results.md, "GPU (H100)"): the drafter failed on
every iteration. This runs incremental, sequence and adaserve on the default model with CUDA
graphs and `drafter="model"`, one engine per policy and concurrency, a warm-up of the same
shape before each measurement, and writes the iteration timelines
(`timelines.tar.gz`: `timeline_<policy>_<c>_<round>.jsonl`), a summary per row (`diag.json`,
also printed: tokens/s, medians per iteration, the graphs the target and the draft model
captured during the measured pass) and, for the rows named by `--profile` (default
adaserve at one request), a profile of round 0 (`profile_<policy>_<c>.txt`, the 40
costliest functions by own time; a profiled row runs slower: compare round 1).
`--rounds R` measures every row R times, the policies' order reversed in every other round
(the first in a round ran faster on the CPU).

    python bench/gpu_spec_diag.py OUTDIR [--device cuda] [--dtype bfloat16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tarfile
import time
from pathlib import Path

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.prompts import prompts
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from adaserve.request_manager.timeline import IterationTimeline

MAX_TOKENS = 64


def serve(engine: LLMEngine, c: int) -> float:
    for p in prompts(c):
        engine.add_request(
            p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        )
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.delta_token_ids)
    return tokens / (time.perf_counter() - start)


def summary(path: Path) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    dec = [r for r in rows if r["kind"] == "decode" and not r["prompt_tokens"]]
    med = lambda k: round(1000 * statistics.median(r[k] or 0.0 for r in dec), 3)  # noqa: E731
    return {
        "decode_iterations": len(dec),
        "drafted_iterations": sum(r["draft_s"] > 0 for r in dec),
        "tree_tokens": sum(r["tree_tokens"] for r in dec),
        "accepted": sum(r["accepted"] for r in dec),
        "padded_over_forward": sum(r["padded_tokens"] - r["forward_tokens"] for r in dec),
        "median_ms": {k: med(k) for k in ("total_s", "forward_s", "draft_s", "host_s")},
        "median_predicted_ms": med("predicted_forward_s"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--policies", nargs="+", default=["incremental", "sequence", "adaserve"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument(
        "--profile",
        nargs="*",
        default=["adaserve:1"],
        help="POLICY:CONCURRENT rows to profile in round 0 (profile_POLICY_CONCURRENT.txt)",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    timelines = []
    rows = [
        (rnd, policy, c)
        for rnd in range(args.rounds)
        for c in args.concurrency
        for policy in (args.policies if rnd % 2 == 0 else args.policies[::-1])
    ]
    for rnd, policy, c in rows:
        timeline = out / f"timeline_{policy}_{c}_{rnd}.jsonl"
        timelines.append(timeline)
        warm = out / f"warm_{policy}_{c}.jsonl"
        engine = LLMEngine(
            ModelConfig(dtype=args.dtype, device=args.device, drafter="model"),
            CacheConfig(enable_prefix_caching=False),
            SchedulerConfig(policy=policy, max_num_seqs=16, record_iterations=str(warm)),
        )
        serve(engine, c)  # warm-up: graphs captured, cost model fitted
        sched = engine.scheduler
        assert sched.timeline is not None
        sched.timeline.lines.close()
        sched.timeline = IterationTimeline(timeline, sched.timeline.pace_margin)
        graphs = [getattr(r, "graphs", None) for r in (engine.engine.target, engine.engine.draft)]
        held = [g.num_graphs if g is not None else 0 for g in graphs]
        prof = cProfile.Profile() if rnd == 0 and f"{policy}:{c}" in args.profile else None
        if prof:
            prof.enable()
        tok_s = serve(engine, c)
        if prof:
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
            (out / f"profile_{policy}_{c}.txt").write_text(s.getvalue())
        sched.timeline.lines.close()
        ctl = sched.controller
        row = {"round": rnd, "policy": policy, "concurrent": c, "tok_s": round(tok_s, 1)}
        row["graphs_captured_in_pass"] = [
            (g.num_graphs if g is not None else 0) - h for g, h in zip(graphs, held)
        ]
        row.update(summary(timeline))
        if ctl is not None and hasattr(ctl, "score"):
            row["control"] = {
                "score": round(ctl.score, 3),
                "num_scored": ctl.num_scored,
                "skipped_drafts": ctl.num_skipped_drafts,
                "iteration": ctl.iteration,
                "off_until": ctl.off_until,
            }
        row["draft_failures"] = sched.planner.num_draft_failures
        results.append(row)
        print(json.dumps(row), flush=True)
        warm.unlink(missing_ok=True)
        del engine
    (out / "diag.json").write_text(json.dumps(results, indent=1))
    with tarfile.open(out / "timelines.tar.gz", "w:gz") as tar:
        for t in timelines:
            tar.add(t, arcname=t.name)
            t.unlink()


if __name__ == "__main__":
    main()
