"""vLLM's spellings of our flags, so a `vllm serve` command line runs as `adaserve serve`.

Most engine flags already share vLLM's names (--max-num-seqs, --max-num-batched-tokens,
--enable-prefix-caching/--no-enable-prefix-caching, --max-model-len, --block-size, --dtype,
--seed, --host, --port, --api-key, --served-model-name, --allowed-origins). The rest map here;
docs/server.md lists them. vLLM flags for features adaserve lacks are not accepted.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from adaserve.config_flags import argument_group

# Config field -> vLLM's option strings for it.
VLLM_SPELLINGS: dict[str, tuple[str, ...]] = {
    # Ours is the fraction of *free* GPU memory the KV cache takes (weights are loaded first);
    # vLLM's is the whole process's share of the GPU. Both size the KV cache.
    "memory_fraction": ("--gpu-memory-utilization",),
    "num_blocks": ("--num-gpu-blocks-override",),
    "chunked_prefill": ("--enable-chunked-prefill",),
    "log_level": ("--uvicorn-log-level",),
}

# vLLM's speculative_config "method" -> our drafter. ngram (prompt lookup) is what the suffix
# drafter generalizes: it also looks up the output so far and recent traffic.
SPEC_METHODS = {"ngram": "suffix", "suffix": "suffix", "eagle": "eagle", "draft_model": "model"}
SPEC_FLAG = "--speculative-config"
SPEC_KEYS = ("model", "method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


def speculative_fields(spec: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's --speculative-config as our config fields (ValueError for what does not map)."""
    unknown = sorted(set(spec) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(
            f"--speculative-config: adaserve has no equivalent of {', '.join(unknown)}; it maps "
            f"{', '.join(SPEC_KEYS)} (see docs/server.md)"
        )
    method = spec.get("method")
    if method is not None and method not in SPEC_METHODS:
        raise ValueError(
            f"--speculative-config: method must be one of {', '.join(SPEC_METHODS)}, got {method!r}"
        )
    drafter = SPEC_METHODS.get(method or "", "auto")  # auto: the model says what it is
    out: dict[str, Any] = {"drafter": drafter} if method is not None else {}
    if "model" in spec:
        if drafter == "suffix":
            raise ValueError(f"--speculative-config: method {method!r} uses no model")
        out["draft_model"] = str(spec["model"])
    if "num_speculative_tokens" in spec:
        depth = int(spec["num_speculative_tokens"])
        if depth < 1:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be >= 1, got {depth}"
            )
        # A draft model's steps are bounded by max_depth, the suffix drafter's lookups by its own.
        out["suffix_max_depth" if drafter == "suffix" else "max_depth"] = depth
    if "prompt_lookup_max" in spec:
        out["suffix_max_ngram"] = int(spec["prompt_lookup_max"])
    if "prompt_lookup_min" in spec:
        out["suffix_min_match"] = int(spec["prompt_lookup_min"])
    return out


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


class SpeculativeConfig(argparse.Action):
    """--speculative-config JSON: sets the config fields its keys map to."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        try:
            mapped = speculative_fields(values)
        except ValueError as exc:
            raise argparse.ArgumentError(self, str(exc).removeprefix(f"{SPEC_FLAG}: ")) from None
        for name, value in mapped.items():
            setattr(namespace, name, value)


def one_device(text: str) -> int:
    size = int(text)
    if size != 1:
        raise argparse.ArgumentTypeError(
            f"adaserve runs one engine on one device, no tensor parallelism (got {size}); "
            "serve from several engines with --replicas N"
        )
    return size


def add_vllm_engine_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM engine flags that are no single config field."""
    group = argument_group(p, "speculation")
    group.add_argument(
        "--speculative-config",
        type=_json_object,
        action=SpeculativeConfig,
        default=argparse.SUPPRESS,
        metavar="JSON",
        help='vLLM\'s spelling: {"method": "ngram"|"suffix"|"eagle"|"draft_model", "model": '
        'PATH, "num_speculative_tokens": N, "prompt_lookup_max": N, "prompt_lookup_min": N} '
        "sets --drafter, --draft-model, --max-depth (--suffix-max-depth for ngram/suffix), "
        "--suffix-max-ngram, --suffix-min-match",
    )
    argument_group(p, "model").add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=one_device,
        default=argparse.SUPPRESS,
        metavar="1",
        help="vLLM's flag; only 1 is accepted (one engine per device; scale out with --replicas)",
    )


def add_vllm_server_arguments(p: argparse.ArgumentParser) -> None:
    argument_group(p, "logging and metrics").add_argument(
        "--disable-log-stats",
        dest="log_stats_interval_s",
        action="store_const",
        const=0.0,
        default=argparse.SUPPRESS,
        help="vLLM's spelling of --log-stats-interval 0",
    )
