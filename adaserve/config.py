"""Every configuration default of adaserve lives here, in frozen dataclasses split by layer."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

# `adaserve` is AdaServe with speculation control (calibrated f(v), a measured cost model, no
# tree that costs more than it yields); `adaserve_paper` is Algorithm 2 exactly as published.
POLICIES = (
    "adaserve",
    "adaserve_paper",
    "global_greedy",
    "equal_greedy",
    "specinfer",
    "sequence",
    "incremental",
)
DTYPES = ("float32", "bfloat16", "float16")
# auto: the named draft (a draft model, or an EAGLE head: drafter "eagle"), else the suffix
# index (every model speculates).
DRAFTERS = ("auto", "model", "eagle", "suffix", "model+suffix", "eagle+suffix")
BACKENDS = ("auto", "torch", "ggml")


@dataclass(frozen=True)
class ModelConfig:
    """Which weights to run and how. `model=None` means the default SmolLM2-135M-Instruct."""

    model: str | None = None
    draft_model: str | None = None
    # Who proposes candidate trees (DRAFTERS); "model" without draft_model takes the default
    # target's truncated draft.
    drafter: str = "auto"
    # A draft model's LM head keeps only the target's K most frequent output tokens (None:
    # the full vocabulary); the ranking comes from `draft_vocab_file`, else the one shipped for
    # the default target, else token-id order. Default K: see docs/speculation.md.
    draft_vocab_size: int | None = 16384
    draft_vocab_file: str | None = None
    dtype: str = "float32"
    device: str = "cpu"
    # None: the model's own max_position_embeddings.
    max_model_len: int | None = None
    # "auto": flashinfer on CUDA when installed and the dtype is float16/bfloat16, else torch.
    attention_backend: str = "auto"
    # Who runs the target (BACKENDS): "torch" (this package's model code, any device),
    # "ggml" (a GGUF model in its own quantization on llama.cpp, CPU; the `cpu` extra), or
    # "auto": ggml for a GGUF model on the CPU when llama-cpp-python is installed, else torch.
    backend: str = "auto"
    # Replay forwards from CUDA graphs where the attention backend allows (FlashInfer): the
    # target's and a draft model's forwards of up to cuda_graph_max_tokens tokens (draft
    # steps included). False: every forward eager (vLLM's --enforce-eager).
    cuda_graphs: bool = True
    cuda_graph_max_tokens: int = 256
    # Capture the graphs of decode iterations (every request count up to max_num_seqs, with up
    # to B tree tokens) when the engine starts, instead of in the first iteration of each shape.
    cuda_graph_capture_at_start: bool = True
    # Seed for requests that give none, so runs repeat.
    seed: int = 0
    # CPU threads of the forwards (torch and llama.cpp); None: every core this process may use.
    # Replicas sharing a machine split its cores (`adaserve serve --replicas N`).
    threads: int | None = None
    # A branch, tag or commit of a Hugging Face hub `model` (None: main), so a deployment
    # pins the weights it was tested with; a local dir or file has no revision.
    revision: str | None = None
    # A local dir or hub id whose tokenizer replaces the model's (a GGUF's own tokenizer
    # lacks a chat template, or a fixed tokenizer ships in another repo); its default branch.
    tokenizer: str | None = None
    # The GGUF file to serve out of a hub repo or a local dir holding several quantizations
    # (like llama-server's `-hf REPO` with a file name); None: the safetensors checkpoint.
    gguf_file: str | None = None
    # Let transformers run code a hub repo ships for its tokenizer and config (AutoTokenizer,
    # AutoConfig). The model itself always runs this package's code or llama.cpp, never the
    # repo's: only trust a repo you would run code from.
    trust_remote_code: bool = False

    def __post_init__(self) -> None:
        self._check_source()
        if self.cuda_graph_max_tokens < 1:
            raise ValueError(
                f"cuda_graph_max_tokens must be >= 1, got {self.cuda_graph_max_tokens}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1 or None, got {self.threads}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.draft_vocab_size is not None and self.draft_vocab_size < 1:
            raise ValueError(f"draft_vocab_size must be >= 1 or None, got {self.draft_vocab_size}")
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.drafter == "suffix" and self.draft_model is not None:
            raise ValueError(
                "drafter 'suffix' uses no draft model; drop draft_model or use drafter "
                "'model' or 'model+suffix'"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {self.max_model_len}")

    def _check_source(self) -> None:
        """Where the weights come from: revision and gguf_file need a named model."""
        if self.model is None and (self.revision is not None or self.gguf_file is not None):
            raise ValueError(
                "revision and gguf_file pick files of a named model; give model "
                "(a hub id such as owner/name, or a local dir) as well"
            )
        if self.gguf_file is not None:
            if not self.gguf_file.endswith(".gguf"):
                raise ValueError(f"gguf_file must name a .gguf file, got {self.gguf_file!r}")
            if self.model is not None and self.model.endswith(".gguf"):
                raise ValueError(
                    f"model {self.model!r} is a GGUF file already; gguf_file picks a file "
                    "inside a hub repo or a dir"
                )
        for name in ("revision", "tokenizer"):
            if getattr(self, name) == "":
                raise ValueError(f"{name} must be non-empty or None")

    @property
    def resolved_drafter(self) -> str:
        """The drafter that runs: `auto` means the named draft (a model or an EAGLE head),
        else suffix."""
        if self.drafter == "auto":
            if self.draft_model is None:
                return "suffix"
            from adaserve.exec.model.eagle import is_eagle_head

            return "eagle" if is_eagle_head(Path(self.draft_model).expanduser()) else "model"
        return self.drafter


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` wins over `memory_fraction` when both are given."""

    block_size: int = 16
    num_blocks: int | None = None
    # Fraction of system RAM (CPU) or of free GPU memory (CUDA) for the target's KV blocks.
    memory_fraction: float = 0.05
    # Draft KV gets this fraction of the target's block count (it also holds scratch tree slots).
    draft_blocks_ratio: float = 1.0
    # Reuse the KV of full blocks whose tokens (and everything before them) were seen before.
    enable_prefix_caching: bool = True
    # Most cells of the ggml backend's KV cache when sized from memory: llama.cpp walks every
    # cell to drop or copy a sequence, so a cache far larger than the traffic costs time each
    # step.
    ggml_max_cache_tokens: int = 65536
    # Most tokens one llama.cpp decode call takes (a bigger forward is split into calls), and
    # most it computes at once (a micro-batch).
    ggml_n_batch: int = 2048
    ggml_n_ubatch: int = 512
    # Most cells the ggml backend's prefix cache keeps for requests that have ended (each
    # can cost every forward a mask walk: exec/ggml_cache.py); 0 (default) keeps none, and
    # prefixes are shared only while some request holds them.
    ggml_kept_prefix_cells: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        for name in ("ggml_max_cache_tokens", "ggml_n_batch", "ggml_n_ubatch"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.ggml_kept_prefix_cells < 0:
            raise ValueError(
                f"ggml_kept_prefix_cells must be >= 0, got {self.ggml_kept_prefix_cells}"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 0.95:
            raise ValueError(f"memory_fraction must be in (0, 0.95], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching and speculation knobs. Symbols as in the paper (B, D_max, W_max, n_max)."""

    policy: str = "incremental"
    max_num_seqs: int = 64
    # Cap on prompt tokens prefilled in one iteration while nothing decodes (without chunked
    # prefill: per prefill iteration; a longer single prompt still runs alone).
    max_num_batched_tokens: int = 2048
    # Chunked prefill: prompts advance in chunks inside decode iterations, each chunk as large
    # as the running requests' TPOT SLOs allow (request_manager/prefill.py); requests without
    # an SLO tolerate max_prefill_chunk tokens per iteration; min_prefill_chunk goes when the
    # first prompt's TTFT objective is lost (while it can be met, it keeps the prompt moving).
    chunked_prefill: bool = True
    max_prefill_chunk: int = 256
    min_prefill_chunk: int = 16
    # Chunks keep running streams this fraction under their TPOT SLO (forwards stray from
    # their prediction; a stream paced at its SLO misses it half the time), and a stream behind
    # that pace takes back up to slo_repay of a pace per iteration from the prompts.
    slo_pace_margin: float = 0.05
    slo_repay: float = 0.5
    # A stream far ahead of its pace lends up to this share of its banked time to one
    # iteration's prompt chunks (at least one pace; request_manager/prefill.py).
    slo_bank_spend: float = 0.5
    # A stream also lends this share of the slack its remaining tokens are predicted to leave
    # at its pace (max_tokens left x (pace - its time a token now)): a prompt goes in now on
    # time the stream would bank later (request_manager/prefill.py; 0: the past bank only).
    slo_future_lend: float = 0.0
    # A stream ahead of its pace by two iterations sits out an iteration that would otherwise
    # run longer than a tighter stream's pace affords (request_manager/pacing.py): on a
    # compute-bound CPU forward every row lengthens every stream's gap.
    slo_defer_rows: bool = True
    # A request that names no slo_ttft_ms gets a TTFT objective: default_ttft_floor_ms plus
    # default_ttft_factor x the time to prefill its prompt alone (request_manager/slo.py).
    # Chunked prefill sizes chunks to meet it; benchmarks count it in SLO attainment.
    default_ttft_factor: float = 4.0
    default_ttft_floor_ms: float = 1000.0
    # Longest an iteration carrying prompt chunks is planned to run (0: no limit), idle or
    # not, unless a TTFT objective needs more: a short prompt arriving during it waits for it
    # whole, and its objective is about the floor, so half the floor leaves it the rest.
    prefill_iteration_ms: float = 500.0
    # B: tokens verified per target forward, all requests' roots included.
    budget: int = 16
    # Policy adaserve only: the most tokens it verifies in one forward (roots included) when
    # speculation control finds them worth their time; B still prices an iteration for the
    # SLO step's A(r) and sizes what is prepared ahead (CUDA graphs). None: B. The server
    # derives it from its start-up profile like B, at `CEILING_FACTOR` (profile.py): a
    # forward of B tokens costs 1.5x a 1-token one, which leaves a batch of many requests
    # room for little more than their roots. Tokens past B go into a forward only while it
    # fits every running stream's pace (docs/speculation.md, "The budget ceiling").
    budget_ceiling: int | None = None
    max_depth: int = 6  # D_max
    max_width: int = 4  # W_max
    # Cap on a request's tree size (root included, as in Algorithm 2) in the SLO-customized step.
    n_max: int = 8
    gamma: int = 4  # chain length of the `sequence` baseline
    specinfer_expansion: tuple[int, ...] = (1, 1, 3, 1, 1, 1, 1, 1)
    # Weight of the newest sample in the moving estimate of the iteration latency t_spec.
    t_spec_ema: float = 0.2
    # Initial t_spec before any iteration was measured (seconds).
    t_spec_init_s: float = 0.05
    # Waiting-queue bound; the server answers 429 beyond it. None: unbounded.
    max_waiting: int | None = None
    # Suffix drafter: longest n-gram matched, shortest match used, occurrences per tree,
    # weight of a global-cache occurrence against a request-local one, additive smoothing
    # (suffix_alpha_match_len L > 0: suffix_alpha x L / m after a match of m tokens, so the
    # draft's probability says how long the match was; 0: suffix_alpha at every length),
    # and the global cache of finished outputs in tokens (0: request-local only).
    # suffix_max_depth: its trees' depth bound. A lookup costs no draft step per level, so
    # its trees may grow deeper than max_depth (which bounds a draft model's steps), up to
    # the request's share of the budget; speculation control prunes what does not pay.
    suffix_max_depth: int = 16
    suffix_max_ngram: int = 8
    suffix_min_match: int = 2
    suffix_max_matches: int = 32
    suffix_global_weight: float = 0.5
    suffix_alpha: float = 1.0
    suffix_alpha_match_len: int = 0
    suffix_cache_tokens: int = 65536
    # Speculation control (policy adaserve): calibration bins and prior, forgetting of the
    # calibration and of the online cost model, and how long drafting stays off after it
    # lost (iterations; doubles after every probe that loses again, up to the max).
    calibration_buckets: int = 10
    calibration_prior_strength: float = 4.0
    calibration_decay: float = 0.995
    cost_forget: float = 0.98
    probe_interval_min: int = 8
    probe_interval_max: int = 256
    # The controller's score R: weight of the newest drafting iteration in its moving
    # average, and iterations scored before the first on/off decision (cold start trusts the
    # prior). Until explore_observations depth-1 nodes were verified, nothing is verified on
    # the prior's word alone: trees keep their most probable nodes, as many as add at most
    # explore_cost of a plain forward's time, and at least one (calibration must first see
    # what the drafter is worth; on llama.cpp a 16-node tree cost 8x a decode and exploring
    # whole trees lost 40% on a new prompt); later one node when nothing pays. Exploring may
    # cost, net of the tokens it gets accepted, explore_budget of the plain forward time. A
    # forward is padded only when predicted pad_min_saving cheaper, and every
    # pad_explore_every-th time it runs unpadded anyway, to keep measuring the exact size.
    control_score_ema: float = 0.3
    control_min_scored: int = 3
    explore_observations: int = 16
    explore_cost: float = 0.5
    explore_budget: float = 0.03
    pad_min_saving: float = 0.1
    pad_explore_every: int = 16
    # Append every verified tree to this JSONL file (the simulator's recorded acceptance).
    record_acceptance: str | None = None
    # Append one line per iteration (what it ran, predicted and measured times) to this JSONL
    # file: the iteration timeline (request_manager/timeline.py).
    record_iterations: str | None = None
    # Admission (request_manager/admission.py). --admission slo admits a request while the
    # predicted TPOT is within slo_headroom of the SLO (and its predicted first token within
    # slo_headroom of its TTFT objective). 1.0 since 2026-11-29: the prediction already
    # carries how much slower recent iterations ran than predicted (decode_slowdown), and
    # against 0.85 it met more SLOs in 5 of 6 paired replays of the peer comparison
    # (docs/results.md, "How much to refuse, measured in rounds"); 0.85 had been set when
    # admitted 120 ms requests ran 1-25% slower than predicted at 10x the sustainable rate
    # (docs/results.md, "Overload"). Weights of the newest iteration in the moving averages
    # of the decode slowdown (period over prediction) and forward tokens per request, of
    # tokens emitted per request, and of host time per iteration (the plain mean over its
    # first 1 / host_ema samples).
    slo_headroom: float = 1.0
    # A request refused only for the prompt tokens that prompts due after its first token
    # force into every forward is admitted over them; they yield (prefill.forced_chunk).
    prompts_yield: bool = True
    # A request refused for its TPOT (not its first token) is held, unscheduled and with no KV,
    # for up to this share of its TTFT objective, and admitted the moment the load allows: a
    # stream that finishes a second later makes room it would otherwise be refused over
    # (api/async_engine.py; 0: refuse at arrival).
    admission_hold: float = 0.5
    # A request admission still refuses (for its TPOT when its hold runs out, for its first
    # token, or for its work under overload) is served best effort instead, while fewer than
    # this many are and its first token, its prompt last, is predicted within
    # admission_best_effort_wait x its TTFT objective: the scheduler keeps no pace for it, its
    # row sits out first and its prompt goes last (Admission.best_effort_refusal). 0: refuse.
    admission_best_effort: int = 8
    admission_best_effort_wait: float = 4.0
    # Under overload (the arrivals of the last admission_work_window_s need more compute than
    # admission_work_share of its seconds), --admission slo serves the requests that need the
    # least compute first: it refuses one
    # whose work (its prompt's prefill alone plus its max_tokens at the marginal cost of a
    # decode row, from the cost model) lies above what the cheapest of the window's arrivals
    # fill of admission_work_share of the window's seconds. A long prompt costs the machine
    # what several short requests do, and each counts one SLO (docs/scheduling.md, "Work").
    # 0: off.
    admission_work_share: float = 0.85
    admission_work_window_s: float = 30.0
    admission_ema: float = 0.2
    tokens_per_request_ema: float = 0.1
    host_ema: float = 0.1

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if not 0.0 <= self.slo_pace_margin < 1.0:
            raise ValueError(f"slo_pace_margin must be in [0, 1), got {self.slo_pace_margin}")
        for name in ("explore_cost", "explore_budget"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.pad_min_saving < 1.0:
            raise ValueError(f"pad_min_saving must be in [0, 1), got {self.pad_min_saving}")
        for name in ("default_ttft_factor", "default_ttft_floor_ms", "prefill_iteration_ms"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0.0 <= self.slo_bank_spend <= 1.0:
            raise ValueError(f"slo_bank_spend must be in [0, 1], got {self.slo_bank_spend}")
        if not 0.0 <= self.slo_future_lend <= 1.0:
            raise ValueError(f"slo_future_lend must be in [0, 1], got {self.slo_future_lend}")
        if self.admission_best_effort < 0:
            raise ValueError(
                f"admission_best_effort must be >= 0, got {self.admission_best_effort}"
            )
        if not self.admission_best_effort_wait > 0.0:
            raise ValueError(
                f"admission_best_effort_wait must be > 0, got {self.admission_best_effort_wait}"
            )
        if not 0.0 <= self.admission_hold < 1.0:
            raise ValueError(f"admission_hold must be in [0, 1), got {self.admission_hold}")
        if not self.admission_work_share >= 0.0:
            raise ValueError(f"admission_work_share must be >= 0, got {self.admission_work_share}")
        if not self.admission_work_window_s > 0.0:
            raise ValueError(
                f"admission_work_window_s must be > 0, got {self.admission_work_window_s}"
            )
        if not 0.0 <= self.slo_repay <= 1.0:
            raise ValueError(f"slo_repay must be in [0, 1], got {self.slo_repay}")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_prefill_chunk",
            "min_prefill_chunk",
            "budget",
            "max_depth",
            "max_width",
            "n_max",
            "gamma",
            "suffix_max_depth",
            "suffix_max_ngram",
            "suffix_min_match",
            "suffix_max_matches",
            "calibration_buckets",
            "probe_interval_min",
            "probe_interval_max",
            "control_min_scored",
            "explore_observations",
            "pad_explore_every",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.budget_ceiling is not None and self.budget_ceiling <= 0:
            raise ValueError(f"budget_ceiling must be > 0, got {self.budget_ceiling}")
        if not self.specinfer_expansion or min(self.specinfer_expansion) <= 0:
            raise ValueError(
                f"specinfer_expansion must be positive ints, got {self.specinfer_expansion}"
            )
        if not 0.0 < self.t_spec_ema <= 1.0:
            raise ValueError(f"t_spec_ema must be in (0, 1], got {self.t_spec_ema}")
        if self.suffix_cache_tokens < 0:
            raise ValueError(f"suffix_cache_tokens must be >= 0, got {self.suffix_cache_tokens}")
        if self.suffix_min_match > self.suffix_max_ngram:
            raise ValueError(
                f"suffix_min_match ({self.suffix_min_match}) must be <= suffix_max_ngram "
                f"({self.suffix_max_ngram})"
            )
        for name in (
            "calibration_decay",
            "cost_forget",
            "slo_headroom",
            "control_score_ema",
            "admission_ema",
            "tokens_per_request_ema",
            "host_ema",
        ):
            if not 0.0 < getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {getattr(self, name)}")

    @property
    def speculative(self) -> bool:
        return self.policy != "incremental"

    @property
    def selection_budget(self) -> int:
        """Tokens a forward may verify: the ceiling for the controlled policy, else B."""
        if self.controlled and self.budget_ceiling is not None:
            return max(self.budget, self.budget_ceiling)
        return self.budget

    @property
    def controlled(self) -> bool:
        """Speculation control: calibrated f(v), cost-model pruning, no drafting while it loses."""
        return self.policy == "adaserve"


def parse_slo_classes(spec: str) -> tuple[tuple[str, float], ...]:
    """'urgent=50,normal=150,relaxed=inf' -> (('urgent', 50.0), ...), sorted by bound."""
    classes = []
    for part in spec.split(","):
        name, sep, bound = part.strip().partition("=")
        if not sep or not name:
            raise ValueError(f"SLO class {part!r} must look like name=milliseconds")
        value = math.inf if bound.strip() in ("inf", "") else float(bound)
        if value <= 0:
            raise ValueError(f"SLO class bound must be > 0, got {part!r}")
        classes.append((name.strip(), value))
    return tuple(sorted(classes, key=lambda c: c[1]))


@dataclass(frozen=True)
class ServerConfig:
    """HTTP server settings."""

    host: str = "127.0.0.1"
    port: int = 8000
    # Keys accepted in 'Authorization: Bearer KEY' (empty: no key needed). /health never
    # needs one; /metrics only with protect_metrics.
    # "slo": refuse (429 + Retry-After) a request whose slo_tpot_ms the current load cannot
    # meet, rather than queue it for seconds (at 1 rps on the development machine it doubled
    # goodput over queueing, docs/results.md); "queue": admit every valid request while the
    # waiting queue has room (--max-waiting).
    admission: str = "slo"
    api_keys: tuple[str, ...] = ()
    protect_metrics: bool = False
    served_model_name: str | None = None
    default_slo_tpot_ms: float | None = None
    slo_classes: tuple[tuple[str, float], ...] = field(
        default_factory=lambda: parse_slo_classes("urgent=50,normal=150,relaxed=inf")
    )
    # Seconds a 429 asks the client to wait.
    retry_after_s: int = 1
    # `adaserve serve` speculates by default: the default model gets its draft automatically.
    policy: str = "adaserve"
    # Seconds running requests may take to finish after SIGINT/SIGTERM before they are aborted.
    shutdown_timeout_s: float = 30.0
    log_level: str = "info"
    # Seconds between two stats log lines (running, waiting, KV, tok/s, SLO attainment); 0: none.
    log_stats_interval_s: float = 10.0
    # CORS: origins browsers may call from (empty: no CORS headers at all, as before), and the
    # methods and request headers they may use.
    allowed_origins: tuple[str, ...] = ()
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    # Also export the metrics under vLLM's names (vLLM's dashboards, KEDA/HPA rules).
    vllm_metrics: bool = False

    def __post_init__(self) -> None:
        if self.admission not in ("queue", "slo"):
            raise ValueError(f"admission must be 'queue' or 'slo', got {self.admission!r}")
        if not self.log_stats_interval_s >= 0:
            raise ValueError(
                f"log_stats_interval_s must be >= 0 (0 turns the stats line off), got "
                f"{self.log_stats_interval_s}"
            )
