"""`adaserve` command line: `adaserve serve [MODEL] ...`, `adaserve generate PROMPT ...`.

Each subcommand is an (add_arguments, run) pair in `SUBCOMMANDS`; another module adds one
(e.g. `profile`, `bench`) with `register(name, help, add_arguments, run)`. Defaults come
from the config dataclasses, so `adaserve --help` shows what config.py says.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
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
from adaserve.entry import call
from adaserve.request_manager.request import SamplingParams


@dataclass(frozen=True)
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


SUBCOMMANDS: dict[str, Subcommand] = {}


def register(
    name: str,
    help: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
) -> None:
    SUBCOMMANDS[name] = Subcommand(help, add_arguments, run)


# ---------------------------------------------------------------------------- shared flags
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
        "--record-acceptance",
        default=None,
        metavar="FILE",
        help="append every verified tree (draft probabilities, accepted nodes) to this JSONL "
        "file: the acceptance model of `adaserve simulate --acceptance FILE`",
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
        block_size=a.block_size,
        num_blocks=a.num_blocks,
        max_num_seqs=a.max_num_seqs,
        budget=a.budget if a.budget is not None else SchedulerConfig.budget,
        enable_prefix_caching=not a.no_prefix_caching,
        chunked_prefill=not a.no_chunked_prefill,
        max_prefill_chunk=a.max_prefill_chunk,
        slo_pace_margin=a.slo_pace_margin,
        record_acceptance=a.record_acceptance,
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


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


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
        help="queue: admit while --max-waiting allows; slo: also answer 429 "
        "(slo_unattainable) to a request whose slo_tpot_ms the current load cannot meet",
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
        type=_positive_float,
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
    p.add_argument(
        "--log-level",
        default=ServerConfig.log_level,
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log verbosity",
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


def run_serve(a: argparse.Namespace) -> int:
    from adaserve.api.server import serve
    from adaserve.llm import LLMEngine

    if a.max_waiting is not None and a.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {a.max_waiting}")
    keys = api_keys(a.api_key, a.api_key_file)  # a bad key file fails before the model loads
    if a.protect_metrics and not keys:
        raise ValueError("--protect-metrics needs --api-key or --api-key-file")
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    engine = LLMEngine(*engine_configs(a, max_waiting=a.max_waiting))
    log = logging.getLogger("adaserve")
    cached_profile = False
    if a.policy != "incremental" and a.budget is None:
        # B and t_spec come from measured latency, not a guess (an explicit --budget wins).
        from adaserve.request_manager.control.profile import Profile, startup_profile

        prof = Profile.load(a.profile) if a.profile else startup_profile(engine.engine)
        if prof is None:
            log.warning(
                "no usable start-up profile (the machine is busy); budget B = %d from the "
                "defaults, costs measured online",
                engine.sched_cfg.budget,
            )
        else:
            cached_profile = not a.profile
            cost = prof.forward_cost_model(engine.sched_cfg.cost_forget)
            engine.apply_profile(prof.budget, prof.t_spec_s(prof.budget), cost)
            log.info(
                "budget B = %d, t_spec = %.1f ms (%s)",
                prof.budget,
                1000 * prof.t_spec_s(prof.budget),
                a.profile or "start-up profile",
            )
    sched = engine.scheduler
    log.info(
        "policy %s, drafter %s, backend %s",
        a.policy,
        sched.drafter.name if sched.drafter else "none",
        engine.engine.backend,
    )
    cfg = ServerConfig(
        host=a.host,
        port=a.port,
        api_keys=keys,
        protect_metrics=a.protect_metrics,
        admission=a.admission,
        served_model_name=a.served_model_name,
        default_slo_tpot_ms=a.default_slo_tpot_ms,
        slo_classes=a.slo_classes,
    )
    serve(engine, cfg, log_level=a.log_level, shutdown_timeout_s=a.shutdown_timeout)
    acc = engine.scheduler.acceptance_log
    if acc is not None:
        acc.close()
        log.info("recorded %d verified trees to %s", acc.num_trees, acc.path)
    cost = engine.scheduler.cost
    if a.record_cost_model and cost is not None:
        from adaserve.request_manager.control.profile import record_cost_model

        path = record_cost_model(engine.engine, cost, engine.sched_cfg.budget, a.record_cost_model)
        log.info("wrote the fitted cost model to %s", path)
    controlled = engine.sched_cfg.controlled
    if cached_profile and controlled and cost is not None and cost.num_observations > 0:
        # What the server measured while it ran is a better start for the next one.
        from adaserve.request_manager.control.profile import refresh_startup_profile

        refresh_startup_profile(engine.engine, cost)
    return 0


# ---------------------------------------------------------------------------- generate
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    sp = SamplingParams()
    p.add_argument("prompt", help="the prompt text")
    add_engine_arguments(p, SchedulerConfig().policy)
    p.add_argument("--max-tokens", type=int, default=sp.max_tokens)
    p.add_argument(
        "--temperature", type=float, default=sp.temperature, help="0 for greedy decoding"
    )
    p.add_argument("--top-p", type=float, default=sp.top_p)
    p.add_argument("--top-k", type=int, default=sp.top_k, help="-1: off")
    p.add_argument("--slo-tpot-ms", type=_positive_float, default=sp.slo_tpot_ms)
    p.add_argument("--chat", action="store_true", help="apply the model's chat template")


def run_generate(a: argparse.Namespace) -> int:
    from adaserve.llm import LLM

    llm = LLM(**engine_kwargs(a))  # type: ignore[arg-type]
    params = SamplingParams(
        max_tokens=a.max_tokens,
        temperature=a.temperature,
        top_p=a.top_p,
        top_k=a.top_k,
        slo_tpot_ms=a.slo_tpot_ms,
    )
    if a.chat:
        out = llm.chat([{"role": "user", "content": a.prompt}], params)[0]
    else:
        out = llm.generate(a.prompt, params)[0]
    print(out.outputs[0].text)
    m = out.metrics
    tpot = "n/a" if m.tpot_ms is None else f"{m.tpot_ms:.1f} ms"
    print(
        f"[{m.num_output_tokens} tokens, finish {out.outputs[0].finish_reason}, TPOT {tpot}]",
        file=sys.stderr,
    )
    return 0


register("serve", "run the OpenAI-compatible HTTP server", add_serve_arguments, run_serve)
register(
    "generate", "generate for one prompt and print the text", add_generate_arguments, run_generate
)
from adaserve.bench import command as bench_command  # noqa: E402
from adaserve.bench import profile as profile_command  # noqa: E402
from adaserve.distill import cli as distill_cli  # noqa: E402
from adaserve.distill import vocab as draft_vocab  # noqa: E402
from adaserve.sim import run as sim_run  # noqa: E402

register(
    "profile",
    "measure forward latencies; write the budget B, t_spec and the baseline latency",
    profile_command.add_arguments,
    profile_command.run,
)
register(
    "distill",
    "train a draft model for a target by distillation (KL to the target on its own text)",
    distill_cli.add_arguments,
    distill_cli.run,
)
register(
    "draft-vocab",
    "rank the target's output tokens for a draft's reduced-vocabulary head",
    draft_vocab.add_arguments,
    draft_vocab.run,
)
register(
    "simulate",
    "replay a trace through the real scheduler on a virtual clock (capacity planning)",
    sim_run.add_arguments,
    sim_run.run,
)
register(
    "bench",
    "replay a trace against an OpenAI-compatible server (`bench sweep`: every policy x RPS)",
    bench_command.add_arguments,
    bench_command.run,
)


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless its help already says it or there is none to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "(default" not in text
            and action.option_strings
            and action.default is not None
            and action.default is not False
            and action.default != argparse.SUPPRESS
        ):
            text += " (default: %(default)s)"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaserve", description="SLO-customized LLM serving with tree speculative decoding"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, cmd in SUBCOMMANDS.items():
        p = sub.add_parser(
            name, help=cmd.help, description=cmd.help, formatter_class=_HelpFormatter
        )
        cmd.add_arguments(p)
        p.set_defaults(_run=cmd.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return call(f"adaserve {args.command}", args._run, args)


if __name__ == "__main__":
    sys.exit(main())
