"""A request: its sampling parameters and SLO, its tokens, timing, status and KV block tables."""

from __future__ import annotations

import dataclasses
import enum
import math
import time
from dataclasses import dataclass, field

import torch

from adaserve.request_manager.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from adaserve.request_manager.structured import Grammar, StructuredOutput


@dataclass(frozen=True)
class SamplingParams:
    """How to sample a request, and its TPOT SLO (None: best effort)."""

    max_tokens: int = 16
    # Samples per prompt: LLM.generate and the server run each as a request of its own
    # (`for_choice`); the engine itself takes n = 1 only.
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Context-dependent processing (vLLM's semantics; `logits_process.py`).
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings wait for this many tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output
    presence_penalty: float = 0.0  # subtracted from tokens the output has
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_p: float = 0.0  # drop tokens below min_p times the top token's probability
    # (token id, bias) pairs added to the raw logits (OpenAI's logit_bias; a dict is accepted).
    logit_bias: tuple[tuple[int, float], ...] = ()
    include_stop_str_in_output: bool = False  # the matched stop string stays in the text
    skip_special_tokens: bool = True  # special tokens are left out of the text
    # Return each token's logprob and this many alternatives (None: no logprobs).
    logprobs: int | None = None
    slo_tpot_ms: float | None = None
    # Time-to-first-token SLO: chunked prefill gives this request's prompt the chunks it needs.
    slo_ttft_ms: float | None = None
    # The output held to a JSON schema, regex, grammar or choice (`structured.py`).
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(sorted(bias or ())))
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be an integer > 0, got {self.max_tokens!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or (self.top_k < -1 or self.top_k == 0):
            raise ValueError(f"top_k must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.slo_tpot_ms is not None and not self.slo_tpot_ms > 0:
            raise ValueError(f"slo_tpot_ms must be > 0, got {self.slo_tpot_ms}")
        if self.slo_ttft_ms is not None and not self.slo_ttft_ms > 0:
            raise ValueError(f"slo_ttft_ms must be > 0, got {self.slo_ttft_ms}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._check_processing()

    def for_choice(self, j: int) -> SamplingParams:
        """The parameters of sample j of a prompt (n = 1): with a seed, seed + j (as vLLM), so
        the samples differ yet repeat; without one each request draws its own seed."""
        seed = self.seed
        if seed is not None and j:
            seed = (seed + j) % 2**64 if seed >= 0 else seed + j
        return dataclasses.replace(self, n=1, seed=seed)

    def _check_processing(self) -> None:
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be an integer in [0, max_tokens = {self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        if not (0.0 < self.repetition_penalty < math.inf):
            raise ValueError(
                f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (0: off), got {getattr(self, name)}")
        for token, bias in self.logit_bias:
            if not (isinstance(token, int) and token >= 0 and -100.0 <= bias <= 100.0):
                raise ValueError(
                    f"logit_bias maps token ids >= 0 to biases in [-100, 100], got {token}: {bias}"
                )
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (0: off), got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}] (None: off), got {self.logprobs}"
            )
        if self.structured_output is not None:
            # Once the structure is complete the grammar allows only the end of the output.
            if self.ignore_eos:
                raise ValueError(
                    "ignore_eos cannot be combined with structured output: the output ends "
                    "where its structure does"
                )
            if self.min_tokens:
                raise ValueError(
                    "min_tokens cannot be combined with structured output: the output ends "
                    "where its structure does"
                )


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Timing of one request, in seconds (monotonic clock) and derived latencies."""

    arrival_time: float
    # First admitted to the batch (KV reserved); a preempted request keeps its first time.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finish_time: float | None = None
    num_output_tokens: int = 0
    slo_tpot_ms: float | None = None
    slo_ttft_ms: float | None = None
    # The first token's objective: slo_ttft_ms, else the scheduler's default from the prompt
    # length (`slo.ttft_objective_ms`), set when the scheduler takes the request.
    ttft_objective_ms: float | None = None
    token_times: list[float] = field(default_factory=list)  # emit time of every output token
    # Speculation statistics.
    num_iterations: int = 0
    num_tree_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_ms(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.num_output_tokens < 2 or self.first_token_time is None:
            return None
        assert self.last_token_time is not None
        return (
            1000.0 * (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)
        )

    @property
    def tpot_attained(self) -> bool | None:
        """TPOT within the SLO (a single-token answer trivially meets it); None without an SLO."""
        if self.slo_tpot_ms is None:
            return None
        tpot = self.tpot_ms
        return True if tpot is None else tpot <= self.slo_tpot_ms

    @property
    def ttft_attained(self) -> bool | None:
        """First token within its objective (`ttft_objective_ms`, else `slo_ttft_ms`); None
        without one (or before the first token)."""
        objective = (
            self.ttft_objective_ms if self.ttft_objective_ms is not None else self.slo_ttft_ms
        )
        if objective is None or self.ttft_s is None:
            return None
        return 1000.0 * self.ttft_s <= objective

    @property
    def slo_attained(self) -> bool | None:
        """The SLO met as its user sees it: TPOT within `slo_tpot_ms` and the first token
        within its objective; None without a TPOT SLO."""
        tpot = self.tpot_attained
        return None if tpot is None else tpot and self.ttft_attained is not False

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    # A request's three phases (vLLM's queue, prefill and decode times): they add up to the
    # arrival-to-last-token time. None for a phase it never reached.
    @property
    def queue_s(self) -> float | None:
        t = self.first_scheduled_time
        return None if t is None else t - self.arrival_time

    @property
    def prefill_s(self) -> float | None:
        t, first = self.first_scheduled_time, self.first_token_time
        return None if t is None or first is None else first - t

    @property
    def decode_s(self) -> float | None:
        first, last = self.first_token_time, self.last_token_time
        return None if first is None or last is None else last - first


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # with SamplingParams.logprobs: per token


@dataclass
class RequestOutput:
    """What `generate` returns, and what a stream yields (with the new text/tokens in `delta_*`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    # finish_reason "error": this request's own processing failed (others went on).
    error: str | None = None


class Request:
    """One generation request. The scheduler advances it; it owns tokens, timing, KV tables."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
        default_seed: int = 0,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.output_token_ids: list[int] = []
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.error: str | None = None  # finish_reason "error": what failed, with an error id
        self.metrics = RequestMetrics(
            arrival_time if arrival_time is not None else time.monotonic(),
            slo_tpot_ms=params.slo_tpot_ms,
            slo_ttft_ms=params.slo_ttft_ms,
            ttft_objective_ms=params.slo_ttft_ms,
        )
        # Admission let a stream in over this prompt (`Admission.refusal`): its TTFT objective
        # no longer forces prompt tokens into the streams' forwards (prefill.forced_chunk).
        self.prefill_yields = False
        # Admission could not meet its TPOT SLO and served it anyway, best effort
        # (`Admission.best_effort`): the scheduler keeps no pace for it (`paced_slo_tpot_ms`),
        # its row sits out first (pacing.py) and its prompt goes last (prefill.py).
        self.best_effort = False
        # KV state. Target: `num_cached` entries are committed tokens (all tokens but the root).
        self.block_table: list[int] = []
        self.num_cached = 0
        self.draft_block_table: list[int] = []
        self.draft_num_cached = 0
        # Prefix-cache hash chains of the full committed blocks in each table.
        self.block_hashes: list[int] = []
        self.draft_block_hashes: list[int] = []
        seed = (
            params.seed
            if params.seed is not None
            else hash((default_seed, request_id)) & 0x7FFFFFFF
        )
        self.generator = torch.Generator().manual_seed(seed)
        # Output text cut before a matched stop string (None: no stop string matched).
        self.stop_text: str | None = None
        self.sent_text_len = 0
        self.sent_token_len = 0
        # With params.logprobs: one entry per output token (the scheduler appends them).
        self.logprobs: list[TokenLogprob] = []
        # Incremental detokenization (OutputProcessor): the streaming decoder, the complete
        # characters of the first `detok_len` output tokens, and how far stop strings were
        # searched in them.
        self.detok: object | None = None
        self.text = ""
        self.detok_len = 0
        self.stop_searched = 0
        # With params.structured_output: where the output stands in its grammar (LLMEngine
        # builds it; every appended token advances it).
        self.grammar: Grammar | None = None

    @property
    def paced_slo_tpot_ms(self) -> float | None:
        """The TPOT SLO the scheduler paces this request at: None while it is served best
        effort (its own slo_tpot_ms still judges it in metrics and benchmarks)."""
        return None if self.best_effort else self.params.slo_tpot_ms

    @property
    def ttft_objective_ms(self) -> float | None:
        """The first token's objective (ms from arrival), which chunked prefill meets."""
        return self.metrics.ttft_objective_ms

    @ttft_objective_ms.setter
    def ttft_objective_ms(self, ms: float | None) -> None:
        self.metrics.ttft_objective_ms = ms

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def last_token(self) -> int:
        return self.all_token_ids[-1]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def schedule(self, now: float) -> None:
        """Admitted to the batch: its KV is reserved and its prompt will be computed."""
        self.status = RequestStatus.RUNNING
        if self.metrics.first_scheduled_time is None:
            self.metrics.first_scheduled_time = now

    def append_token(self, token: int, now: float) -> None:
        if self.grammar is not None:
            self.grammar.accept(token)
        self.output_token_ids.append(token)
        m = self.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.last_token_time = now
        m.token_times.append(now)
        m.num_output_tokens = len(self.output_token_ids)

    def finish(self, reason: str, now: float) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.metrics.finish_time = now
