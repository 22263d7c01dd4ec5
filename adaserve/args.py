"""The flags of the commands that run the engine (`serve`, `generate`, and what `bench sweep`
probes a server for). Every config field is a flag generated from the config dataclasses
(config_flags.py), with ADASERVE_* variables and --config files under the command line
(config_sources.py) and vLLM's spellings beside ours (vllm_flags.py); this module adds the
flags that are no config field and turns the parsed namespace back into configs.
`cli.py` registers the commands.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path

from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from adaserve.config_flags import add_config_arguments, argument_group, config_fields
from adaserve.config_sources import ENV_PREFIX, add_config_file_argument
from adaserve.vllm_flags import VLLM_SPELLINGS, add_vllm_engine_arguments, add_vllm_server_arguments

ENGINE_CONFIGS = (ModelConfig, CacheConfig, SchedulerConfig)
ENV_EPILOG = (
    f"Every config flag also reads {ENV_PREFIX}<FIELD> (e.g. {ENV_PREFIX}MAX_NUM_SEQS=8; "
    "switches take true/false); the command line wins over the environment, the environment "
    "over --config, --config over the defaults shown."
)


def add_engine_arguments(p: argparse.ArgumentParser, default_policy: str) -> None:
    """Model, cache and scheduler flags (shared by every subcommand that runs the engine)."""
    add_config_file_argument(p)
    # --budget unset means "from the latency profile" for serve (SchedulerConfig's elsewhere).
    defaults = {"policy": default_policy, "budget": None}
    add_config_arguments(p, ENGINE_CONFIGS, defaults, VLLM_SPELLINGS)
    add_vllm_engine_arguments(p)
    p.epilog = ENV_EPILOG


def engine_kwargs(a: argparse.Namespace) -> dict[str, object]:
    """Config fields by name (as `LLM(**kwargs)` takes them), from the engine flags."""
    kw = {name: getattr(a, name) for name in config_fields(ENGINE_CONFIGS)}
    if kw["budget"] is None:
        kw["budget"] = SchedulerConfig.budget
    return kw


def engine_configs(
    a: argparse.Namespace,
    **extra: object,
) -> tuple[ModelConfig, CacheConfig, SchedulerConfig]:
    """The three engine configs from the engine flags (plus `extra` config fields)."""
    kw = {**engine_kwargs(a), **extra}
    return tuple(
        cls(**{f.name: kw[f.name] for f in fields(cls) if f.name in kw})  # type: ignore
        for cls in ENGINE_CONFIGS
    )


def server_config(a: argparse.Namespace) -> ServerConfig:
    """The server config from the serve flags, with --api-key-file's keys added."""
    kw = {f.name: getattr(a, f.name) for f in fields(ServerConfig)}
    return ServerConfig(**{**kw, "api_keys": api_keys(a.api_keys, a.api_key_file)})


# ---------------------------------------------------------------------------- serve
def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s [MODEL] [flags]"
    add_engine_arguments(p, ServerConfig.policy)
    add_config_arguments(p, (ServerConfig,), spellings=VLLM_SPELLINGS)
    add_vllm_server_arguments(p)
    argument_group(p, "speculation").add_argument(
        "--profile",
        default=None,
        metavar="FILE",
        help="latency profile from `adaserve profile` for B and t_spec (default: a short "
        "profile at first start-up, cached; skipped when --budget is given)",
    )
    argument_group(p, "server").add_argument(
        "--api-key-file",
        default=None,
        metavar="FILE",
        help="a file of accepted keys, one per line ('#' comments and blank lines ignored)",
    )
    argument_group(p, "recording").add_argument(
        "--record-cost-model",
        default=None,
        metavar="FILE",
        help="at shutdown, write the forward cost model this server fitted while serving to "
        "FILE, a profile for `adaserve simulate --cost-model FILE`",
    )
    add_cluster_arguments(argument_group(p, "scale-out"))


def add_cluster_arguments(cluster: argparse._ArgumentGroup) -> None:
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
