"""Prefill stalls: a stream with a TPOT SLO decodes while long prompts arrive; chunked vs whole.

    python -m adaserve.bench.stall [--slos 150 300 600] [--prompt-tokens 1000] [--arrivals 3]

For each SLO and each mode (chunked prefill, whole-prompt prefill), in one process: one
stream (greedy, `--stream-tokens` tokens) starts decoding; after `--warm` of its tokens,
`--arrivals` prompts of `--prompt-tokens` tokens arrive at once. Reports the stream's worst
and p99 inter-token gap and its TPOT, and the long prompts' mean TTFT. Markdown table.
"""

from __future__ import annotations

import argparse
import statistics

from adaserve import LLMEngine, SamplingParams
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig


def one_run(engine: LLMEngine, slo_ms: float, args: argparse.Namespace) -> dict[str, float]:
    stream = engine.add_request(
        "Write a long story about a lighthouse keeper.",
        SamplingParams(
            max_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True, slo_tpot_ms=slo_ms
        ),
    )
    while len(stream.output_token_ids) < args.warm:
        engine.step()
    vocab = engine.engine.vocab_size
    longs = [
        engine.add_request(
            [(1000 + 97 * i + 13 * j) % vocab for j in range(args.prompt_tokens)],
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
        for i in range(args.arrivals)
    ]
    while engine.has_unfinished():
        engine.step()
    times = stream.metrics.token_times
    gaps = sorted(1000 * (b - a) for a, b in zip(times, times[1:]))
    return {
        "max_gap": gaps[-1],
        "p99_gap": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "tpot": stream.metrics.tpot_ms or 0.0,
        "ttft": 1000 * statistics.mean(r.metrics.ttft_s or 0.0 for r in longs),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--policy", default="incremental")
    ap.add_argument("--slos", type=float, nargs="+", default=[150.0, 300.0, 600.0])
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--arrivals", type=int, default=3)
    ap.add_argument("--stream-tokens", type=int, default=96)
    ap.add_argument("--warm", type=int, default=8)
    args = ap.parse_args()
    engines = {
        mode: LLMEngine(
            ModelConfig(model=args.model),
            CacheConfig(enable_prefix_caching=False),
            SchedulerConfig(policy=args.policy, chunked_prefill=mode == "chunked"),
        )
        for mode in ("whole prompt", "chunked")
    }
    print(
        f"{args.policy}, {args.arrivals} prompts x {args.prompt_tokens} tokens arriving while a "
        f"stream decodes\n"
    )
    print(
        "| stream SLO ms | prefill | max gap ms | p99 gap ms | stream TPOT ms "
        "| long-prompt TTFT ms |"
    )
    print("|---:|---|---:|---:|---:|---:|")
    for slo in args.slos:
        for mode, engine in engines.items():
            r = one_run(engine, slo, args)
            print(
                f"| {slo:g} | {mode} | {r['max_gap']:.0f} | {r['p99_gap']:.0f} | {r['tpot']:.0f} "
                f"| {r['ttft']:.0f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
