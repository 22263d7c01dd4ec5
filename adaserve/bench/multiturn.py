"""Multi-turn chat replay: every turn resends the history; with vs without prefix caching.

    python -m adaserve.bench.multiturn [--conversations 4] [--turns 5] [--max-tokens 48]
        [--backend torch|ggml] [--ggml-kept-prefix-cells N]

Each conversation is a system prompt, then user turns answered by the model (greedy); turn
k sends the whole history through the chat template. Conversations take turns round-robin so
other traffic runs in between. Reports mean TTFT and prompt tokens computed per turn, and the
prefix-cache hit rate. Same prompts, same process, both configurations.
"""

from __future__ import annotations

import argparse
import statistics
import time

from adaserve import LLMEngine, SamplingParams
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig

SYSTEM = (
    "You are a careful assistant for a city library. Answer briefly and politely. The library "
    "opens at 9 am and closes at 8 pm on weekdays, 10 am to 5 pm on Saturdays, and is closed "
    "on Sundays. Members may borrow up to 12 items for three weeks and renew twice online."
)
QUESTIONS = [
    "When does the library open on Saturday?",
    "How many books can I borrow at once?",
    "Can I renew a book online?",
    "Is the library open on Sunday?",
    "How long can I keep a borrowed item?",
    "What time does it close on Wednesday?",
]


def replay(engine: LLMEngine, args: argparse.Namespace) -> dict[str, float]:
    histories = [[{"role": "system", "content": SYSTEM}] for _ in range(args.conversations)]
    ttfts, computed = [], []
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": QUESTIONS[(turn + c) % len(QUESTIONS)]})
            req = engine.add_request(engine.apply_chat_template(history), params)
            prefill = 0
            start = time.perf_counter()
            while engine.has_unfinished():
                engine.step()
                prefill += engine.last_stats.prefill_tokens if engine.last_stats else 0
            ttfts.append(req.metrics.ttft_s or time.perf_counter() - start)
            computed.append(prefill)
            text = engine.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)
            history.append({"role": "assistant", "content": text})
    prefix = engine.engine.target_prefix
    return {
        "ttft_ms": 1000 * statistics.mean(ttfts),
        "computed": statistics.mean(computed),
        "hit_rate": prefix.hit_tokens / max(1, prefix.queried_tokens) if prefix else 0.0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--backend", default="torch", choices=["torch", "ggml"])
    ap.add_argument(
        "--ggml-kept-prefix-cells",
        type=int,
        default=CacheConfig.ggml_kept_prefix_cells,
        help="cells the ggml backend keeps for ended requests (the server's flag)",
    )
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    print(
        f"{args.conversations} conversations x {args.turns} turns, greedy, up to "
        f"{args.max_tokens} tokens per answer, {args.backend} backend\n"
    )
    print("| prefix caching | mean TTFT ms | prompt tokens computed per turn | hit rate |")
    print("|---|---:|---:|---:|")
    for on in (False, True):
        engine = LLMEngine(
            ModelConfig(model=args.model, backend=args.backend),
            CacheConfig(
                enable_prefix_caching=on, ggml_kept_prefix_cells=args.ggml_kept_prefix_cells
            ),
            SchedulerConfig(policy="incremental"),
        )
        r = replay(engine, args)
        print(
            f"| {'on' if on else 'off'} | {r['ttft_ms']:.0f} | {r['computed']:.0f} "
            f"| {100 * r['hit_rate']:.0f}% |",
            flush=True,
        )


if __name__ == "__main__":
    main()
