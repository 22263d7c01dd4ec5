"""Prometheus metrics of the server. This module owns every `adaserve_` metric name;
`vllm_metrics.py` owns the `vllm:` names (the same measurements under vLLM's names).

Each server builds its own `ServerMetrics` over a private `CollectorRegistry`, so several apps
can live in one process (tests). The engine thread records iterations and finished requests;
the HTTP side records rejections. prometheus-client metrics are thread-safe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from adaserve.api.vllm_metrics import VllmMetrics
from adaserve.request_manager.control.calibration import DepthCalibration
from adaserve.request_manager.stats import IterationStats

NO_SLO_CLASS = "none"
# A request whose slo_tpot_ms lies above every class bound (only when no class is `inf`).
OTHER_SLO_CLASS = "other"

TPOT_BUCKETS_S = (
    0.005,
    0.01,
    0.02,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.5,
)
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
STAGE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
TOKEN_COUNT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
UTILIZATION_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5, 2.0, 4.0)
# A request's phases: queued, prefilling, decoding (seconds, each possibly long on a CPU).
PHASE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def slo_class_of(slo_tpot_ms: float | None, classes: tuple[tuple[str, float], ...]) -> str:
    """The first class (classes sorted by bound) whose bound is >= slo_tpot_ms."""
    if slo_tpot_ms is None:
        return NO_SLO_CLASS
    for name, bound in classes:
        if slo_tpot_ms <= bound:
            return name
    return OTHER_SLO_CLASS


@dataclass(frozen=True)
class FinishedRequest:
    """What a finished request measured (a snapshot taken in the engine thread)."""

    finish_reason: str  # stop | length | abort | error
    slo_tpot_ms: float | None
    slo_class: str
    slo_attained: bool | None  # TPOT and first token within their objectives; None: no SLO
    num_prompt_tokens: int
    num_output_tokens: int
    ttft_s: float | None
    tpot_ms: float | None  # None with fewer than two output tokens
    e2e_s: float | None
    spec_tree_tokens: int
    spec_accepted_tokens: int
    slo_ttft_ms: float | None = None
    ttft_attained: bool | None = None  # first token within its objective; None: no objective
    tpot_attained: bool | None = None  # TPOT alone within slo_tpot_ms; None: no SLO
    ttft_objective_ms: float | None = None  # slo_ttft_ms, else the server's default objective
    queue_s: float | None = None  # arrival to first scheduled; None: never scheduled
    prefill_s: float | None = None  # first scheduled to first token
    decode_s: float | None = None  # first to last token


class ServerMetrics:
    """Every metric the server exports, registered in a registry of its own. `model_name`
    (the served model name) labels the request-level metrics, as vLLM labels its own, so one
    Prometheus can tell several models apart; `vllm_aliases` adds vLLM's names
    (`--vllm-metrics`)."""

    def __init__(
        self,
        slo_classes: tuple[tuple[str, float], ...],
        model_name: str = "",
        vllm_aliases: bool = False,
    ) -> None:
        self.slo_classes = slo_classes
        self.model_name = m = model_name
        self.registry = r = CollectorRegistry()
        # Request-level metrics carry the model; engine-level ones describe this one process.
        cls = ["slo_class", "model_name"]
        # Requests.
        self.requests = Counter(
            "adaserve_requests",
            "Finished requests by finish reason (stop, length, abort, error)",
            ["finish_reason", "model_name"],
            registry=r,
        )
        self.rejected = Counter(
            "adaserve_requests_rejected",
            "Requests refused before reaching the engine, by reason",
            ["reason", "model_name"],
            registry=r,
        )
        self.best_effort_requests = Counter(
            "adaserve_requests_best_effort",
            "Requests whose slo_tpot_ms --admission slo could not promise at their arrival's "
            "load and served best effort instead of refusing (their SLO still judges them)",
            cls,
            registry=r,
        )
        self.slo_attained = Counter(
            "adaserve_slo_attained",
            "Finished requests whose TPOT met their SLO and whose first token met its objective",
            cls,
            registry=r,
        )
        self.slo_violated = Counter(
            "adaserve_slo_violated",
            "Finished requests whose TPOT exceeded their SLO or whose first token came too late",
            cls,
            registry=r,
        )
        # The paper's attainment, which ignores the first token: kept for comparison.
        self.tpot_attained = Counter(
            "adaserve_tpot_slo_attained",
            "Finished requests whose TPOT met their SLO (first token not counted)",
            cls,
            registry=r,
        )
        self.tpot_violated = Counter(
            "adaserve_tpot_slo_violated",
            "Finished requests whose TPOT exceeded their SLO (first token not counted)",
            cls,
            registry=r,
        )
        self.goodput_tokens = Counter(
            "adaserve_goodput_tokens",
            "Output tokens of requests that met their SLO",
            cls,
            registry=r,
        )
        self.ttft_attained = Counter(
            "adaserve_ttft_slo_attained",
            "Finished requests whose first token met its objective (slo_ttft_ms, else the "
            "default from the prompt length)",
            cls,
            registry=r,
        )
        self.ttft_violated = Counter(
            "adaserve_ttft_slo_violated",
            "Finished requests whose first token came after its objective",
            cls,
            registry=r,
        )
        # Same meaning as vLLM's prefix_cache_queries / prefix_cache_hits (in tokens).
        self.prefix_queries = Counter(
            "adaserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache at admission",
            registry=r,
        )
        self.prefix_hits = Counter(
            "adaserve_prefix_cache_hits",
            "Prompt tokens whose KV came from the prefix cache",
            registry=r,
        )
        self.prefill_tokens = Counter(
            "adaserve_prefill_tokens",
            "Prompt tokens computed (prefix-cache hits excluded, recomputation included)",
            registry=r,
        )
        self.prompt_tokens = Counter(
            "adaserve_prompt_tokens",
            "Prompt tokens of finished requests",
            ["model_name"],
            registry=r,
        ).labels(m)
        self.generation_tokens = Counter(
            "adaserve_generation_tokens", "Output tokens of finished requests", cls, registry=r
        )
        self.emitted_tokens = Counter(
            "adaserve_emitted_tokens",
            "Output tokens, counted in the iteration that produced them (rate() is the "
            "generation throughput)",
            ["model_name"],
            registry=r,
        ).labels(m)
        self.tpot = Histogram(
            "adaserve_time_per_output_token_seconds",
            "Per-request mean time per output token after the first",
            cls,
            buckets=TPOT_BUCKETS_S,
            registry=r,
        )
        self.ttft = Histogram(
            "adaserve_time_to_first_token_seconds",
            "Arrival to first output token",
            cls,
            buckets=TTFT_BUCKETS_S,
            registry=r,
        )
        self.e2e = Histogram(
            "adaserve_e2e_request_latency_seconds",
            "Arrival to finish",
            cls,
            buckets=E2E_BUCKETS_S,
            registry=r,
        )
        self.queue_s = self._phase("queue", "Arrival to first scheduled (waiting for a batch slot)")
        self.prefill_s = self._phase("prefill", "First scheduled to first output token")
        self.decode_s = self._phase("decode", "First to last output token")
        # Engine state, sampled after every iteration.
        self.running = Gauge(
            "adaserve_num_requests_running",
            "Requests in the batch: decoding, or prefilling their prompt in chunks",
            registry=r,
        )
        self.waiting = Gauge(
            "adaserve_num_requests_waiting", "Requests queued, not yet running", registry=r
        )
        self.kv_used = Gauge("adaserve_kv_blocks_used", "Target KV-cache blocks in use", registry=r)
        self.kv_total = Gauge(
            "adaserve_kv_blocks_total", "Target KV-cache blocks in the pool", registry=r
        )
        self.kv_usage = Gauge(
            "adaserve_kv_cache_usage_ratio",
            "Target KV-cache usage, 0 (empty) to 1 (full): kv_blocks_used / kv_blocks_total",
            registry=r,
        )
        self.vllm = VllmMetrics(r, m, vllm_aliases)
        self.preemptions = Counter(
            "adaserve_preemptions",
            "Requests preempted to free KV blocks (recomputed later)",
            registry=r,
        )
        # Iterations.
        self.iterations = Counter(
            "adaserve_iterations",
            "Engine iterations by kind (prefill, decode)",
            ["kind"],
            registry=r,
        )
        self.iteration_s = Histogram(
            "adaserve_iteration_seconds",
            "Wall time of one iteration",
            ["kind"],
            buckets=STAGE_BUCKETS_S,
            registry=r,
        )
        self.tree_tokens = Histogram(
            "adaserve_iteration_tree_tokens",
            "Speculated (non-root) tree tokens verified per decode iteration",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.accepted_tokens = Histogram(
            "adaserve_iteration_accepted_tokens",
            "Speculated tokens accepted per decode iteration",
            buckets=TOKEN_COUNT_BUCKETS,
            registry=r,
        )
        self.budget_utilization = Histogram(
            "adaserve_iteration_budget_utilization",
            "Tokens verified / budget B (policy adaserve: its ceiling) per decode iteration",
            buckets=UTILIZATION_BUCKETS,
            registry=r,
        )
        self.stage_s = Histogram(
            "adaserve_iteration_stage_seconds",
            "Time per decode iteration in each stage (draft, select, verify)",
            ["stage"],
            buckets=STAGE_BUCKETS_S,
            registry=r,
        )
        self.host_s = Histogram(
            "adaserve_iteration_host_seconds",
            "Wall time per iteration outside model forwards (scheduling, sampling, "
            "detokenizing, streaming, admitting), counted while the engine stays busy",
            ["kind"],
            buckets=STAGE_BUCKETS_S,
            registry=r,
        )
        # Same meaning as vLLM's spec_decode_* counters, so existing dashboards read them.
        self.spec_drafts = Counter(
            "adaserve_spec_decode_num_drafts",
            "Request-iterations with a draft proposal",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "adaserve_spec_decode_num_draft_tokens",
            "Speculated tokens verified by the target",
            registry=r,
        )
        self.spec_accepted_tokens = Counter(
            "adaserve_spec_decode_num_accepted_tokens", "Speculated tokens accepted", registry=r
        )
        # Speculation control: is the draft trustworthy, and is drafting on?
        depth = ["depth"]
        self.calibration_draft = Gauge(
            "adaserve_calibration_draft_probability",
            "Mean draft probability of recently verified nodes at each tree depth "
            "(what the drafter predicted)",
            depth,
            registry=r,
        )
        self.calibration_predicted = Gauge(
            "adaserve_calibration_predicted_acceptance",
            "Mean calibrated acceptance the scheduler predicted for those nodes",
            depth,
            registry=r,
        )
        self.calibration_observed = Gauge(
            "adaserve_calibration_observed_acceptance",
            "Observed acceptance of those nodes (given their parent was accepted)",
            depth,
            registry=r,
        )
        self.calibration_observations = Gauge(
            "adaserve_calibration_observations",
            "Verified nodes the calibration at each depth rests on (decayed count)",
            depth,
            registry=r,
        )
        self.drafting = Gauge(
            "adaserve_speculation_drafting",
            "1 while speculation control lets the drafter run, 0 while it is off",
            registry=r,
        )
        self.skipped_drafts = Counter(
            "adaserve_speculation_skipped_drafts",
            "Decode iterations of a speculative policy that ran without drafting",
            registry=r,
        )
        self.padded_tokens = Counter(
            "adaserve_iteration_padded_tokens",
            "Padding rows added to verify forwards because the padded size runs faster",
            registry=r,
        )
        self.drafter_info = Gauge(
            "adaserve_drafter_info",
            "The policy and drafter this server runs",
            ["policy", "drafter"],
            registry=r,
        )
        self.backend_info = Gauge(
            "adaserve_backend_info",
            "Who runs the target model: torch or ggml (llama.cpp)",
            ["backend"],
            registry=r,
        )
        # Make every label combination visible from the start (a class with no traffic yet
        # shows 0 instead of being absent, which dashboards and tests read more easily).
        for name in [c for c, _ in slo_classes] + [NO_SLO_CLASS]:
            for metric in (
                self.slo_attained,
                self.slo_violated,
                self.goodput_tokens,
                self.generation_tokens,
                self.ttft_attained,
                self.ttft_violated,
                self.best_effort_requests,
            ):
                metric.labels(name, m)
        for reason in ("stop", "length", "abort", "error"):
            self.requests.labels(reason, m)
        for stage in ("draft", "select", "verify"):
            self.stage_s.labels(stage)
        # The SLO line of each class, so dashboards can draw TPOT against it.
        self.slo_class_bound = Gauge(
            "adaserve_slo_class_tpot_bound_seconds",
            "Upper bound of each SLO class's slo_tpot_ms (+Inf for an open class)",
            ["slo_class"],
            registry=r,
        )
        for name, bound_ms in slo_classes:
            self.slo_class_bound.labels(name).set(bound_ms / 1000.0)
        self._seen_preemptions = 0
        self._seen_prefix = (0, 0)

    def _phase(self, phase: str, what: str) -> Histogram:
        return Histogram(
            f"adaserve_request_{phase}_time_seconds",
            f"{what}, per request",
            ["slo_class", "model_name"],
            buckets=PHASE_BUCKETS_S,
            registry=self.registry,
        )

    def slo_class(self, slo_tpot_ms: float | None) -> str:
        return slo_class_of(slo_tpot_ms, self.slo_classes)

    def best_effort(self, slo_tpot_ms: float | None) -> None:
        """A request admitted best effort (`Admission.best_effort`)."""
        self.best_effort_requests.labels(self.slo_class(slo_tpot_ms), self.model_name).inc()

    def reject(self, reason: str) -> None:
        """A request refused before the engine (`reason`: queue_full, unauthorized, ...)."""
        self.rejected.labels(reason, self.model_name).inc()

    def observe_finished(self, req: FinishedRequest) -> None:
        c, m = req.slo_class, self.model_name
        self.requests.labels(req.finish_reason, m).inc()
        self.prompt_tokens.inc(req.num_prompt_tokens)
        self.generation_tokens.labels(c, m).inc(req.num_output_tokens)
        if req.slo_attained is True:
            self.slo_attained.labels(c, m).inc()
            self.goodput_tokens.labels(c, m).inc(req.num_output_tokens)
        elif req.slo_attained is False:
            self.slo_violated.labels(c, m).inc()
        if req.tpot_attained is True:
            self.tpot_attained.labels(c, m).inc()
        elif req.tpot_attained is False:
            self.tpot_violated.labels(c, m).inc()
        if req.ttft_attained is True:
            self.ttft_attained.labels(c, m).inc()
        elif req.ttft_attained is False:
            self.ttft_violated.labels(c, m).inc()
        if req.tpot_ms is not None and math.isfinite(req.tpot_ms):
            self.tpot.labels(c, m).observe(req.tpot_ms / 1000.0)
        for hist, seconds in (
            (self.ttft, req.ttft_s),
            (self.e2e, req.e2e_s),
            (self.queue_s, req.queue_s),
            (self.prefill_s, req.prefill_s),
            (self.decode_s, req.decode_s),
        ):
            if seconds is not None:
                hist.labels(c, m).observe(seconds)
        self.vllm.observe_finished(req)

    def observe_iteration(self, stats: IterationStats) -> None:
        self.iterations.labels(stats.kind).inc()
        self.emitted_tokens.inc(stats.emitted_tokens)
        self.vllm.observe_emitted(stats.emitted_tokens)
        self.prefill_tokens.inc(stats.prefill_tokens)
        self.iteration_s.labels(stats.kind).observe(stats.total_s)
        if stats.host_s is not None:
            self.host_s.labels(stats.kind).observe(stats.host_s)
        if stats.kind != "decode":
            return
        self.tree_tokens.observe(stats.tree_tokens)
        self.accepted_tokens.observe(stats.accepted_tokens)
        self.budget_utilization.observe(stats.budget_utilization)
        self.stage_s.labels("draft").observe(stats.draft_s)
        self.stage_s.labels("select").observe(stats.select_s)
        self.stage_s.labels("verify").observe(stats.verify_s)
        self.padded_tokens.inc(max(stats.padded_tokens - stats.num_tokens, 0))
        if stats.speculative and not stats.drafted:
            self.skipped_drafts.inc()
        if stats.depth > 0:
            # A speculative iteration drafted for every running request (vLLM counts one
            # "draft" per request per step the same way).
            self.spec_drafts.inc(stats.num_requests)
            self.spec_draft_tokens.inc(stats.tree_tokens)
            self.spec_accepted_tokens.inc(stats.accepted_tokens)

    def set_engine_state(
        self, running: int, waiting: int, kv_used: int, kv_total: int, preemptions: int
    ) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_used.set(kv_used)
        self.kv_total.set(kv_total)
        usage = kv_used / kv_total if kv_total > 0 else 0.0
        self.kv_usage.set(usage)
        self.vllm.set_engine_state(running, waiting, usage)
        if preemptions > self._seen_preemptions:
            self.preemptions.inc(preemptions - self._seen_preemptions)
            self._seen_preemptions = preemptions

    def set_prefix_cache(self, queried_tokens: int, hit_tokens: int) -> None:
        """The prefix cache's running totals (counters advance by the difference)."""
        q0, h0 = self._seen_prefix
        self.prefix_queries.inc(max(queried_tokens - q0, 0))
        self.prefix_hits.inc(max(hit_tokens - h0, 0))
        self._seen_prefix = (queried_tokens, hit_tokens)

    def set_calibration(self, depths: list[DepthCalibration], drafting: bool) -> None:
        """Per depth: what the draft said, what we predicted, what the target accepted."""
        self.drafting.set(1 if drafting else 0)
        for d in depths:
            if d.observations <= 0 or d.acceptance_rate is None:
                continue
            label = str(d.depth)
            self.calibration_draft.labels(label).set(d.mean_draft_prob or 0.0)
            self.calibration_predicted.labels(label).set(d.mean_calibrated_prob or 0.0)
            self.calibration_observed.labels(label).set(d.acceptance_rate)
            self.calibration_observations.labels(label).set(d.observations)

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)


@dataclass(frozen=True)
class MetricsSnapshot:
    """The few totals the stats log line reads from an exposition (summed over labels, so
    over replicas too)."""

    running: float
    waiting: float
    kv_used: float
    kv_total: float
    generated_tokens: float
    finished: float
    slo_attained: float
    slo_violated: float


def snapshot(text: bytes | str) -> MetricsSnapshot:
    """The MetricsSnapshot of an exposition text (this server's, or a cluster's relabelled)."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text if isinstance(text, str) else text.decode()):
        for s in family.samples:
            totals[s.name] = totals.get(s.name, 0.0) + s.value
    return MetricsSnapshot(
        running=totals.get("adaserve_num_requests_running", 0.0),
        waiting=totals.get("adaserve_num_requests_waiting", 0.0),
        kv_used=totals.get("adaserve_kv_blocks_used", 0.0),
        kv_total=totals.get("adaserve_kv_blocks_total", 0.0),
        generated_tokens=totals.get("adaserve_emitted_tokens_total", 0.0),
        finished=totals.get("adaserve_requests_total", 0.0),
        slo_attained=totals.get("adaserve_slo_attained_total", 0.0),
        slo_violated=totals.get("adaserve_slo_violated_total", 0.0),
    )
