"""The server's metrics under vLLM's names (`vllm:...`, labelled `model_name`), so what was
built for vLLM servers reads an adaserve server unchanged. This module owns every `vllm:` name.

- Always: the three gauges the Gateway API Inference Extension's endpoint picker reads (its
  "model server protocol"): requests running, requests waiting, KV-cache usage.
- With `--vllm-metrics`: what vLLM's Grafana dashboards and KEDA/HPA rules query besides:
  latency histograms, token and request counters, and the older KV gauge name.

Colons are legal in Prometheus metric names (prometheus-client accepts them in both of its
name-validation modes). The values are adaserve's own measurements, not vLLM's code paths:
TPOT is each request's mean time per output token after the first.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from adaserve.api.metrics import FinishedRequest

# Wide enough for a CPU server (seconds per token) and a GPU one (milliseconds).
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class VllmMetrics:
    """vLLM-named metrics in `registry`; `aliases` adds the opt-in ones (`--vllm-metrics`)."""

    def __init__(self, registry: CollectorRegistry, model_name: str, aliases: bool) -> None:
        r, model = registry, ["model_name"]
        self.registry = registry
        self.model_name, self.aliases = model_name, aliases
        self.running = Gauge(
            "vllm:num_requests_running",
            "Requests in the batch, decoding or prefilling (adaserve_num_requests_running)",
            model,
            registry=r,
        ).labels(model_name)
        self.waiting = Gauge(
            "vllm:num_requests_waiting",
            "Requests queued, not yet running (adaserve_num_requests_waiting)",
            model,
            registry=r,
        ).labels(model_name)
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc",
            "Target KV-cache usage as a ratio, 1 = full (kv_blocks_used / kv_blocks_total)",
            model,
            registry=r,
        ).labels(model_name)
        if not aliases:
            return
        # vLLM before 0.10 named the same ratio gpu_cache_usage_perc; dashboards still use it.
        self.gpu_cache_usage = Gauge(
            "vllm:gpu_cache_usage_perc",
            "Target KV-cache usage as a ratio, 1 = full (same as vllm:kv_cache_usage_perc)",
            model,
            registry=r,
        ).labels(model_name)
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Arrival to first output token (adaserve_time_to_first_token_seconds)",
            model,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds",
            "Per-request mean time per output token after the first "
            "(adaserve_time_per_output_token_seconds)",
            model,
            buckets=TPOT_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Arrival to finish (adaserve_e2e_request_latency_seconds)",
            model,
            buckets=E2E_BUCKETS_S,
            registry=r,
        ).labels(model_name)
        self.queue = self._phase("queue", "Arrival to first scheduled")
        self.prefill = self._phase("prefill", "First scheduled to first output token")
        self.decode = self._phase("decode", "First to last output token")
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens",
            "Prompt tokens of finished requests (adaserve_prompt_tokens_total)",
            model,
            registry=r,
        ).labels(model_name)
        self.generation_tokens = Counter(
            "vllm:generation_tokens",
            "Output tokens, counted in the iteration that produced them "
            "(adaserve_emitted_tokens_total)",
            model,
            registry=r,
        ).labels(model_name)
        self.success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason (adaserve_requests_total)",
            ["model_name", "finished_reason"],
            registry=r,
        )
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    def _phase(self, phase: str, what: str) -> Histogram:
        return Histogram(
            f"vllm:request_{phase}_time_seconds",
            f"{what} (adaserve_request_{phase}_time_seconds)",
            ["model_name"],
            buckets=PHASE_BUCKETS_S,
            registry=self.registry,
        ).labels(self.model_name)

    def set_engine_state(self, running: int, waiting: int, kv_usage: float) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        if self.aliases:
            self.gpu_cache_usage.set(kv_usage)

    def observe_emitted(self, tokens: int) -> None:
        if self.aliases:
            self.generation_tokens.inc(tokens)

    def observe_finished(self, req: FinishedRequest) -> None:
        if not self.aliases:
            return
        if req.finish_reason != "error":  # a failed request is no success
            self.success.labels(self.model_name, req.finish_reason).inc()
        self.prompt_tokens.inc(req.num_prompt_tokens)
        for hist, value in (
            (self.ttft, req.ttft_s),
            (self.tpot, None if req.tpot_ms is None else req.tpot_ms / 1000.0),
            (self.e2e, req.e2e_s),
            (self.queue, req.queue_s),
            (self.prefill, req.prefill_s),
            (self.decode, req.decode_s),
        ):
            if value is not None and math.isfinite(value):
                hist.observe(value)
