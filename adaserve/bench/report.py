"""What a replay measured: per-request records, the run summary, and the comparison table.

Definitions (the paper's, measured at the client):
- TPOT of a request = (arrival of its last token - arrival of its first) / (output tokens - 1).
- TTFT = arrival of the first token - send time. Its objective is the request's slo_ttft_ms,
  else, when the run knows the machine's prefill speed (ms per prompt token), the default
  of `adaserve.request_manager.slo.ttft_objective_ms`: a floor plus a factor x the time to
  prefill the prompt alone (prompt tokens x ms per token). Without either, TTFT is not judged.
- A request attains its SLO when it completed, TPOT <= slo_tpot_ms and TTFT <= its TTFT
  objective: a stream on pace whose first token came seconds late is lost to its user. One
  output token meets any TPOT SLO (there is no second token to be late); a request without a
  TPOT SLO attains on TTFT alone; a failed request never attains. `tpot_slo_attainment` is the
  TPOT-only figure (the paper's), kept beside it for comparison.
- SLO attainment = attaining requests / all requests sent (failures included).
- Goodput = output tokens of attaining requests / run duration; throughput = output tokens of
  all completed requests / run duration. The run lasts from the first send to the last reply.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from adaserve.config import SchedulerConfig
from adaserve.request_manager.slo import ttft_objective_ms

# Kept per summary so a failing server is visible without reading every record.
MAX_ERROR_KINDS = 5


@dataclass
class RequestRecord:
    """One replayed request; times are seconds from the start of the replay."""

    index: int  # the request's position in the trace file
    slo_category: str
    slo_tpot_ms: float | None
    max_tokens: int
    scheduled_s: float
    sent_s: float | None = None
    # Arrival of every output token; tokens streamed in one chunk share its arrival time.
    token_times_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    end_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int | None = None
    server_tpot_ms: float | None = None  # what the server says it measured (ours reports it)
    slo_ttft_ms: float | None = None  # the request's own TTFT SLO, if it names one
    # The machine's prefill speed, for the default TTFT objective (None: TTFT not judged).
    prefill_ms_per_token: float | None = None
    ttft_factor: float = SchedulerConfig.default_ttft_factor
    ttft_floor_ms: float = SchedulerConfig.default_ttft_floor_ms
    attempts: int = 1  # sends it took: more than one when a client retried a refusal
    # The server said it served the request best effort (`X-SLO-Admission: best-effort`):
    # admission could not promise its SLO at that load and served it anyway.
    best_effort: bool = False

    @property
    def completed(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def ttft_s(self) -> float | None:
        if not self.token_times_s or self.sent_s is None:
            return None
        return self.token_times_s[0] - self.sent_s

    @property
    def tpot_ms(self) -> float | None:
        if not self.completed or self.output_tokens < 2 or not self.token_times_s:
            return None
        return 1000.0 * (self.token_times_s[-1] - self.token_times_s[0]) / (self.output_tokens - 1)

    @property
    def e2e_s(self) -> float | None:
        if self.end_s is None or self.sent_s is None:
            return None
        return self.end_s - self.sent_s

    @property
    def ttft_objective_ms(self) -> float | None:
        """slo_ttft_ms, else the default objective from the prompt length; None: not judged."""
        if self.slo_ttft_ms is not None:
            return self.slo_ttft_ms
        if self.prefill_ms_per_token is None or self.prompt_tokens is None:
            return None
        alone = self.prompt_tokens * self.prefill_ms_per_token
        return ttft_objective_ms(alone, self.ttft_factor, self.ttft_floor_ms)

    @property
    def tpot_attained(self) -> bool:
        """Completed within its TPOT SLO (the paper's attainment: the first token not counted)."""
        if not self.completed:
            return False
        tpot = self.tpot_ms
        return self.slo_tpot_ms is None or tpot is None or tpot <= self.slo_tpot_ms

    @property
    def ttft_attained(self) -> bool:
        """First token within its TTFT objective (True when none is judged)."""
        objective, ttft = self.ttft_objective_ms, self.ttft_s
        return objective is None or (ttft is not None and 1000.0 * ttft <= objective)

    @property
    def slo_attained(self) -> bool:
        """Completed with TPOT and TTFT both within their objectives."""
        return self.tpot_attained and self.ttft_attained

    def to_json(self) -> dict:
        """The record with its derived values, as one JSON line stores it."""
        d = asdict(self)
        d.update(
            completed=self.completed,
            ttft_ms=_ms(self.ttft_s),
            tpot_ms=self.tpot_ms,
            e2e_ms=_ms(self.e2e_s),
            ttft_objective_ms=self.ttft_objective_ms,
            tpot_attained=self.tpot_attained,
            slo_attained=self.slo_attained,
        )
        return d


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def _stats(values: Iterable[float | None], prefix: str) -> dict[str, float | None]:
    """mean, p50, p90, p99 of the values that exist (None when there are none)."""
    arr = np.array([v for v in values if v is not None], dtype=float)
    if arr.size == 0:
        return {f"{prefix}_{k}": None for k in ("mean", "p50", "p90", "p99")}
    p50, p90, p99 = np.percentile(arr, [50, 90, 99])
    return {
        f"{prefix}_mean": float(arr.mean()),
        f"{prefix}_p50": float(p50),
        f"{prefix}_p90": float(p90),
        f"{prefix}_p99": float(p99),
    }


def _group(records: Sequence[RequestRecord], duration_s: float) -> dict:
    attained = [r for r in records if r.slo_attained]
    done = [r for r in records if r.completed]
    good_tokens = sum(r.output_tokens for r in attained)
    tokens = sum(r.output_tokens for r in done)
    return {
        "requests": len(records),
        "completed": len(done),
        "failed": len(records) - len(done),
        "attained": len(attained),
        "slo_attainment": len(attained) / len(records) if records else None,
        "tpot_slo_attainment": (
            sum(r.tpot_attained for r in records) / len(records) if records else None
        ),
        "ttft_judged": sum(r.ttft_objective_ms is not None for r in records),
        "output_tokens": tokens,
        "attained_output_tokens": good_tokens,
        "goodput_tok_s": good_tokens / duration_s if duration_s > 0 else None,
        "throughput_tok_s": tokens / duration_s if duration_s > 0 else None,
        **_stats((r.tpot_ms for r in done), "tpot_ms"),
    }


REFUSALS = ("HTTP 429", "HTTP 503")


def summarize(records: Sequence[RequestRecord]) -> dict:
    """Attainment, goodput, throughput and latency statistics, overall and per SLO category."""
    ends = [r.end_s for r in records if r.end_s is not None]
    starts = [r.sent_s for r in records if r.sent_s is not None]
    duration = max(ends) - min(starts) if ends and starts else 0.0
    out = {"duration_s": duration, **_group(records, duration)}
    out["request_throughput_rps"] = out["completed"] / duration if duration > 0 else None
    out.update(_stats((_ms(r.ttft_s) for r in records if r.completed), "ttft_ms"))
    out.update(_stats((_ms(r.e2e_s) for r in records if r.completed), "e2e_ms"))
    errors = Counter(r.error for r in records if r.error is not None)
    out["errors"] = dict(errors.most_common(MAX_ERROR_KINDS))
    # Refused by the server's admission (queue full, SLO unattainable, draining): the
    # overload answer, distinct from failures. Attainment among the admitted is what
    # admission control protects.
    refused = [r for r in records if r.error is not None and r.error.startswith(REFUSALS)]
    admitted = [r for r in records if not (r.error is not None and r.error.startswith(REFUSALS))]
    out["refused"] = len(refused)
    out["admitted_slo_attainment"] = (
        sum(r.slo_attained for r in admitted) / len(admitted) if admitted else None
    )
    # Served best effort, and the attainment of the requests admitted with their SLO promised:
    # what best effort must not take from.
    promised = [r for r in admitted if not r.best_effort]
    out["best_effort"] = len(admitted) - len(promised)
    out["promised_slo_attainment"] = (
        sum(r.slo_attained for r in promised) / len(promised) if promised else None
    )
    lags = [r.sent_s - r.scheduled_s for r in records if r.sent_s is not None]
    # How late the client sent requests: large values mean the client, not the server, lagged.
    out["max_send_lag_ms"] = 1000.0 * max(lags) if lags else None
    categories: dict[str, dict] = {}
    for name in sorted({r.slo_category for r in records}):
        members = [r for r in records if r.slo_category == name]
        slos = {r.slo_tpot_ms for r in members}
        categories[name] = {
            "slo_tpot_ms": slos.pop() if len(slos) == 1 else None,
            **_group(members, duration),
        }
    out["per_category"] = categories
    return out


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def format_table(summaries: Sequence[dict]) -> str:
    """A markdown table, one row per run (policy x RPS), sorted by label then RPS."""
    cats = sorted({c for s in summaries for c in s.get("per_category", {})})
    head = (
        ["label", "RPS", "requests", "failed", "SLO attainment"]
        + [f"att. {c}" for c in cats]
        + ["TPOT-only att.", "goodput tok/s", "throughput tok/s", "mean TPOT ms"]
        + ["p50 TTFT ms", "p99 TTFT ms", "acc./iter"]
    )
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in sorted(summaries, key=lambda s: (str(s.get("label")), s.get("rps") or 0.0)):
        per = s.get("per_category", {})
        acc = (s.get("server_metrics") or {}).get("mean_accepted_tokens_per_iteration")
        cells = (
            [str(s.get("label")), _num(s.get("rps"), ".2f"), str(s.get("requests"))]
            + [str(s.get("failed")), _pct(s.get("slo_attainment"))]
            + [_pct(per[c]["slo_attainment"]) if c in per else "-" for c in cats]
            + [_pct(s.get("tpot_slo_attainment"))]
            + [_num(s.get("goodput_tok_s")), _num(s.get("throughput_tok_s"))]
            + [_num(s.get("tpot_ms_mean")), _num(s.get("ttft_ms_p50"), ".0f")]
            + [_num(s.get("ttft_ms_p99"), ".0f"), _num(acc, ".2f")]
        )
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def load_results(path: str | Path) -> list[dict]:
    """Every result line of a results file."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
