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
from dataclasses import dataclass
from typing import TYPE_CHECKING

from adaserve import __version__
from adaserve.args import (
    add_engine_arguments,
    add_serve_arguments,
    engine_configs,
    engine_kwargs,
    server_config,
)
from adaserve.bench import command as bench_command
from adaserve.bench import profile as profile_command
from adaserve.config import SchedulerConfig, ServerConfig
from adaserve.config_flags import positive_float, show_default
from adaserve.config_sources import LayeredParser
from adaserve.distill import cli as distill_cli
from adaserve.distill import vocab as draft_vocab
from adaserve.entry import call
from adaserve.request_manager.request import SamplingParams
from adaserve.sim import run as sim_run

if TYPE_CHECKING:
    from adaserve.llm import LLMEngine


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


def build_engine(a: argparse.Namespace) -> tuple[LLMEngine, bool]:
    """The engine `adaserve serve` runs, with B, t_spec and the forward cost model from a
    latency profile (an explicit --budget wins); also says whether the profile is the cached
    start-up one (then what the server measures refreshes it at shutdown)."""
    from adaserve.llm import LLMEngine

    profiled = a.policy != "incremental" and a.budget is None
    # A profile brings its own cost model: no cost curve measured first only to be replaced.
    engine = LLMEngine(*engine_configs(a, max_waiting=a.max_waiting), prepare=not profiled)
    log = logging.getLogger("adaserve")
    cached_profile = False
    if profiled:
        from adaserve.request_manager.control.profile import Profile, startup_profile

        prof = Profile.load(a.profile) if a.profile else startup_profile(engine.engine)
        if prof is None:
            log.warning(
                "no usable start-up profile (the machine is busy); budget B = %d from the "
                "defaults, costs measured online",
                engine.sched_cfg.budget,
            )
            engine.apply_profile(engine.sched_cfg.budget, engine.sched_cfg.t_spec_init_s)
        else:
            cached_profile = not a.profile
            cost = prof.forward_cost_model(engine.sched_cfg.cost_forget)
            # An explicit --budget-ceiling wins over the profile's, as --budget does over B.
            ceiling = a.budget_ceiling if a.budget_ceiling is not None else prof.budget_ceiling
            engine.apply_profile(prof.budget, prof.t_spec_s(prof.budget), cost, ceiling)
            log.info(
                "budget B = %d (ceiling %d), t_spec = %.1f ms (%s)",
                prof.budget,
                engine.sched_cfg.selection_budget,
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
    return engine, cached_profile


def run_serve(a: argparse.Namespace) -> int:
    from adaserve.api.logs import configure_logging
    from adaserve.api.server import serve

    if a.max_waiting is not None and a.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {a.max_waiting}")
    cfg = server_config(a)  # a bad key file fails before the model loads
    if cfg.protect_metrics and not cfg.api_keys:
        raise ValueError("--protect-metrics needs --api-key or --api-key-file")
    d = ServerConfig()
    cors_set = (cfg.allowed_methods, cfg.allowed_headers) != (d.allowed_methods, d.allowed_headers)
    if cors_set and not cfg.allowed_origins:
        raise ValueError("--allowed-methods and --allowed-headers need --allowed-origins")
    configure_logging(cfg.log_level)
    log = logging.getLogger("adaserve")
    if a.replicas is not None:
        # Imported only here: a single server never imports Ray.
        from adaserve.cluster.ray_serve import serve_cluster

        return serve_cluster(a, cfg)
    if a.ray_address is not None:
        raise ValueError("--ray-address needs --replicas N")
    engine, cached_profile = build_engine(a)
    serve(engine, cfg, log_level=cfg.log_level, shutdown_timeout_s=cfg.shutdown_timeout_s)
    acc = engine.scheduler.acceptance_log
    if acc is not None:
        acc.close()
        log.info("recorded %d verified trees to %s", acc.num_trees, acc.path)
    timeline = engine.scheduler.timeline
    if timeline is not None:
        timeline.close()
        log.info("recorded %d iterations to %s", timeline.lines.num_lines, timeline.path)
    fitted = engine.scheduler.cost
    if a.record_cost_model and fitted is not None:
        from adaserve.request_manager.control.profile import record_cost_model

        path = record_cost_model(
            engine.engine, fitted, engine.sched_cfg.budget, a.record_cost_model
        )
        log.info("wrote the fitted cost model to %s", path)
    controlled = engine.sched_cfg.controlled
    if cached_profile and controlled and fitted is not None and fitted.num_observations > 0:
        # What the server measured while it ran is a better start for the next one.
        from adaserve.request_manager.control.profile import refresh_startup_profile

        refresh_startup_profile(engine.engine, fitted)
    return 0


# ---------------------------------------------------------------------------- generate
def add_generate_arguments(p: argparse.ArgumentParser) -> None:
    sp = SamplingParams()
    p.usage = "%(prog)s PROMPT [MODEL] [flags]"
    p.add_argument("prompt", help="the prompt text")
    add_engine_arguments(p, SchedulerConfig().policy)
    p.add_argument("--max-tokens", type=int, default=sp.max_tokens)
    p.add_argument(
        "--temperature", type=float, default=sp.temperature, help="0 for greedy decoding"
    )
    p.add_argument("--top-p", type=float, default=sp.top_p)
    p.add_argument("--top-k", type=int, default=sp.top_k, help="-1: off")
    p.add_argument("--slo-tpot-ms", type=positive_float, default=sp.slo_tpot_ms)
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
            text += " (default: " + show_default(action.default).replace("%", "%%") + ")"
        return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaserve", description="SLO-customized LLM serving with tree speculative decoding"
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    # LayeredParser: commands with --config read it and ADASERVE_* before the command line.
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=LayeredParser
    )
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
