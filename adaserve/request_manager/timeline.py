"""The iteration timeline: one JSON line per iteration, what its plan ran and what it cost.

`adaserve serve --record-iterations FILE` (and `LLM(record_iterations=FILE)`) append, per
iteration that ran a forward:

    {"t": start (engine clock, s), "kind": "decode" | "prefill",
     "decode_rows": decoding requests, "deferred_rows": running streams ahead of
     their pace that sat out (request_manager/pacing.py),
     "tree_tokens": verified nodes besides the roots,
     "accepted": accepted nodes, "emitted": tokens committed,
     "prompt_tokens": {request id: prompt tokens computed now},
     "forward_tokens": tokens in the forward, "padded_tokens": with padding,
     "predicted_forward_s": the cost model's forward time (null without one),
     "forward_s": measured forward, "draft_s", "select_s", "host_s": time outside forwards
     since the last iteration (null after idle), "total_s": the iteration,
     "behind_pace": ids of decoding requests behind their SLO pace when it began,
     "cost_inputs": what the cost model observed the forward as: {"tokens" (padded),
     "context", "silent" (with padding rows), "silent_pairs", "tree_pairs"}, so a fit can be
     redone offline (`ForwardBatch.cost_terms`)}

`python -m adaserve.bench.timeline FILE --out PNG` plots it: where the time goes, and how
far forwards stray from their prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from adaserve.request_manager.jsonl import JsonLines
from adaserve.request_manager.plan import IterationPlan
from adaserve.request_manager.request import Request


def behind_pace(requests: Sequence[Request], now: float, margin: float) -> list[str]:
    """Requests with a TPOT SLO whose output so far is slower than (1 - margin) x the SLO:
    the time since their first token exceeds the pace times the tokens after it."""
    late = []
    for r in requests:
        slo_ms, first = r.params.slo_tpot_ms, r.metrics.first_token_time
        if slo_ms is None or first is None:
            continue
        pace_s = (1.0 - margin) * slo_ms / 1000.0
        if now - first > pace_s * (len(r.output_token_ids) - 1):
            late.append(r.request_id)
    return late


class IterationTimeline:
    """Appends one line per iteration (buffered; `close` flushes)."""

    def __init__(self, path: str | Path, pace_margin: float) -> None:
        self.lines = JsonLines(path)
        self.pace_margin = pace_margin

    @property
    def path(self) -> Path:
        return self.lines.path

    def record(self, plan: IterationPlan) -> None:
        """The plan of an iteration that ran, once its commit filled the stats."""
        s = plan.stats
        silent, silent_pairs, tree_pairs = plan.batch.cost_terms()
        padding = plan.pad_to - len(plan.batch.token_ids)
        self.lines.append(
            {
                "t": round(plan.started_s, 6),
                "kind": s.kind,
                "decode_rows": len(plan.trees),
                "deferred_rows": s.deferred_rows,
                "tree_tokens": s.tree_tokens,
                "accepted": s.accepted_tokens,
                "emitted": s.emitted_tokens,
                "prompt_tokens": {c.request.request_id: c.num_tokens for c in plan.chunks},
                "forward_tokens": len(plan.batch.token_ids),
                "padded_tokens": plan.pad_to,
                "predicted_forward_s": plan.predicted_s,
                "forward_s": s.forward_s,
                "draft_s": s.draft_s,
                "select_s": s.select_s,
                "host_s": s.host_s,
                "total_s": s.total_s,
                "behind_pace": behind_pace(plan.decoding, plan.started_s, self.pace_margin),
                "cost_inputs": {
                    "tokens": plan.pad_to,
                    "context": plan.context + plan.chunk_context,
                    "silent": silent + padding,
                    "silent_pairs": silent_pairs,
                    "tree_pairs": tree_pairs,
                },
            }
        )

    def flush(self) -> None:
        self.lines.flush()

    def close(self) -> None:
        self.lines.close()
