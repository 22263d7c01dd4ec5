"""One benchmark point: workload flags -> prepared trace -> replay -> one result line.

Shared by `adaserve bench` (one server, given by URL) and `adaserve bench sweep` (servers it
starts itself), so both write the same result records.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from adaserve.bench.plot import plot_results
from adaserve.bench.replay import DEFAULT_REQUEST_TIMEOUT_S, replay
from adaserve.bench.report import RequestRecord, format_table, load_results, summarize
from adaserve.bench.trace import (
    BenchRequest,
    TraceOptions,
    TraceRequest,
    describe_options,
    load_trace,
    mean_rate,
    prepare,
)

DEFAULT_RESULTS = "bench-results.jsonl"
# Bumped when a field of the result line changes meaning.
RESULT_VERSION = 1


def _rps_list(text: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be numbers separated by commas, got {text!r}"
        ) from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"every RPS must be > 0, got {text!r}")
    return values


def add_workload_arguments(p: argparse.ArgumentParser, simulated: bool = False) -> None:
    """Trace, shrinking options and outputs (the flags bench, bench sweep and simulate share;
    `simulated` leaves out what only a network client needs)."""
    # Not required=True: argparse would then demand it before `sweep` too; run() checks it.
    p.add_argument(
        "--trace", default=None, help="trace file in the AdaServe emission format (required)"
    )
    p.add_argument(
        "--rps",
        type=_rps_list,
        default=None,
        help="rescale arrivals to R requests/s keeping the pattern; a comma list runs one "
        "replay per rate (default: the trace's own rate)",
    )
    p.add_argument("--duration", type=float, default=None, help="replay only the first S seconds")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="play the trace N times back to back (before --max-requests and --rps), for "
        "more requests than it holds, e.g. many simulated replicas",
    )
    p.add_argument("--max-requests", type=int, default=None, help="replay at most N requests")
    p.add_argument(
        "--output-length", type=int, default=None, help="cap every request's max_tokens at L"
    )
    slo = p.add_mutually_exclusive_group()
    slo.add_argument(
        "--baseline-latency-ms",
        type=float,
        default=None,
        help="baseline latency that converts relative SLOs (slo_ratio > 0) to ms",
    )
    slo.add_argument(
        "--profile",
        default=None,
        help="take the baseline latency from this `adaserve profile` JSON instead",
    )
    p.add_argument(
        "--slo-scale",
        type=float,
        default=1.0,
        help="multiply absolute SLOs (slo_ratio < 0) by X, e.g. for slower hardware",
    )
    p.add_argument("--out", default=DEFAULT_RESULTS, help="append one result line per run here")
    p.add_argument(
        "--requests-out",
        default=None,
        help="append one line per request here (default: OUT with .requests.jsonl)",
    )
    p.add_argument("--plot", default=None, help="draw attainment and goodput vs RPS to this PNG")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    if simulated:
        return
    p.add_argument(
        "--prefill-ms-per-token",
        type=float,
        default=None,
        help="the machine's prefill speed, for default TTFT objectives (floor + factor x "
        "prompt tokens x this; docs/benchmarks.md); default: measured on the server before "
        "each point",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds a stream may stay silent before its request counts as failed",
    )
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    p.add_argument(
        "--client-retries",
        type=int,
        default=0,
        metavar="N",
        help="send a refused request (429, 503, ...) again up to N times after the server's "
        "Retry-After, as the official openai client does by default (N = 2); the wait counts "
        "in its TTFT (default 0: a refusal is final)",
    )


def baseline_from_args(args: argparse.Namespace) -> float | None:
    if args.profile is not None:
        from adaserve.request_manager.control.profile import Profile

        return Profile.load(args.profile).baseline_latency_ms
    return args.baseline_latency_ms


def load_trace_arg(args: argparse.Namespace) -> list[TraceRequest]:
    if args.trace is None:
        raise ValueError("--trace FILE is required (a trace in the AdaServe emission format)")
    return load_trace(args.trace)


def trace_options(args: argparse.Namespace, rps: float | None) -> TraceOptions:
    return TraceOptions(
        rps=rps,
        duration_s=args.duration,
        max_requests=args.max_requests,
        output_length=args.output_length,
        baseline_latency_ms=baseline_from_args(args),
        slo_scale=args.slo_scale,
        repeat=args.repeat,
    )


def requests_path(args: argparse.Namespace) -> Path:
    if args.requests_out is not None:
        return Path(args.requests_out)
    out = Path(args.out)
    return out.with_name(out.name.removesuffix(".jsonl") + ".requests.jsonl")


def append_jsonl(path: Path, rows: Sequence[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def prepare_point(
    args: argparse.Namespace, trace: Sequence[TraceRequest], rps: float | None
) -> list[BenchRequest]:
    """The requests of one point (the trace cut and rescaled by the flags); never empty."""
    reqs = prepare(trace, trace_options(args, rps))
    if not reqs:
        raise ValueError("no request is left after --duration/--max-requests; loosen them")
    return reqs


def finish_report(args: argparse.Namespace, results: Sequence[dict]) -> None:
    """After the points: the table (several points), where results went, the plot."""
    if len(results) > 1:
        print(format_table(results))
    print(f"results appended to {args.out}", file=sys.stderr)
    if args.plot:
        # The whole results file: runs of other servers or policies become other lines.
        print(f"wrote {plot_results(load_results(args.out), args.plot)}", file=sys.stderr)


def prefill_probe(trace: Sequence[TraceRequest]) -> str:
    """A prompt to time prefill with: the longest of `trace`, behind a line of its own so that no
    replayed prompt shares a prefix (and prefix-cache blocks) with it."""
    return "Prefill speed probe.\n" + max((t.prompt for t in trace), key=len)


def run_point(
    args: argparse.Namespace,
    url: str,
    trace: Sequence[TraceRequest],
    rps: float | None,
    label: str | None,
    model: str | None = None,
    extra: dict | None = None,
    finish: Callable[[], dict] | None = None,
) -> dict:
    """Replay the trace once at `rps`, append its result (and its requests); returns the result.
    `finish`: called after the replay, what it returns is added to the result (after `extra`)."""
    reqs = prepare_point(args, trace, rps)
    offered = mean_rate([r.send_time_s for r in reqs])
    desc = f"{label or 'bench'} @ {rps if rps is not None else offered or 0:.3g} rps"
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    model, records, counters = asyncio.run(
        replay(
            url,
            reqs,
            model,
            api_key=args.api_key,
            timeout_s=args.timeout,
            progress=not args.no_progress,
            desc=desc,
            prefill_ms_per_token=args.prefill_ms_per_token,
            # The longest prompt this point replays: the range its TTFT objectives judge (the
            # trace's longest, ~2,000 tokens in the shared one, took 20 s to time on ggml).
            measure_prefill=prefill_probe([r.trace for r in reqs]),
            retries=args.client_retries,
        )
    )
    label = label or model
    result = result_line(args, trace, reqs, rps, label, url, model, records, started)
    result.update(server_metrics=counters, **(extra or {}))
    if finish is not None:
        result.update(finish())
    append_jsonl(Path(args.out), [result])
    append_requests(args, result, records)
    return result


def result_line(
    args: argparse.Namespace,
    trace: Sequence[TraceRequest],
    reqs: Sequence[BenchRequest],
    rps: float | None,
    label: str,
    url: str | None,
    model: str,
    records: Sequence[RequestRecord],
    started: str,
) -> dict:
    """One result line: what was asked, what was replayed and `summarize(records)`.

    `adaserve bench` (url: the server) and `adaserve simulate` (url None) both write it."""
    opts = trace_options(args, rps)
    offered = mean_rate([r.send_time_s for r in reqs])
    return {
        "version": RESULT_VERSION,
        "run_id": f"{label}-rps{rps if rps is not None else 'trace'}-{started}",
        "label": label,
        "url": url,
        "model": model,
        "trace": str(args.trace),
        "started_at": started,
        # The rate asked for, else the replayed requests' own (offered_rps: what was sent).
        "rps": rps if rps is not None else offered,
        "offered_rps": offered,
        "trace_rps": mean_rate([r.emission_time_ms / 1000.0 for r in trace]),
        "options": {
            "rps": opts.rps,
            "duration_s": opts.duration_s,
            "max_requests": opts.max_requests,
            "output_length": opts.output_length,
            "baseline_latency_ms": opts.baseline_latency_ms,
            "slo_scale": opts.slo_scale,
            # Sends per refused request beyond the first (absent: the simulator's, none).
            "client_retries": getattr(args, "client_retries", None),
        },
        "notes": describe_options(opts, trace),
        # The prefill speed behind default TTFT objectives (None: TTFT not judged).
        "prefill_ms_per_token": next(
            (r.prefill_ms_per_token for r in records if r.prefill_ms_per_token is not None),
            None,
        ),
        **summarize(records),
    }


def append_requests(
    args: argparse.Namespace, result: dict, records: Sequence[RequestRecord]
) -> None:
    """Append one line per request (tagged with the run) to the per-request file."""
    tag = {"run_id": result["run_id"], "label": result["label"], "rps": result["rps"]}
    append_jsonl(requests_path(args), [{**tag, **r.to_json()} for r in records])


def one_line(result: dict) -> str:
    """A short human summary of one result."""
    att, good, rps = result["slo_attainment"], result["goodput_tok_s"], result["rps"]
    return (
        f"{result['label']} @ {'-' if rps is None else f'{rps:.3g}'} rps: "
        f"{result['requests']} requests, "
        f"{result['failed']} failed, SLO attainment "
        f"{'-' if att is None else f'{100 * att:.1f}%'}, goodput "
        f"{'-' if good is None else f'{good:.1f}'} tok/s"
    )
