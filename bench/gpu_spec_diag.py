"""Where speculative policies spend an iteration's time on a GPU, against incremental.

On the first H100 run, adaserve with the default draft model ran 0.67x incremental at 1 and
4 requests with no draft step recorded (docs/results.md, "GPU (H100)"): the drafter failed on
every iteration. This runs incremental, sequence and adaserve on the default model with CUDA
graphs and `drafter="model"`, one engine per policy and concurrency, a warm-up of the same
shape before each measurement, and writes the iteration timelines
(`timeline_<policy>_<c>.jsonl`), a summary per row (`diag.json`, also printed) and, for
adaserve at one request, a profile (`profile.txt`, the 40 costliest functions by own time).

    python bench/gpu_spec_diag.py OUTDIR [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
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
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for policy in args.policies:
        for c in args.concurrency:
            timeline = out / f"timeline_{policy}_{c}.jsonl"
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
            prof = cProfile.Profile() if (policy, c) == ("adaserve", 1) else None
            if prof:
                prof.enable()
            tok_s = serve(engine, c)
            if prof:
                prof.disable()
                s = io.StringIO()
                pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(40)
                (out / "profile.txt").write_text(s.getvalue())
            sched.timeline.lines.close()
            ctl = sched.controller
            row = {"policy": policy, "concurrent": c, "tok_s": round(tok_s, 1)}
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


if __name__ == "__main__":
    main()
