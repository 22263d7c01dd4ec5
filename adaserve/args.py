"""The flags of the commands that run the engine (`serve`, `generate`, and what `bench sweep`
probes a server for), built from the config dataclasses so `--help` shows config.py's
defaults. `cli.py` registers the commands; this module only declares and parses flags.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from adaserve.config import (
    BACKENDS,
    DRAFTERS,
    DTYPES,
    POLICIES,
    CacheConfig,
    ModelConfig,
    SchedulerConfig,
    ServerConfig,
    parse_slo_classes,
)


def add_engine_arguments(p: argparse.ArgumentParser, default_policy: str) -> None:
    """Model, cache and scheduler flags (shared by every subcommand that runs the engine)."""
    m, c, s = ModelConfig(), CacheConfig(), SchedulerConfig()
    p.add_argument(
        "model",
        nargs="?",
        default=m.model,
        help="HF checkpoint dir or .gguf file (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--draft-model",
        default=m.draft_model,
        help="draft checkpoint sharing the target's tokenizer, or an EAGLE head dir (with "
        "the default target and none given: --drafter model takes a truncated copy of the "
        "target, --drafter eagle the shipped head)",
    )
    p.add_argument(
        "--drafter",
        choices=DRAFTERS,
        default=m.drafter,
        help="who proposes candidate trees: auto = the draft model or EAGLE head if "
        "--draft-model is given, else the suffix index over the prompt, output and recent "
        "traffic; eagle = an EAGLE head on the target's hidden states (default: auto)",
    )
    p.add_argument("--policy", choices=POLICIES, default=default_policy, help="scheduling policy")
    p.add_argument("--dtype", choices=DTYPES, default=m.dtype, help="weight and KV dtype")
    p.add_argument("--device", default=m.device, help="cpu or cuda[:N]")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=m.backend,
        help="who runs the target: ggml = a GGUF model in its own quantization on llama.cpp "
        "(CPU, `pip install adaserve[cpu]`), torch = this package's model code; auto = ggml "
        "for a GGUF model on the CPU when llama-cpp-python is installed (default: auto)",
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=m.max_model_len,
        help="prompt + output token limit (default: the model's own)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=s.max_num_seqs,
        help="most requests in the running batch",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=None,
        help="B: tokens verified per target forward (serve: from --profile or a start-up "
        f"profile; elsewhere {s.budget})",
    )
    p.add_argument(
        "--num-blocks",
        type=int,
        default=c.num_blocks,
        help="target KV blocks (default: a fraction of memory)",
    )
    p.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block")
    p.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not reuse the KV of prompt prefixes seen before",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill whole prompts in iterations of their own (stalls running streams)",
    )
    p.add_argument(
        "--max-prefill-chunk",
        type=int,
        default=s.max_prefill_chunk,
        help="prompt tokens per iteration that requests without an SLO tolerate",
    )
    p.add_argument(
        "--slo-pace-margin",
        type=float,
        default=s.slo_pace_margin,
        help="keep streams this fraction under their TPOT SLO when sizing prefill chunks "
        f"(default: {s.slo_pace_margin})",
    )
    p.add_argument("--seed", type=int, default=m.seed, help="seed of requests that give none")
    p.add_argument(
        "--threads",
        type=int,
        default=m.threads,
        help="CPU threads of the forwards, torch and llama.cpp (default: every core this "
        "process may use; with --replicas N, the cores split among the replicas)",
    )
    p.add_argument(
        "--record-acceptance",
        default=None,
        metavar="FILE",
        help="append every verified tree (draft probabilities, accepted nodes) to this JSONL "
        "file: the acceptance model of `adaserve simulate --acceptance FILE`",
    )
    p.add_argument(
        "--record-iterations",
        default=None,
        metavar="FILE",
        help="append one line per iteration (decode rows, tree and prompt tokens, predicted "
        "and measured forward time, host time, streams behind their pace) to this JSONL file; "
        "plot it with python -m adaserve.bench.timeline FILE",
    )


def engine_kwargs(a: argparse.Namespace) -> dict[str, object]:
    """Config fields by name (as `LLM(**kwargs)` takes them), from the engine flags."""
    return dict(
        model=a.model,
        draft_model=a.draft_model,
        drafter=a.drafter,
        policy=a.policy,
        dtype=a.dtype,
        device=a.device,
        backend=a.backend,
        max_model_len=a.max_model_len,
        seed=a.seed,
        threads=a.threads,
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        max_num_seqs=a.max_num_seqs,
        budget=a.budget if a.budget is not None else SchedulerConfig.budget,
        enable_prefix_caching=not a.no_prefix_caching,
        chunked_prefill=not a.no_chunked_prefill,
        max_prefill_chunk=a.max_prefill_chunk,
        slo_pace_margin=a.slo_pace_margin,
        record_acceptance=a.record_acceptance,
        record_iterations=a.record_iterations,
    )


def engine_configs(
    a: argparse.Namespace,
    **extra: object,
) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    """The three engine configs from the engine flags (plus `extra` config fields)."""
    kw = {**engine_kwargs(a), **extra}
    return tuple(
        cls(**{f.name: kw[f.name] for f in fields(cls) if f.name in kw})  # type: ignore
        for cls in (ModelConfig, CacheConfig, SchedulerConfig)
    )


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _slo_classes(text: str) -> tuple[tuple[str, float], ...]:
    try:
        return parse_slo_classes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


# ---------------------------------------------------------------------------- serve
def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    add_engine_arguments(p, ServerConfig.policy)
    p.add_argument(
        "--profile",
        default=None,
        help="latency profile from `adaserve profile` for B and t_spec (default: a short "
        "profile at first start-up, cached; skipped when --budget is given)",
    )
    p.add_argument("--host", default=d.host, help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=d.port, help="TCP port")
    p.add_argument(
        "--api-key",
        action="append",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/*; repeat for several keys "
        "(default: none)",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        help="a file of accepted keys, one per line ('#' comments and blank lines ignored)",
    )
    p.add_argument(
        "--admission",
        choices=("queue", "slo"),
        default=d.admission,
        help="slo (default): answer 429 + Retry-After (slo_unattainable) to a request whose "
        "slo_tpot_ms the current load cannot meet, and to one that would push admitted "
        "requests past theirs; queue: plain queueing, admit while --max-waiting allows",
    )
    p.add_argument(
        "--protect-metrics",
        action="store_true",
        help="/metrics needs a key too (point Prometheus' authorization at one)",
    )
    p.add_argument(
        "--served-model-name",
        default=d.served_model_name,
        help="model name clients send (default: MODEL as given)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=SchedulerConfig().max_waiting,
        help="requests allowed to wait for a batch slot; beyond: 429 with "
        "Retry-After (default: unbounded)",
    )
    p.add_argument(
        "--record-cost-model",
        default=None,
        metavar="FILE",
        help="at shutdown, write the forward cost model this server fitted while serving to "
        "FILE, a profile for `adaserve simulate --cost-model FILE`",
    )
    p.add_argument(
        "--default-slo-tpot-ms",
        type=positive_float,
        default=d.default_slo_tpot_ms,
        help="SLO of requests without slo_tpot_ms (default: none, best effort)",
    )
    classes = ",".join(f"{n}={b:g}" for n, b in d.slo_classes)
    p.add_argument(
        "--slo-classes",
        type=_slo_classes,
        default=d.slo_classes,
        help=f"metric classes of slo_tpot_ms, name=upper_bound_ms,... (default: {classes})",
    )
    p.add_argument(
        "--drain-timeout",
        "--shutdown-timeout",
        dest="shutdown_timeout",
        type=float,
        default=ServerConfig.shutdown_timeout_s,
        help="after SIGTERM/SIGINT: new requests get 503 and /health says draining; running "
        "requests may finish for this many seconds, then the rest end with finish reason "
        "'abort' and the server exits 0",
    )
    cluster = p.add_argument_group(
        "scale-out (Ray Serve; the `cluster` extra: pip install 'adaserve[cluster]')"
    )
    cluster.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="serve from N engine replicas on Ray Serve behind one OpenAI endpoint, each the "
        "engine this command runs alone (its own KV cache, scheduler and cost model), routed "
        "by --router (default: one engine in this process, no Ray)",
    )
    cluster.add_argument(
        "--router",
        choices=("slo", "pow2"),
        default="slo",
        help="with --replicas: slo (default) ranks the replicas that can meet the request's "
        "slo_tpot_ms by their published predicted TPOT; pow2 is Ray Serve's own "
        "power-of-two-choices router",
    )
    cluster.add_argument(
        "--ray-address",
        default=None,
        help="with --replicas: join this Ray cluster (e.g. auto, or HOST:6379) instead of "
        "starting a local one",
    )
    p.add_argument(
        "--log-level",
        default=ServerConfig.log_level,
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log verbosity",
    )
    p.add_argument(
        "--log-stats-interval",
        type=float,
        default=d.log_stats_interval_s,
        metavar="S",
        help="seconds between stats log lines (running, waiting, KV usage, tok/s, SLO "
        "attainment); 0: none",
    )
    p.add_argument(
        "--vllm-metrics",
        action="store_true",
        help="also export the metrics under vLLM's names (vllm:..., for vLLM's dashboards and "
        "autoscaling rules)",
    )
    cors = p.add_argument_group("CORS (browsers calling the API from a web page)")
    cors.add_argument(
        "--allowed-origins",
        type=_csv,
        action="extend",
        default=None,
        metavar="ORIGINS",
        help="origins allowed to call the API, comma-separated or repeated ('*': any) "
        "(default: no CORS)",
    )
    cors.add_argument(
        "--allowed-methods",
        type=_csv,
        action="extend",
        default=None,
        metavar="METHODS",
        help="with --allowed-origins: HTTP methods allowed (default: *)",
    )
    cors.add_argument(
        "--allowed-headers",
        type=_csv,
        action="extend",
        default=None,
        metavar="HEADERS",
        help="with --allowed-origins: request headers allowed (default: *)",
    )


def api_keys(keys: Sequence[str] | None, key_file: str | None) -> tuple[str, ...]:
    """The accepted API keys from --api-key (repeatable) and --api-key-file."""
    out = [k.strip() for k in keys or []]
    if key_file is not None:
        try:
            lines = Path(key_file).expanduser().read_text().splitlines()
        except OSError as e:
            raise ValueError(f"--api-key-file {key_file}: {e.strerror or e}") from e
        listed = [ln.strip() for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if not listed:
            raise ValueError(f"--api-key-file {key_file} lists no key")
        out += listed
    bad = [k for k in out if not k or any(c.isspace() for c in k)]
    if bad:
        raise ValueError("an API key must be non-empty and contain no whitespace")
    return tuple(dict.fromkeys(out))
