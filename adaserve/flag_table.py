"""What the generated flags say about each config field: help text, `--help` group, choices,
metavar and extra spellings. config.py stays the one place of defaults (and why); this is the
one place of how a field reads on the command line.

A new config field needs nothing here: it gets `--field-name`, its type from the annotation,
the group of its dataclass and a help line pointing at config.py. Add a line to FIELD_HELP
(and GROUP_OF where its dataclass's group is wrong) to make `--help` read well.
"""

from __future__ import annotations

from adaserve.config import (
    BACKENDS,
    DRAFTERS,
    DTYPES,
    POLICIES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
)

# `--help` groups, in the order they print: title -> description.
GROUPS: dict[str, str] = {
    "config sources": "precedence: command line > ADASERVE_<FIELD> variables > --config file "
    "> config.py",
    "model": "which weights run, and how",
    "KV cache": "the paged KV cache (num_blocks wins over memory_fraction)",
    "scheduling": "batching, chunked prefill, TTFT objectives and admission estimates",
    "speculation": "budget B, tree shape, drafters and speculation control",
    "recording": "JSONL logs of what the engine did",
    "server": "HTTP server, API keys and admission",
    "SLOs": "SLOs of requests that give none, and the metric classes",
    "logging and metrics": "log lines and /metrics",
    "CORS": "browsers calling the API from a web page",
    "scale-out": "Ray Serve replicas; the `cluster` extra: pip install 'adaserve[cluster]'",
}

CLASS_GROUP: dict[type, str] = {
    ModelConfig: "model",
    CacheConfig: "KV cache",
    SchedulerConfig: "scheduling",
    ServerConfig: "server",
}
_SPECULATION_PREFIXES = ("suffix_", "calibration_", "control_", "explore_", "probe_", "pad_")
GROUP_OF: dict[str, str] = {
    **dict.fromkeys(
        (
            "budget",
            "budget_ceiling",
            "max_depth",
            "max_width",
            "n_max",
            "gamma",
            "specinfer_expansion",
        ),
        "speculation",
    ),
    **dict.fromkeys(("t_spec_ema", "t_spec_init_s", "cost_forget"), "speculation"),
    **dict.fromkeys(("record_acceptance", "record_iterations"), "recording"),
    **dict.fromkeys(("default_slo_tpot_ms", "slo_classes", "retry_after_s"), "SLOs"),
    **dict.fromkeys(("log_level", "log_stats_interval_s", "vllm_metrics"), "logging and metrics"),
    **dict.fromkeys(("allowed_origins", "allowed_methods", "allowed_headers"), "CORS"),
}


def group_of(cls: type, name: str) -> str:
    """The `--help` group of config field `name` of dataclass `cls`."""
    if name in GROUP_OF:
        return GROUP_OF[name]
    if name.startswith(_SPECULATION_PREFIXES):
        return "speculation"
    return CLASS_GROUP.get(cls, "model")


LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
CHOICES: dict[str, tuple[str, ...]] = {
    "policy": POLICIES,
    "dtype": DTYPES,
    "drafter": DRAFTERS,
    "backend": BACKENDS,
    "attention_backend": ("auto", "torch", "flashinfer"),
    "admission": ("queue", "slo"),
    "log_level": LOG_LEVELS,
}
# Values spelled another way, e.g. vLLM's --dtype half.
VALUE_ALIASES: dict[str, dict[str, str]] = {"dtype": {"half": "float16", "float": "float32"}}
# Config fields that are positional arguments rather than flags.
POSITIONALS = ("model",)
# Spellings the flag had before it was generated (kept working), beside --field-name.
EXTRA_FLAGS: dict[str, tuple[str, ...]] = {
    "api_keys": ("--api-key",),
    "enable_prefix_caching": ("--prefix-caching",),  # so --no-prefix-caching still works
    "shutdown_timeout_s": ("--drain-timeout", "--shutdown-timeout"),
    "log_stats_interval_s": ("--log-stats-interval",),
}
METAVARS: dict[str, str] = {
    "draft_model": "PATH",
    "draft_vocab_file": "FILE",
    "revision": "REV",
    "tokenizer": "NAME",
    "gguf_file": "FILE",
    "device": "DEVICE",
    "record_acceptance": "FILE",
    "record_iterations": "FILE",
    "shutdown_timeout_s": "S",
    "log_stats_interval_s": "S",
    "retry_after_s": "S",
    "api_keys": "KEY",
    "allowed_origins": "ORIGINS",
    "allowed_methods": "METHODS",
    "allowed_headers": "HEADERS",
    "slo_classes": "SPEC",
    "served_model_name": "NAME",
    "host": "HOST",
}

FIELD_HELP: dict[str, str] = {
    # ModelConfig
    "model": "a Hugging Face hub id (owner/name), a checkpoint dir or a .gguf file "
    "(default: SmolLM2-135M-Instruct)",
    "revision": "with a hub id: the branch, tag or commit to download (default: main)",
    "tokenizer": "a dir or hub id whose tokenizer replaces the model's",
    "gguf_file": "the .gguf file to serve out of a hub repo or dir (as llama-server's -hf)",
    "trust_remote_code": "let transformers run code a hub repo ships for its tokenizer and "
    "config (never for the model: its code is adaserve's own)",
    "draft_model": "draft checkpoint sharing the target's tokenizer, or an EAGLE head dir (with "
    "the default target and none given: --drafter model takes a truncated copy of the target, "
    "--drafter eagle the shipped head)",
    "drafter": "who proposes candidate trees: auto = the draft model or EAGLE head if "
    "--draft-model is given, else the suffix index over the prompt, output and recent traffic",
    "draft_vocab_size": "a draft model's LM head keeps the target's K most frequent tokens "
    "(none: the full vocabulary)",
    "draft_vocab_file": "token ranking for --draft-vocab-size (from `adaserve draft-vocab`)",
    "dtype": "weight and KV dtype",
    "device": "cpu or cuda[:N]",
    "max_model_len": "prompt + output token limit (default: the model's own)",
    "attention_backend": "auto = flashinfer on CUDA with float16/bfloat16 when installed",
    "backend": "who runs the target: ggml = a GGUF model in its own quantization on llama.cpp "
    "(CPU, `pip install adaserve[cpu]`), torch = this package's model code; auto = ggml for a "
    "GGUF model on the CPU when llama-cpp-python is installed",
    "cuda_graphs": "replay forwards of up to --cuda-graph-max-tokens tokens and draft steps "
    "from CUDA graphs where the attention backend allows (FlashInfer); --no-cuda-graphs runs "
    "every forward eagerly, like vLLM's --enforce-eager",
    "cuda_graph_max_tokens": "the largest forward (tokens) replayed from a CUDA graph; larger "
    "ones (prompt chunks) run eagerly",
    "cuda_graph_capture_at_start": "capture the graphs of decode iterations (every request count "
    "up to --max-num-seqs, with up to B tree tokens) at start-up, so no request's iteration "
    "pays a capture; --no-cuda-graph-capture-at-start captures each shape when first met",
    "seed": "seed of requests that give none",
    "threads": "CPU threads of the forwards, torch and llama.cpp (default: every core this "
    "process may use; with --replicas N, the cores split among the replicas)",
    # CacheConfig
    "block_size": "tokens per KV block",
    "num_blocks": "target KV blocks (default: a fraction of memory)",
    "memory_fraction": "fraction of system RAM (CPU) or of free GPU memory (CUDA) for the "
    "target's KV blocks",
    "draft_blocks_ratio": "draft KV blocks as a fraction of the target's",
    "enable_prefix_caching": "reuse the KV of prompt prefixes seen before",
    "ggml_max_cache_tokens": "most cells of the ggml backend's KV cache when sized from memory",
    "ggml_n_batch": "most tokens one llama.cpp decode call takes",
    "ggml_n_ubatch": "most tokens llama.cpp computes at once (a micro-batch)",
    "ggml_kept_prefix_cells": "most KV cells the ggml backend's prefix cache keeps for ended "
    "requests, e.g. 4096 for chats that resend their history (every forward can pay for "
    "them; default 0: prefixes shared only while a request holds them)",
    # SchedulerConfig
    "policy": "scheduling policy",
    "max_num_seqs": "most requests in the running batch",
    "max_num_batched_tokens": "cap on prompt tokens prefilled in one iteration while nothing "
    "decodes",
    "chunked_prefill": "prefill prompts in chunks inside decode iterations, sized by the running "
    "streams' TPOT SLOs (--no-chunked-prefill: whole prompts in iterations of their own, which "
    "stalls running streams)",
    "max_prefill_chunk": "prompt tokens per iteration that requests without an SLO tolerate",
    "min_prefill_chunk": "prompt tokens per iteration once the first prompt's TTFT is lost",
    "slo_pace_margin": "keep streams this fraction under their TPOT SLO when sizing prefill chunks",
    "slo_repay": "share of a pace per iteration a stream behind its pace takes back",
    "slo_bank_spend": "share of its banked time a stream ahead of pace lends to prompt chunks",
    "slo_future_lend": "share of the slack its remaining tokens will leave at its pace that a "
    "stream lends to prompt chunks now (0: banked time only)",
    "slo_defer_rows": "a stream two iterations ahead of its SLO pace sits out an iteration "
    "that would run longer than a tighter stream's pace affords",
    "default_ttft_factor": "TTFT objective of a request without slo_ttft_ms: floor + this x "
    "its prompt's prefill time",
    "default_ttft_floor_ms": "floor of that TTFT objective (ms)",
    "prefill_iteration_ms": "longest an iteration carrying prompt chunks is planned to run, "
    "unless a TTFT objective needs more (ms; 0: no limit): a prompt arriving during it waits",
    "budget": "B: tokens verified per target forward (serve: from --profile or a start-up "
    f"profile; elsewhere {SchedulerConfig.budget})",
    "budget_ceiling": "policy adaserve: most tokens verified per forward, when speculation "
    "control finds them worth their time and past B only within every running stream's pace "
    "(serve: from the profile, a forward of 6x a 1-token one; 1 or unset elsewhere: B)",
    "max_depth": "D_max: depth of a draft model's trees (draft steps)",
    "max_width": "W_max: children per tree node",
    "n_max": "most nodes of one request's tree (root included)",
    "gamma": "chain length of the `sequence` baseline",
    "specinfer_expansion": "children per depth of the `specinfer` baseline, comma-separated",
    "t_spec_ema": "weight of the newest iteration in the moving estimate of t_spec",
    "t_spec_init_s": "t_spec before any iteration was measured (s)",
    "max_waiting": "requests allowed to wait for a batch slot; beyond: 429 with Retry-After "
    "(default: unbounded)",
    "suffix_max_depth": "depth bound of the suffix drafter's trees",
    "suffix_max_ngram": "longest n-gram the suffix drafter matches",
    "suffix_min_match": "shortest match the suffix drafter uses",
    "suffix_max_matches": "occurrences the suffix drafter reads per tree",
    "suffix_global_weight": "weight of a global-cache occurrence against a request-local one",
    "suffix_alpha": "additive smoothing of the suffix drafter's probabilities",
    "suffix_alpha_match_len": (
        "the match length at which suffix_alpha applies as given; a match of m tokens is "
        "smoothed by suffix_alpha x this / m (0: suffix_alpha at every length)"
    ),
    "suffix_cache_tokens": "global cache of finished outputs in tokens (0: request-local only)",
    "calibration_buckets": "bins of the acceptance calibration",
    "calibration_prior_strength": "weight of the calibration's prior",
    "calibration_decay": "forgetting of the calibration per observation",
    "cost_forget": "forgetting of the online forward cost model",
    "probe_interval_min": "iterations drafting stays off after it lost",
    "probe_interval_max": "most iterations drafting stays off (doubling after each lost probe)",
    "control_score_ema": "weight of the newest drafting iteration in the controller's score",
    "control_min_scored": "iterations scored before the first on/off decision",
    "explore_observations": "verified depth-1 nodes before trees stop exploring",
    "explore_cost": "exploring nodes may add this share of a plain forward's time",
    "explore_budget": "net cost exploring may have, as a share of plain forward time",
    "pad_min_saving": "pad a forward only when predicted this much cheaper",
    "pad_explore_every": "every N-th paddable forward runs unpadded to keep measuring",
    "record_acceptance": "append every verified tree (draft probabilities, accepted nodes) to "
    "this JSONL file: the acceptance model of `adaserve simulate --acceptance FILE`",
    "record_iterations": "append one line per iteration (decode rows, tree and prompt tokens, "
    "predicted and measured forward time, host time, streams behind their pace) to this JSONL "
    "file; plot it with python -m adaserve.bench.timeline FILE",
    "slo_headroom": "--admission slo admits while the predicted TPOT is within this share of "
    "the SLO and the predicted first token within this share of its TTFT objective",
    "prompts_yield": "--admission slo admits a stream that only the chunks forced by the TTFT "
    "objectives of prompts due after its first token would slow past its SLO; those prompts "
    "then ride in the streams' slack until they have waited twice their objective",
    "admission_hold": "--admission slo holds a request it would refuse for its TPOT (unscheduled, "
    "no KV) for up to this share of its TTFT objective, admitting it as soon as the load "
    "allows; 0 refuses at arrival",
    "admission_best_effort": "--admission slo serves a request it still refuses (its TPOT once "
    "its hold runs out, its first token, its work) best effort instead (no pace kept, its row "
    "sits out first, its prompt goes last, 'X-SLO-Admission: best-effort'), while fewer than N "
    "are; 0 refuses it",
    "admission_best_effort_wait": "serve best effort only a request whose first token, its "
    "prompt prefilled last, is predicted within this many times its TTFT objective",
    "admission_work_share": "--admission slo under overload (the work window's arrivals need "
    "more than this share of its seconds) refuses requests needing more compute than the "
    "cheapest recent arrivals fill of it; 0: off",
    "admission_work_window_s": "seconds of arrivals the work rule looks at",
    "admission_ema": "weight of the newest iteration in admission's decode-period average",
    "tokens_per_request_ema": "weight of the newest iteration in tokens emitted per request",
    "host_ema": "weight of the newest iteration in host time per iteration",
    # ServerConfig
    "host": "address to listen on (0.0.0.0: all)",
    "port": "TCP port",
    "admission": "slo: answer 429 + Retry-After (slo_unattainable) to a request whose "
    "slo_tpot_ms the current load cannot meet, and to one that would push admitted requests "
    "past theirs; queue: plain queueing, admit while --max-waiting allows",
    "api_keys": "require 'Authorization: Bearer KEY' on /v1/*; repeat for several keys "
    "(default: none)",
    "protect_metrics": "/metrics needs a key too (point Prometheus' authorization at one)",
    "served_model_name": "model name clients send (default: MODEL as given)",
    "default_slo_tpot_ms": "SLO of requests without slo_tpot_ms (default: none, best effort)",
    "slo_classes": "metric classes of slo_tpot_ms, name=upper_bound_ms,...",
    "retry_after_s": "seconds a 429 asks the client to wait",
    "shutdown_timeout_s": "after SIGTERM/SIGINT: new requests get 503 and /health says "
    "draining; running requests may finish for this many seconds, then the rest end with "
    "finish reason 'abort' and the server exits 0",
    "log_level": "server log verbosity",
    "log_stats_interval_s": "seconds between stats log lines (running, waiting, KV usage, "
    "tok/s, SLO attainment); 0: none",
    "allowed_origins": "origins allowed to call the API, comma-separated or repeated ('*': any) "
    "(default: no CORS)",
    "allowed_methods": "with --allowed-origins: HTTP methods allowed",
    "allowed_headers": "with --allowed-origins: request headers allowed",
    "vllm_metrics": "also export the metrics under vLLM's names (vllm:..., for vLLM's "
    "dashboards and autoscaling rules)",
}


def field_help(cls: type, name: str) -> str:
    """The help line of a field; one FIELD_HELP does not list points at config.py."""
    return FIELD_HELP.get(name, f"{cls.__name__}.{name} (see adaserve/config.py)")
