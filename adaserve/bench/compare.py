"""`adaserve bench compare`: adaserve against llama.cpp's own server, same GGUF, same machine.

    adaserve bench compare --trace T.json --rps 0.5,1 --max-requests 48 --output-length 64 \
        --llama-server /path/to/llama-server [--systems adaserve,incremental,llama-server,...]

Systems (--systems, comma list):
  adaserve            `adaserve serve` as a user starts it (default policy and drafter)
  incremental         `adaserve serve --policy incremental` (no speculation)
  llama-server        llama-server with 16 slots (-np 16), the same threads, flash attention
  llama-server-ngram  the same with its n-gram speculation (--spec-type ngram-simple)

Every point (system x rate) runs on a fresh server: started, warmed up with one short
request, replayed, stopped. SLOs are scaled to this machine before the first point: one
llama-server measures the single-stream TPOT t1 (--calibration-requests requests, one at a
time) and the prefill speed; the trace's relative SLOs use baseline latency
--slo-factor x t1 (or --baseline-latency-ms), its absolute ones are multiplied by
baseline / 30 ms (they were set for a server whose baseline is 30 ms; or --slo-scale), and
every request gets the default TTFT objective from its prompt length and the measured
prefill speed (or --prefill-ms-per-token; docs/benchmarks.md). The same numbers go
to every system. Results append to --out (one line per point, labelled by system), then the
table (attainment joint, TPOT-only and by class; TTFT p50/p99; TPOT p50/p90; throughput;
goodput; refusals), one line per rate comparing adaserve with the better llama-server and
with incremental, and a four-panel plot of the same.

With --rounds N every point runs N times, the systems' order rotated by one each round
(`point_order`): on a shared 2-core VM the machine's speed drifts over minutes (the same
server's one-row forwards took 6-7 ms in one replay and 9-11 ms in the next, recorded
2026-11-29), and a fixed order hands one system the same slot of the drift every time. The
table and plot then show each point's mean over its rounds, with the range of its
attainment (`pooled`).

The machine's speed is also measured, before and after every point, by a fixed CPU task
(`machine_speed`: float32 matrix products and a memory copy) against the same task before the
first point. A point during which the machine ran over --max-slowdown (1.3x) slower is run
again once on a fresh server (its first line stays in --out, marked `rerun`); if it is slow
again it is kept and the table names it. The reference is the fastest the machine has been. Seen
2026-12-04: one adaserve point's one-row forwards took 28-38 ms, where the same server took
11-13 ms in runs minutes later, and the point read as a loss to llama-server (0.86x) that a
normal-speed run of the same command turned into a win (1.34x).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx

from adaserve.bench.passes import turns
from adaserve.bench.replay import measure_prefill_ms_per_token
from adaserve.bench.report import load_results
from adaserve.bench.sweep import (
    DEFAULT_STARTUP_TIMEOUT_S,
    comma_choices,
    finish_runs,
    free_port,
    running_server,
    warm_up,
)
from adaserve.bench.trace import TraceRequest
from adaserve.bench.workload import (
    add_workload_arguments,
    load_trace_arg,
    one_line,
    prefill_probe,
    prepare_point,
    run_point,
)

SYSTEMS = ("adaserve", "incremental", "llama-server", "llama-server-ngram")
# Absolute SLOs in the AdaServe traces were set for a server whose baseline latency is this.
TRACE_BASELINE_MS = 30.0
# llama-server's parallel slots (continuous batching) and its context, shared by the slots.
LLAMA_SLOTS = 16
LLAMA_CONTEXT = 32768
CALIBRATION_TOKENS = 64
CALIBRATION_ATTEMPTS = 2
# The machine-speed probe (`machine_speed`): products of a float32 matrix of this side, copies
# of this many bytes, the median of this many samples (~0.3 s in all on 2 cores).
PROBE_MATRIX = 384
PROBE_PRODUCTS = 8
PROBE_BYTES = 32 << 20
PROBE_COPIES = 4
PROBE_SAMPLES = 5
DEFAULT_MAX_SLOWDOWN = 1.3
SLOW_POINT_RETRIES = 1


def _systems(text: str) -> list[str]:
    return comma_choices(text, SYSTEMS, "systems")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--systems",
        type=_systems,
        default=list(SYSTEMS),
        help=f"comma list (default: {','.join(SYSTEMS)})",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the GGUF file every system serves (default: the default model's; adaserve "
        "systems also take a checkpoint dir, llama-server needs a GGUF)",
    )
    p.add_argument(
        "--llama-server",
        default=os.environ.get("LLAMA_SERVER") or shutil.which("llama-server"),
        help="llama.cpp's llama-server binary (default: $LLAMA_SERVER, else on PATH)",
    )
    p.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="threads for each system"
    )
    p.add_argument(
        "--slo-factor",
        type=float,
        default=3.0,
        help="baseline latency = this x the measured single-stream TPOT (relative SLOs are "
        "slo_ratio x baseline)",
    )
    p.add_argument("--calibration-requests", type=int, default=3)
    p.add_argument(
        "--server-args", default=None, help="more `adaserve serve` flags, one quoted string"
    )
    p.add_argument("--startup-timeout", type=float, default=DEFAULT_STARTUP_TIMEOUT_S)
    p.add_argument("--server-log-dir", default=None, help="keep server logs here")
    p.add_argument(
        "--max-slowdown",
        type=float,
        default=DEFAULT_MAX_SLOWDOWN,
        help="run a point again (once) when a fixed CPU task timed before or after it ran "
        "this many times slower than before the first point (a shared host's other load); "
        "0: never",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="run every point N times, the systems' order rotated each round; the table "
        "shows each point's mean and its attainment's range",
    )
    add_workload_arguments(p)


def gguf_path(args: argparse.Namespace) -> str:
    if args.model is not None:
        return args.model
    from adaserve.exec.default_model import default_gguf_file

    return str(default_gguf_file())


def system_command(args: argparse.Namespace, system: str, port: int) -> list[str]:
    """The command line that serves `system` on `port`."""
    if system.startswith("llama-server"):
        if not args.llama_server:
            raise ValueError(
                "no llama-server binary: pass --llama-server PATH or set LLAMA_SERVER "
                "(docs/benchmarks.md says how to build one)"
            )
        cmd = [args.llama_server, "-m", gguf_path(args), "--host", "127.0.0.1"]
        cmd += ["--port", str(port), "-np", str(LLAMA_SLOTS), "-c", str(LLAMA_CONTEXT)]
        cmd += ["-t", str(args.threads), "-fa", "on", "--no-webui"]
        return cmd + (["--spec-type", "ngram-simple"] if system.endswith("ngram") else [])
    cmd = [sys.executable, "-m", "adaserve.cli", "serve"]
    cmd += [args.model] if args.model else []  # none: exactly the default `adaserve serve`
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "warning"]
    if system == "incremental":
        cmd += ["--policy", "incremental"]
    return cmd + shlex.split(args.server_args or "")


async def _single_stream_tpot_ms(url: str, prompts: Sequence[str], tokens: int) -> float:
    """Median TPOT of greedy requests sent one at a time (each timed from first to last token)."""
    tpots = []
    # A fresh connection per request: llama-server closed a kept-alive one after a long stream
    # (2026-12-03/04: the third calibration request of a run, "Server disconnected without
    # sending a response", on most first attempts).
    fresh = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=600.0, limits=fresh) as client:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True}
            body["ignore_eos"] = True
            times = []
            async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if line.startswith("data:") and '"text"' in line:
                        times.append(time.perf_counter())
            if len(times) >= 2:
                tpots.append(1000.0 * (times[-1] - times[0]) / (len(times) - 1))
    if not tpots:
        raise RuntimeError(f"{url} streamed no tokens while measuring its TPOT")
    return statistics.median(tpots)


async def _prefill_speed(url: str, prompt: str) -> float:
    async with httpx.AsyncClient(timeout=600.0) as client:
        r = await client.get(f"{url}/v1/models")
        r.raise_for_status()
        model = str(r.json()["data"][0]["id"])
        return await measure_prefill_ms_per_token(client, url, model, prompt, {})


def calibrate(
    args: argparse.Namespace, trace: Sequence[TraceRequest], log_dir: Path
) -> tuple[float, float]:
    """(single-stream TPOT ms, prefill ms per token), measured on one llama-server (or on
    the first system when llama-server is not among them)."""
    system = next((s for s in args.systems if s == "llama-server"), args.systems[0])
    for attempt in range(CALIBRATION_ATTEMPTS):
        cmd = system_command(args, system, free_port())
        try:
            with running_server(cmd, log_dir / "calibration.log", args.startup_timeout) as url:
                warm_up(url, None)
                prompts = [t.prompt for t in trace[: args.calibration_requests]]
                tpot = asyncio.run(_single_stream_tpot_ms(url, prompts, CALIBRATION_TOKENS))
                prefill = asyncio.run(_prefill_speed(url, prefill_probe(trace)))
            break
        except httpx.HTTPError as exc:  # once seen: llama-server exited mid-calibration
            if attempt + 1 == CALIBRATION_ATTEMPTS:
                raise RuntimeError(f"calibration on {system} failed: {exc}") from exc
            print(f"[calibration] {exc}; a fresh server tries again", file=sys.stderr)
    print(
        f"[calibration on {system}] single-stream TPOT {tpot:.1f} ms, prefill "
        f"{prefill:.3f} ms/token",
        file=sys.stderr,
        flush=True,
    )
    return tpot, prefill


def machine_speed() -> tuple[float, float]:
    """The machine's speed now: (ms of PROBE_PRODUCTS products of a PROBE_MATRIX-square float32
    matrix on numpy's BLAS threads, ms of PROBE_COPIES copies of PROBE_BYTES), each the median
    of PROBE_SAMPLES; what a CPU forward waits on, compute and memory."""
    import numpy as np

    a = np.random.default_rng(0).standard_normal((PROBE_MATRIX, PROBE_MATRIX), np.float32)
    src = np.ones(PROBE_BYTES // 4, np.float32)
    dst = np.empty_like(src)
    products, copies = [], []
    for _ in range(PROBE_SAMPLES):
        t = time.perf_counter()
        for _ in range(PROBE_PRODUCTS):
            a @ a
        products.append(1000.0 * (time.perf_counter() - t))
        t = time.perf_counter()
        for _ in range(PROBE_COPIES):
            np.copyto(dst, src)
        copies.append(1000.0 * (time.perf_counter() - t))
    return statistics.median(products), statistics.median(copies)


def faster(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """Part by part, the faster of two `machine_speed` probes."""
    return min(a[0], b[0]), min(a[1], b[1])


def slowdown(probes: Sequence[Sequence[float]], reference: Sequence[float]) -> float:
    """How many times slower than `reference` the slowest of `probes` (`machine_speed`) ran,
    by its slower part."""
    return max(p / r for probe in probes for p, r in zip(probe, reference))


def _cell(x: float | None, fmt: str, scale: float = 1.0) -> str:
    return "-" if x is None else format(scale * x, fmt)


def point_order(
    systems: Sequence[str], rates: Sequence[float | None], rounds: int
) -> list[tuple[int, float | None, str]]:
    """(round, rate, system) in the order the points run: round by round, rate by rate, the
    systems rotated by one each round (`turns`), so with rounds a multiple of the systems each
    system runs in each slot equally often."""
    return [
        (r, rps, system)
        for r in range(rounds)
        for rps in rates
        for system in turns(list(systems), r)
    ]


# The figures a pooled point shows as the mean of its rounds.
MEAN_FIELDS = (
    "slo_attainment",
    "tpot_slo_attainment",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "tpot_ms_p50",
    "tpot_ms_p90",
    "throughput_tok_s",
    "goodput_tok_s",
    "refused",
    "best_effort",
    "promised_slo_attainment",
)


def pooled(results: Sequence[dict]) -> list[dict]:
    """One result per (system, rate): a point run once as it is; one run in several rounds as
    the mean of its rounds' figures, with `rounds` and `slo_attainment_range` (min, max)."""
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for r in results:
        groups.setdefault((r["system"], r.get("rps")), []).append(r)
    out = []
    for (system, rps), runs in groups.items():
        if len(runs) == 1:
            out.append(runs[0])
            continue
        point: dict[str, Any] = {"system": system, "rps": rps, "rounds": len(runs)}
        for key in MEAN_FIELDS:
            values = [r[key] for r in runs if r.get(key) is not None]
            point[key] = statistics.fmean(values) if values else None
        att = [r["slo_attainment"] for r in runs if r.get("slo_attainment") is not None]
        point["slo_attainment_range"] = (min(att), max(att)) if att else None
        cats = {c for r in runs for c in r.get("per_category", {})}
        point["per_category"] = {
            c: {
                "slo_attainment": statistics.fmean(
                    r["per_category"][c]["slo_attainment"]
                    for r in runs
                    if c in r.get("per_category", {})
                )
            }
            for c in sorted(cats)
        }
        out.append(point)
    return out


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or not b else f"{a / b:.2f}x"


def versus_lines(results: Sequence[dict]) -> list[str]:
    """Per rate, adaserve against the better llama-server (by attainment) and against
    incremental: attainment, TTFT p50 and throughput ratios (the peer comparison's goals)."""
    points = {(r["system"], r.get("rps")): r for r in pooled(results)}
    lines = []
    for rps in sorted({k[1] for k in points if k[0] == "adaserve"}, key=lambda x: x or 0.0):
        ada = points[("adaserve", rps)]
        peers = [
            points[(s, rps)]
            for s in ("llama-server", "llama-server-ngram")
            if (s, rps) in points and points[(s, rps)].get("slo_attainment") is not None
        ]
        parts = []
        if peers:
            peer = max(peers, key=lambda r: r["slo_attainment"])
            parts.append(
                f"vs {peer['system']}: attainment "
                f"{_ratio(ada.get('slo_attainment'), peer['slo_attainment'])}, TTFT p50 "
                f"{_ratio(ada.get('ttft_ms_p50'), peer.get('ttft_ms_p50'))}, throughput "
                f"{_ratio(ada.get('throughput_tok_s'), peer.get('throughput_tok_s'))}"
            )
        inc = points.get(("incremental", rps))
        if inc is not None:
            parts.append(
                "vs incremental: attainment "
                f"{_ratio(ada.get('slo_attainment'), inc.get('slo_attainment'))}"
            )
        if parts:
            lines.append(f"adaserve at {_cell(rps, '.2f')} rps " + "; ".join(parts))
    return lines


def compare_table(results: Sequence[dict]) -> str:
    """One row per point (the mean of its rounds, `pooled`): attainment (joint, TPOT-only, by
    class), latency, rates; then adaserve against its peers per rate (`versus_lines`)."""
    many = pooled(results)
    cats = sorted({c for r in many for c in r.get("per_category", {})})
    head = ["system", "RPS", "SLO attainment", "TPOT-only"] + [f"att. {c}" for c in cats]
    head += ["TTFT p50 / p99 s", "TPOT p50 / p90 ms", "throughput tok/s", "goodput tok/s"]
    head += ["refused", "best effort"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(many, key=lambda r: (r.get("rps") or 0.0, SYSTEMS.index(r["system"]))):
        per = r.get("per_category", {})
        cells = [r["system"], _cell(r.get("rps"), ".2f")]
        attainment = _cell(r.get("slo_attainment"), ".1%")
        if r.get("slo_attainment_range") is not None:
            low, high = r["slo_attainment_range"]
            attainment += f" ({low:.1%}-{high:.1%}, {r['rounds']} rounds)"
        cells += [attainment, _cell(r.get("tpot_slo_attainment"), ".1%")]
        cells += [_cell(per[c]["slo_attainment"], ".0%") if c in per else "-" for c in cats]
        ttft = _cell(r.get("ttft_ms_p50"), ".2f", 1e-3), _cell(r.get("ttft_ms_p99"), ".1f", 1e-3)
        cells += [
            f"{ttft[0]} / {ttft[1]}",
            f"{_cell(r.get('tpot_ms_p50'), '.0f')} / {_cell(r.get('tpot_ms_p90'), '.0f')}",
            _cell(r.get("throughput_tok_s"), ".1f"),
            _cell(r.get("goodput_tok_s"), ".1f"),
            _cell(r.get("refused", 0), "g"),
            _cell(r.get("best_effort", 0), "g"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    versus = versus_lines(results) + slow_lines(results)
    return "\n".join(rows + ([""] + versus if versus else []))


def slow_lines(results: Sequence[dict]) -> list[str]:
    """The points kept though the machine ran over their --max-slowdown during them (run again
    once and slow again): their figures measure the host as much as the server."""
    slow = [
        r
        for r in results
        if r.get("max_slowdown") and r.get("machine_slowdown", 0.0) > r["max_slowdown"]
    ]
    if not slow:
        return []
    names = ", ".join(
        f"{r['system']} @ {_cell(r.get('rps'), '.2f')} rps round {r.get('round', 0)} "
        f"({r['machine_slowdown']:.2f}x)"
        for r in slow
    )
    return [f"ran while the machine was slow (a fixed CPU task over --max-slowdown): {names}"]


def plot_compare(results: Sequence[dict], out: str | Path) -> Path:
    """Four panels vs RPS, a line per system: attainment (TPOT-only dashed), goodput
    (throughput dashed), TTFT p50 (p99 dashed), TPOT p50 (p90 dashed)."""
    from adaserve.bench.plot import pyplot

    fig = compare_figure(results)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    pyplot().close(fig)
    return out


def compare_figure(results: Sequence[dict]) -> Any:
    """The figure `plot_compare` saves."""
    from adaserve.bench.plot import pyplot

    plt = pyplot()

    results = pooled(results)
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), constrained_layout=True)
    panels = [
        ("SLO attainment (%)", "slo_attainment", "tpot_slo_attainment", 100.0),
        ("goodput, throughput (tok/s)", "goodput_tok_s", "throughput_tok_s", 1.0),
        ("TTFT p50, p99 (s)", "ttft_ms_p50", "ttft_ms_p99", 1e-3),
        ("TPOT p50, p90 (ms)", "tpot_ms_p50", "tpot_ms_p90", 1.0),
    ]
    for system in [s for s in SYSTEMS if any(r["system"] == s for r in results)]:
        points = sorted((r["rps"], r) for r in results if r["system"] == system)
        xs = [x for x, _ in points]
        for ax, (_, solid, dashed, scale) in zip(axes.flat, panels):
            line = ax.plot(xs, [scale * (r.get(solid) or 0.0) for _, r in points], marker="o")
            ax.plot(
                xs,
                [scale * (r.get(dashed) or 0.0) for _, r in points],
                linestyle="--",
                color=line[0].get_color(),
            )
            line[0].set_label(system)
    for ax, (label, *_) in zip(axes.flat, panels):
        # Only after every system is drawn: a limit set earlier stops autoscaling, and the
        # systems drawn later (llama-server's 300 ms TPOT) fell off the top of the panel.
        ax.set(xlabel="requests per second", ylabel=label)
        ax.grid(True, alpha=0.3)
        ax.set_ylim(bottom=0)
    axes.flat[0].legend(fontsize="small")
    return fig


def run(args: argparse.Namespace) -> int:
    """Calibrate, then every system x rate on a fresh server; 1 if some point did not run."""
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    trace = load_trace_arg(args)
    if any(s.startswith("llama-server") for s in args.systems) and not args.llama_server:
        raise ValueError(
            "no llama-server binary: pass --llama-server PATH or set LLAMA_SERVER "
            "(docs/benchmarks.md says how to build one)"
        )
    log_dir = Path(args.server_log_dir or tempfile.mkdtemp(prefix="adaserve-compare-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.profile is not None:
        raise ValueError("compare scales SLOs itself: give --baseline-latency-ms, not --profile")
    baseline = args.baseline_latency_ms
    if baseline is None or args.prefill_ms_per_token is None:
        tpot, prefill = calibrate(args, trace, log_dir)
        baseline = baseline if baseline is not None else args.slo_factor * tpot
        if args.prefill_ms_per_token is None:
            args.prefill_ms_per_token = prefill
    args.baseline_latency_ms = baseline
    if args.slo_scale == 1.0:  # not given: absolute SLOs scale with the baseline
        args.slo_scale = baseline / TRACE_BASELINE_MS
    print(
        f"SLOs: baseline {baseline:.1f} ms (relative SLOs x that), absolute x "
        f"{args.slo_scale:.2f}, TTFT objectives from {args.prefill_ms_per_token:.3f} ms/token",
        file=sys.stderr,
        flush=True,
    )
    for rps in args.rps or [None]:
        prepare_point(args, trace, rps)  # bad options fail before any server starts
    reference = machine_speed()
    print(
        f"machine speed: {reference[0]:.1f} ms of products, {reference[1]:.1f} ms of copies",
        file=sys.stderr,
        flush=True,
    )
    results, failed = [], []
    for rnd, rps, system in point_order(args.systems, args.rps or [None], args.rounds):
        tag = f"-r{rnd}" if args.rounds > 1 else ""
        name = f"[{system} @ {rps} rps{f', round {rnd}' if tag else ''}]"
        result: dict | None = None
        for attempt in range(1 + SLOW_POINT_RETRIES):
            cmd = system_command(args, system, free_port())
            again = f"-again{attempt}" if attempt else ""
            log = log_dir / f"{system}-rps{rps}{tag}{again}.log"
            print(f"{name} {shlex.join(cmd)}", file=sys.stderr, flush=True)
            before = machine_speed()
            # The fastest the machine has been (a reference taken in a slow spell would pass
            # every point run in the next one).
            reference = faster(reference, before)
            last = attempt == SLOW_POINT_RETRIES

            def speed(before=before, last=last, reference=reference) -> dict:
                # After the replay, the server idle: the result line records both probes and
                # whether a fresh server runs the point again (`rerun`: this line is not it).
                after = machine_speed()
                reference = faster(reference, after)
                slow = slowdown([before, after], reference)
                over = bool(args.max_slowdown) and slow > args.max_slowdown
                return {
                    "machine_probe_ms": {
                        "reference": list(reference),
                        "before": list(before),
                        "after": list(after),
                    },
                    "machine_slowdown": slow,
                    "max_slowdown": args.max_slowdown,
                    "rerun": over and not last,
                }

            try:
                with running_server(cmd, log, args.startup_timeout) as url:
                    warm_up(url, None)
                    extra = {
                        "system": system,
                        "server_command": cmd,
                        "slo_baseline_ms": baseline,
                        "round": rnd,
                        "attempt": attempt,
                    }
                    point = run_point(args, url, trace, rps, system, extra=extra, finish=speed)
            except (RuntimeError, httpx.HTTPError) as exc:
                print(f"{name} skipped: {exc}", file=sys.stderr, flush=True)
                failed.append(f"{system}@{rps}{tag}")
                result = None
                break
            result = point
            fastest = point["machine_probe_ms"]["reference"]  # with the probe after it
            reference = (fastest[0], fastest[1])
            slow = point["machine_slowdown"]
            if not args.max_slowdown or slow <= args.max_slowdown:
                break
            print(
                f"{name} the machine ran {slow:.2f}x slower than before the first point "
                f"(--max-slowdown {args.max_slowdown:g}): "
                + ("kept, and named in the table" if last else "run again on a fresh server"),
                file=sys.stderr,
                flush=True,
            )
        if result is None:
            continue
        print(one_line(result), flush=True)
        results.append(result)
    return finish_runs(args, results, failed, log_dir, compare_table, plot_compare, "points")


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m adaserve.bench.compare RESULTS [--plot PNG]`: the table and plot again."""
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.compare", description=main.__doc__)
    p.add_argument("results", help="a results file written by `adaserve bench compare`")
    p.add_argument("--plot", default=None, help="PNG to draw (default: RESULTS with .png)")
    args = p.parse_args(argv)
    # A line whose point a fresh server ran again (the machine was slow) is not counted.
    results = [
        r for r in load_results(args.results) if r.get("system") in SYSTEMS and not r.get("rerun")
    ]
    if not results:
        print(f"no `adaserve bench compare` result in {args.results}", file=sys.stderr)
        return 1
    print(compare_table(results))
    print(f"wrote {plot_compare(results, args.plot or Path(args.results).with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
