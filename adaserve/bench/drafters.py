"""Drafters on real text: incremental vs speculative policies per trace category, same run.

    python -m adaserve.bench.drafters [--trace T] [--concurrency 1 4] [--per-category 4]
        [--categories summarization code] [--device cuda --dtype bfloat16]

Prompts are the first `--per-category` x concurrency summarization, code and instruction
requests of the shared trace, sent through the chat template, greedy, stopping at EOS or
`--max-tokens`. Every configuration serves the same prompts in the same process, `--rounds`
times. By default (`--schedule interleaved`) the configurations' engines serve side by side,
their steps alternating one by one, each timed on its own steps, and each reports its totals
over the rounds: a slow moment of the machine then hits every configuration alike (here two
identical engines differ by ~2% this way, passes a minute apart by up to 20%).
`--schedule sequential` runs one pass after another, each configuration keeping its fastest
round. By default (`--scenario new`) each pass runs
on a fresh engine that has never seen its prompts or their answers (`bench/passes.py`), and
the ratio to incremental is end to end, from submission to the last token, prefill included:
what a new user's traffic meets. `--scenario repeated` keeps one engine per configuration for
the whole run (traffic that repeats: the suffix index then holds earlier answers). Prints a
markdown table: end-to-end and decode tokens/s, the end-to-end ratio to incremental (and its
range over the rounds), the ratio of the mean request latency (submission to last token, on
the engine's own clock) to incremental's, accepted tokens and draft time per decode iteration.
Tokens/s over a pass is decided by the pass's last request; the mean latency by every request.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.passes import SCENARIOS, EnginePool, add_totals, own_clock, turns
from adaserve.bench.trace import load_trace
from adaserve.config import DTYPES, CacheConfig, ModelConfig, SchedulerConfig
from adaserve.heap import frozen_heap

DEFAULT_TRACE = (
    Path(__file__).resolve().parents[2].parent / "shared/workloads/mixed_rps3.0_ol256.json"
)
CATEGORIES = ("summarization", "code", "instruction")


def category(prompt: str) -> str:
    """The trace's three sources: CNN/DailyMail, HumanEval, Alpaca-style instructions."""
    if prompt.startswith("Please generate a summarization"):
        return "summarization"
    if "def " in prompt and ('"""' in prompt or "'''" in prompt):
        return "code"
    return "instruction"


@dataclass
class Result:
    tokens: int
    seconds: float
    decode_tokens: int
    decode_s: float
    decode_iterations: int
    accepted: int
    draft_s: float
    requests: int = 0
    latency_s: float = 0.0  # summed over requests: submission to last token, own clock

    @property
    def mean_latency_s(self) -> float:
        return self.latency_s / max(self.requests, 1)

    def add(self, other: Result) -> None:
        add_totals(self, other)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / max(self.decode_s, 1e-9)


class Pass:
    """One engine serving `prompts` greedily, `concurrency` in flight, one step at a time; its
    seconds are the time spent in its own steps (admission included)."""

    def __init__(
        self,
        engine: LLMEngine,
        prompts: list[list[int]],
        concurrency: int,
        max_tokens: int,
        staggered: bool = False,
        ignore_eos: bool = False,
    ) -> None:
        self.engine, self.concurrency = engine, concurrency
        self.clock = own_clock(engine)  # the engine's time: its own steps only
        self.params = [
            SamplingParams(
                max_tokens=output_limit(max_tokens, i, staggered),
                temperature=0.0,
                ignore_eos=ignore_eos,
            )
            for i in range(len(prompts))
        ]
        self.pending = list(prompts)
        self.result = Result(0, 0.0, 0, 0.0, 0, 0, 0.0)
        self.submitted: dict[str, float] = {}  # request id -> own-clock time it was added

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished()

    @property
    def in_flight(self) -> int:
        """Requests submitted and not finished: waiting, being prefilled, or decoding."""
        sched = self.engine.scheduler
        return len(sched.waiting) + len(sched.prefilling) + len(sched.running)

    def step(self) -> None:
        engine, r = self.engine, self.result
        with self.clock.running():
            start = time.perf_counter()
            # A request being prefilled is in flight too: counting only the running and the
            # waiting let a second prompt in while the first was prefilled, so `--concurrency
            # 1` served two at once whenever max_num_seqs allowed it (any run with a larger
            # concurrency beside it); measured, one request's cell then said 1.02x where it
            # was 1.26x served alone.
            while self.pending and self.in_flight < self.concurrency:
                params = self.params[len(self.params) - len(self.pending)]
                req = engine.add_request(self.pending.pop(0), params)
                self.submitted[req.request_id] = self.clock()
            outs = engine.step()
            r.seconds += time.perf_counter() - start
            done_at = self.clock()
        r.tokens += sum(len(o.delta_token_ids) for o in outs)
        for o in outs:
            if o.finished:
                r.requests += 1
                r.latency_s += done_at - self.submitted.pop(o.request_id)
        s = engine.last_stats
        if s is not None and s.kind == "decode":
            r.decode_tokens += s.emitted_tokens
            r.decode_s += s.total_s
            r.decode_iterations += s.num_requests
            r.accepted += s.accepted_tokens
            r.draft_s += s.draft_s


def output_limit(max_tokens: int, i: int, staggered: bool) -> int:
    """Prompt i's max_tokens: all alike, or staggered (5/8, 7/8, 9/8, 11/8 of it in turn, the
    same mean), so requests started together do not all finish together."""
    return max_tokens if not staggered else max(1, max_tokens * (5 + 2 * (i % 4)) // 8)


def serve(
    engine: LLMEngine,
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    staggered: bool = False,
    ignore_eos: bool = False,
) -> Result:
    """Serve `prompts` keeping `concurrency` in flight; greedy."""
    return serve_side_by_side([engine], prompts, concurrency, max_tokens, staggered, ignore_eos)[0]


def serve_side_by_side(
    engines: list[LLMEngine],
    prompts: list[list[int]],
    concurrency: int,
    max_tokens: int,
    staggered: bool = False,
    ignore_eos: bool = False,
) -> list[Result]:
    """Each engine serves the same `prompts`, their steps interleaved one by one, each timed
    on its own steps and reading a clock that runs only during them (`passes.OwnClock`). A
    slow moment of a shared machine (this one moves 10-20% between passes a minute apart)
    then falls on every configuration alike: two identical engines served this way differ by
    ~2%, in passes one after another by up to 20%."""
    passes = [Pass(e, prompts, concurrency, max_tokens, staggered, ignore_eos) for e in engines]
    with frozen_heap():  # as in a server: full collector passes skip what start-up built
        while not all(p.done for p in passes):
            for p in passes:
                if not p.done:
                    p.step()
    return [p.result for p in passes]


def parse_config(entry: str) -> tuple[str, str, dict[str, Any]]:
    """A `--configs` entry, `policy[:drafter][,field=value...]`: its policy, drafter ("" for
    the default) and `SchedulerConfig` fields to set, each value read as the type of the
    field's default (`adaserve:suffix,explore_budget=0.01`: a knob against the default,
    side by side in one run). Raises ValueError naming an unknown field or a bad value."""
    head, *sets = entry.split(",")
    policy, _, drafter = head.partition(":")
    known = {f.name: f.default for f in fields(SchedulerConfig)}
    overrides: dict[str, Any] = {}
    for item in sets:
        name, eq, text = item.partition("=")
        if not eq or name not in known:
            raise ValueError(
                f"--configs {entry!r}: {item!r} is not field=value of a SchedulerConfig field"
            )
        default = known[name]
        try:
            if isinstance(default, bool):
                if text not in ("true", "false"):
                    raise ValueError(text)
                overrides[name] = text == "true"
            elif isinstance(default, (int, float, str)):
                overrides[name] = type(default)(text)
            else:
                raise ValueError(text)
        except ValueError:
            raise ValueError(
                f"--configs {entry!r}: {name} takes {type(default).__name__} values, not {text!r}"
            ) from None
    return policy, drafter, overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--per-category", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--lengths",
        choices=("same", "staggered"),
        default="same",
        help="same: every request up to --max-tokens; staggered: 5/8, 7/8, 9/8, 11/8 of it in "
        "turn, so requests started together do not all finish (and free the cache) together",
    )
    ap.add_argument(
        "--ignore-eos",
        action="store_true",
        help="every request runs to its max_tokens past the end-of-sequence token (#35's "
        "measurement: requests started together finish together under incremental decoding); "
        "default: a request ends at its EOS, so outputs differ in length",
    )
    ap.add_argument("--budget", type=int, default=SchedulerConfig.budget)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["incremental", "adaserve:suffix", "adaserve_paper:suffix"],
        help="policy[:drafter][,field=value...] entries (SchedulerConfig fields to set, e.g. "
        "adaserve:suffix,explore_budget=0.01); the first is the baseline",
    )
    ap.add_argument(
        "--scenario",
        choices=SCENARIOS,
        default="new",
        help="new: a fresh engine per pass, prompts it has never seen; repeated: one engine per "
        "configuration for the whole run (traffic that repeats)",
    )
    ap.add_argument(
        "--categories",
        nargs="+",
        choices=CATEGORIES,
        default=list(CATEGORIES),
        help="trace categories to serve, in this order",
    )
    ap.add_argument("--backend", default="auto", choices=("auto", "torch", "ggml"))
    ap.add_argument("--device", default="cpu", help="cpu or cuda (cuda: the torch backend)")
    ap.add_argument("--dtype", default="float32", choices=DTYPES)
    ap.add_argument(
        "--record-iterations",
        metavar="DIR",
        default=None,
        help="append each configuration's iteration timelines to DIR/<policy>_<drafter>.jsonl "
        "(_<field>-<value> added for each field a config sets; every pass of it; see "
        "request_manager/timeline.py)",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds over the configurations (interleaved: each reports its totals; "
        "sequential: its fastest round)",
    )
    ap.add_argument(
        "--schedule",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved: the configurations' engines serve side by side, their steps "
        "alternating, each timed on its own steps; sequential: one pass after another",
    )
    args = ap.parse_args()
    stagger = args.lengths == "staggered"
    trace = load_trace(args.trace)

    def factory(entry: str) -> Callable[[], LLMEngine]:
        policy, drafter, overrides = parse_config(entry)
        timeline = None
        if args.record_iterations:
            name = f"{policy}_{drafter or 'auto'}" + "".join(
                f"_{k}-{v}" for k, v in overrides.items()
            )
            timeline = str(Path(args.record_iterations) / f"{name}.jsonl")
        return lambda: LLMEngine(
            ModelConfig(
                model=args.model,
                drafter=drafter or "auto",
                backend=args.backend,
                device=args.device,
                dtype=args.dtype,
            ),
            CacheConfig(),
            SchedulerConfig(
                policy=policy,
                budget=args.budget,
                max_num_seqs=max(args.concurrency),
                record_iterations=timeline,
                **overrides,
            ),
        )

    factories = {}
    for entry in args.configs:
        factories[entry] = factory(entry)
    pool = EnginePool(args.scenario, factories)
    tok = pool.engine(args.configs[0])  # any engine tokenizes; it serves nothing measured
    by_cat: dict[str, list[list[int]]] = {c: [] for c in CATEGORIES}
    for req in trace:
        bucket = by_cat[category(req.prompt)]
        if len(bucket) < args.per_category * max(args.concurrency):
            bucket.append(tok.apply_chat_template([{"role": "user", "content": req.prompt}]))
    print(
        f"budget {args.budget}, greedy, up to {args.max_tokens} tokens, "
        f"{args.per_category} x concurrency prompts per category, scenario {args.scenario}, "
        f"backend {args.backend} on {args.device} ({args.dtype}), {args.rounds} rounds, "
        f"{args.schedule}, "
        f"{args.lengths} lengths{', EOS ignored' if args.ignore_eos else ''}\n"
    )
    print(
        "| category | concurrent | config | tok/s | decode tok/s | vs incremental "
        "| per round | mean latency vs incremental | accepted/iter | draft ms/iter |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for cat in args.categories:
        for c in args.concurrency:
            prompts = by_cat[cat][: args.per_category * c]
            total = {entry: Result(0, 0.0, 0, 0.0, 0, 0, 0.0) for entry in pool.labels}
            best: dict[str, Result] = {}
            ratios: dict[str, list[float]] = {entry: [] for entry in pool.labels}
            for i in range(args.rounds):
                order = turns(pool.labels, i)  # no configuration always runs (steps) first
                if args.schedule == "interleaved":
                    engines = [pool.engine(entry) for entry in order]
                    served = serve_side_by_side(
                        engines, prompts, c, args.max_tokens, stagger, args.ignore_eos
                    )
                    del engines
                else:
                    served = [
                        serve(
                            pool.engine(entry),
                            prompts,
                            c,
                            args.max_tokens,
                            stagger,
                            args.ignore_eos,
                        )
                        for entry in order
                    ]
                by_label = dict(zip(order, served))
                results = [by_label[entry] for entry in pool.labels]
                for entry, r in zip(pool.labels, results):
                    ratios[entry].append(r.tokens_per_s / results[0].tokens_per_s)
                    total[entry].add(r)
                    if entry not in best or r.seconds < best[entry].seconds:
                        best[entry] = r
            # Interleaved: each configuration's totals over the rounds (the passes were paired);
            # sequential: its fastest round.
            shown = total if args.schedule == "interleaved" else best
            base = shown[pool.labels[0]].tokens_per_s
            base_latency = shown[pool.labels[0]].mean_latency_s
            for entry, r in shown.items():
                iters = max(1, r.decode_iterations)
                spread = f"{min(ratios[entry]):.2f}-{max(ratios[entry]):.2f}"
                print(
                    f"| {cat} | {c} | {entry} | {r.tokens_per_s:.1f} | {r.decode_tokens_per_s:.1f} "
                    f"| {r.tokens_per_s / base:.2f}x | {spread} "
                    f"| {r.mean_latency_s / max(base_latency, 1e-9):.2f}x "
                    f"| {r.accepted / iters:.2f} "
                    f"| {1000 * r.draft_s / iters:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
