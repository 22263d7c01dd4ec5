"""`adaserve profile`: measure the target's (and draft's) forward latency on this machine and
write the profile (budget B, t_spec, the baseline latency, the fitted cost model) that
`adaserve serve --profile FILE` and `adaserve simulate --cost-model FILE` read.

    adaserve profile [MODEL] --out profile.json [--quick]   (or python -m adaserve.bench.profile)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from adaserve.config import BACKENDS, DTYPES, CacheConfig, ModelConfig
from adaserve.exec.engine import ExecutionEngine
from adaserve.request_manager.control.profile import DEFAULT_BUDGET_FACTOR, profile_engine


def add_arguments(p: argparse.ArgumentParser) -> None:
    m, c = ModelConfig(), CacheConfig()
    p.add_argument("model", nargs="?", default=m.model, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--draft-model", default=m.draft_model, help="draft checkpoint to profile")
    p.add_argument("--no-draft", action="store_true", help="profile the target only")
    p.add_argument("--dtype", choices=DTYPES, default=m.dtype, help="weight and KV dtype")
    p.add_argument("--device", default=m.device, help="cpu or cuda[:N]")
    p.add_argument(
        "--backend",
        choices=BACKENDS,
        default=m.backend,
        help="who runs the target (as serve's --backend; auto: ggml for a GGUF model on the "
        "CPU when installed)",
    )
    p.add_argument("--num-blocks", type=int, default=c.num_blocks, help="KV blocks to use")
    p.add_argument("--out", default="profile.json", help="where to write the profile")
    p.add_argument("--quick", action="store_true", help="the short start-up profile")
    p.add_argument(
        "--budget-factor",
        type=float,
        default=DEFAULT_BUDGET_FACTOR,
        help="B = largest token count whose forward takes <= this x a 1-token forward",
    )
    p.add_argument("--max-tokens", type=int, default=None, help="largest token count measured")
    p.add_argument(
        "--contexts", default=None, help="comma list of context lengths (default: 64,256,1024)"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if not args.budget_factor > 1.0:
        raise ValueError(f"--budget-factor must be > 1, got {args.budget_factor}")
    # The default target brings its own draft; another target profiles a draft only if named.
    need_draft = not args.no_draft and (args.draft_model is not None or args.model is None)
    engine = ExecutionEngine(
        ModelConfig(
            model=args.model,
            draft_model=None if args.no_draft else args.draft_model,
            dtype=args.dtype,
            device=args.device,
            backend=args.backend,
        ),
        CacheConfig(num_blocks=args.num_blocks),
        need_draft=need_draft,
    )
    contexts = [int(x) for x in args.contexts.split(",")] if args.contexts else None
    prof = profile_engine(
        engine,
        quick=args.quick,
        progress=not args.no_progress,
        budget_factor=args.budget_factor,
        max_tokens=args.max_tokens,
        contexts=contexts,
    )
    path = prof.save(args.out)
    if prof.budget >= max(p.tokens for p in prof.target):
        print("note: B is the largest count measured; raise --max-tokens to find the real one")
    print(
        f"{prof.model} on {prof.device}: budget B = {prof.budget} tokens (x{prof.budget_factor:g} "
        f"of a 1-token forward, context {prof.budget_context}), baseline latency "
        f"{prof.baseline_latency_ms:.2f} ms, t_spec(B) {1000 * prof.t_spec_s(prof.budget):.2f} ms"
        f"\nwrote {path}"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from adaserve.entry import standalone_main

    doc = __doc__.split("\n\n")[0]
    return standalone_main("adaserve profile", doc, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
