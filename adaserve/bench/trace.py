"""Request traces in the AdaServe artifact's emission format, and the options that shrink them.

A trace is a JSON list of {emission_time_ms, prompt, input_length, output_length, slo_ratio}.
`slo_ratio > 0`: TPOT SLO = slo_ratio x baseline latency (needs the baseline of the machine
that serves); `slo_ratio < 0`: TPOT SLO = -slo_ratio milliseconds (set for 70B models on
A100s, so `slo_scale` multiplies them on other hardware). `slo_ratio == 0` means no SLO.

`prepare` turns the raw trace into what is replayed: cut to a request count, rescaled to a
request rate, cut to a duration, output lengths capped, SLOs resolved to milliseconds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

REQUIRED_FIELDS = ("emission_time_ms", "prompt", "output_length", "slo_ratio")
NO_SLO_CATEGORY = "none"


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace, as the file says it."""

    index: int  # position in the file; records refer to it
    emission_time_ms: float
    prompt: str
    input_length: int | None  # in the trace authors' tokenizer: informative only
    output_length: int
    slo_ratio: float

    @property
    def slo_category(self) -> str:
        """The SLO kind and value as the trace gives them, readably: 'ratio=1.2', 'abs=50ms'."""
        if self.slo_ratio > 0:
            return f"ratio={self.slo_ratio:g}"
        if self.slo_ratio < 0:
            return f"abs={-self.slo_ratio:g}ms"
        return NO_SLO_CATEGORY


@dataclass(frozen=True)
class BenchRequest:
    """One request to replay: when to send it and what its SLO is, in this run's terms."""

    trace: TraceRequest
    send_time_s: float  # from the start of the replay
    max_tokens: int
    slo_tpot_ms: float | None  # None: no SLO

    @property
    def slo_category(self) -> str:
        return self.trace.slo_category


@dataclass(frozen=True)
class TraceOptions:
    """How to make a trace fit a machine; every field is reported with the result."""

    rps: float | None = None  # rescale arrivals to this mean rate (None: as recorded)
    duration_s: float | None = None  # keep requests sent before this replay time
    max_requests: int | None = None  # replay only the first N of the trace
    output_length: int | None = None  # cap every request's output_length
    baseline_latency_ms: float | None = None  # converts slo_ratio > 0 into milliseconds
    slo_scale: float = 1.0  # multiplies absolute (slo_ratio < 0) SLOs
    # Play the trace this many times back to back (a trace too short for many replicas).
    repeat: int = 1

    def __post_init__(self) -> None:
        for name in ("rps", "duration_s", "baseline_latency_ms"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a finite number > 0, got {value}")
        for name in ("max_requests", "output_length", "repeat"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not (self.slo_scale > 0 and math.isfinite(self.slo_scale)):
            raise ValueError(f"slo_scale must be a finite number > 0, got {self.slo_scale}")


def parse_trace(data: object, source: str = "trace") -> list[TraceRequest]:
    """Validate a decoded trace (a JSON list) and return its requests sorted by emission time."""
    if not isinstance(data, list) or not data:
        raise ValueError(f"{source} must be a non-empty JSON list of requests")
    requests = []
    for i, item in enumerate(data):
        if not isinstance(item, dict):
            raise ValueError(f"{source}[{i}] must be an object, got {type(item).__name__}")
        missing = [f for f in REQUIRED_FIELDS if f not in item]
        if missing:
            raise ValueError(f"{source}[{i}] lacks {', '.join(missing)}")
        try:
            req = TraceRequest(
                index=i,
                emission_time_ms=float(item["emission_time_ms"]),
                prompt=str(item["prompt"]),
                input_length=None
                if item.get("input_length") is None
                else int(item["input_length"]),
                output_length=int(item["output_length"]),
                slo_ratio=float(item["slo_ratio"]),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{source}[{i}] has a field of the wrong type: {exc}") from None
        if not (math.isfinite(req.emission_time_ms) and req.emission_time_ms >= 0):
            raise ValueError(
                f"{source}[{i}].emission_time_ms must be >= 0, got {req.emission_time_ms}"
            )
        if req.output_length < 1:
            raise ValueError(f"{source}[{i}].output_length must be >= 1, got {req.output_length}")
        if not math.isfinite(req.slo_ratio):
            raise ValueError(f"{source}[{i}].slo_ratio must be finite, got {req.slo_ratio}")
        if not req.prompt:
            raise ValueError(f"{source}[{i}].prompt is empty")
        requests.append(req)
    # Stable: requests emitted at the same instant keep their file order.
    return sorted(requests, key=lambda r: r.emission_time_ms)


def load_trace(path: str | Path) -> list[TraceRequest]:
    """Read and validate a trace file."""
    path = Path(path)
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
    return parse_trace(data, path.name)


def mean_rate(times_s: Sequence[float]) -> float | None:
    """Requests/s over the span of arrivals, (N - 1) / (last - first); None if undefined."""
    if len(times_s) < 2 or times_s[-1] <= times_s[0]:
        return None
    return (len(times_s) - 1) / (times_s[-1] - times_s[0])


def rescale_rps(times_s: Sequence[float], rps: float) -> list[float]:
    """Arrival times (sorted, seconds) stretched so their mean rate becomes `rps`, from 0.

    Inter-arrival gaps keep their proportions (bursts stay bursts), so only the rate changes.
    """
    if mean_rate(times_s) is None:  # one request, or all at once: no pattern to stretch
        return [0.0 for _ in times_s]
    # Each time as its fraction of the span, times the new span: a span so short that the
    # rate overflows to inf (hypothesis found one) must not turn 0 x inf into NaN.
    first, span = times_s[0], times_s[-1] - times_s[0]
    new_span = (len(times_s) - 1) / rps
    return [(t - first) / span * new_span for t in times_s]


def resolve_slo_ms(req: TraceRequest, opts: TraceOptions) -> float | None:
    """The request's TPOT SLO in milliseconds for this run (None: no SLO)."""
    if req.slo_ratio > 0:
        if opts.baseline_latency_ms is None:
            raise ValueError(
                f"the trace has SLOs relative to the baseline latency (slo_ratio "
                f"{req.slo_ratio:g} > 0); pass --baseline-latency-ms MS, or --profile FILE "
                "from `adaserve profile`, so they can be converted to milliseconds"
            )
        return req.slo_ratio * opts.baseline_latency_ms
    if req.slo_ratio < 0:
        return -req.slo_ratio * opts.slo_scale
    return None


def tile(trace: Sequence[TraceRequest], repeat: int) -> list[TraceRequest]:
    """The trace (sorted) played `repeat` times back to back: copy k starts one mean gap
    after copy k - 1 ends, and its requests are indexed after all of copy k - 1's."""
    if repeat == 1 or not trace:
        return list(trace)
    first, last = trace[0].emission_time_ms, trace[-1].emission_time_ms
    gap = (last - first) / (len(trace) - 1) if len(trace) > 1 else 1.0
    period, n = last - first + gap, len(trace)
    return [
        replace(r, index=k * n + r.index, emission_time_ms=r.emission_time_ms + k * period)
        for k in range(repeat)
        for r in trace
    ]


def prepare(trace: Sequence[TraceRequest], opts: TraceOptions) -> list[BenchRequest]:
    """The requests to replay, in send order.

    Order of the options: the first `max_requests` of the trace are taken, their arrivals
    rescaled to `rps` (so what is replayed has that mean rate, not just the whole trace),
    then requests at or after `duration_s` on the replay clock are dropped.
    """
    reqs = tile(sorted(trace, key=lambda r: r.emission_time_ms), opts.repeat)
    reqs = reqs[: opts.max_requests]
    times = [r.emission_time_ms / 1000.0 for r in reqs]
    if opts.rps is not None:
        times = rescale_rps(times, opts.rps)
    elif times:
        times = [t - times[0] for t in times]  # the replay starts with the first request
    out = []
    for req, t in zip(reqs, times):
        if opts.duration_s is not None and t >= opts.duration_s:
            break
        max_tokens = req.output_length
        if opts.output_length is not None:
            max_tokens = min(max_tokens, opts.output_length)
        out.append(BenchRequest(req, t, max_tokens, resolve_slo_ms(req, opts)))
    return out


def describe_options(opts: TraceOptions, trace: Sequence[TraceRequest]) -> list[str]:
    """Sentences stating how the replayed workload differs from the trace (go into the result)."""
    notes = []
    kept = sorted(r.emission_time_ms for r in tile(trace, opts.repeat))[: opts.max_requests]
    if opts.repeat > 1:
        notes.append(f"the trace played {opts.repeat} times back to back (--repeat)")
    native = mean_rate([t / 1000.0 for t in kept])
    if opts.rps is not None:
        was = "n/a" if native is None else f"{native:.3g}"
        notes.append(f"arrivals rescaled from {was} to {opts.rps:g} requests/s (--rps)")
    if opts.duration_s is not None:
        notes.append(f"only requests sent in the first {opts.duration_s:g} s (--duration)")
    if opts.max_requests is not None:
        notes.append(f"at most the first {opts.max_requests} requests (--max-requests)")
    if opts.output_length is not None:
        notes.append(f"output lengths capped at {opts.output_length} tokens (--output-length)")
    if any(r.slo_ratio > 0 for r in trace) and opts.baseline_latency_ms is not None:
        notes.append(
            f"relative SLOs = slo_ratio x baseline latency {opts.baseline_latency_ms:g} ms"
        )
    if opts.slo_scale != 1.0:
        notes.append(f"absolute SLOs multiplied by {opts.slo_scale:g} (--slo-scale)")
    return notes
