"""`adaserve bench`: replay a trace against one OpenAI-compatible server, given by URL.

    adaserve bench --trace T.json [--url URL] [--rps 1,2] [--max-requests N] ... [--plot F.png]
    adaserve bench sweep --trace T.json --policies adaserve,incremental --rps 1,2 ...
    adaserve bench compare --trace T.json --rps 0.5,1 --llama-server PATH ...

Also `python -m adaserve.bench ...`. `sweep` starts one `adaserve serve` per policy itself
(see `adaserve.bench.sweep`), `compare` adaserve and llama-server on the same GGUF
(`adaserve.bench.compare`); without either, the server at --url is measured as it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from adaserve.bench import compare, sweep
from adaserve.bench.workload import (
    add_workload_arguments,
    finish_report,
    load_trace_arg,
    one_line,
    run_point,
)
from adaserve.config import ServerConfig

DEFAULT_URL = f"http://{ServerConfig.host}:{ServerConfig.port}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of `adaserve bench`, plus its `sweep` subcommand."""
    p.add_argument("--url", default=DEFAULT_URL, help="base URL of the server (no /v1)")
    p.add_argument(
        "--model",
        default=None,
        help="model name sent in requests (default: the first of GET /v1/models)",
    )
    p.add_argument(
        "--label",
        default=None,
        help="name of this server/policy in results and plots (default: the model name)",
    )
    add_workload_arguments(p)
    sub = p.add_subparsers(dest="bench_mode", title="subcommands")
    for name, module, what in (
        ("sweep", sweep, "start a server per policy and replay at every RPS: the whole comparison"),
        ("compare", compare, "adaserve against llama-server on the same GGUF, fresh servers"),
    ):
        sp = sub.add_parser(
            name,
            help=what,
            description=module.__doc__.split("\n\n")[0] if module.__doc__ else None,
            formatter_class=p.formatter_class,
        )
        module.add_arguments(sp)


def run(args: argparse.Namespace) -> int:
    """Replay at each --rps (or at the trace's rate); 1 if no request completed at all."""
    if getattr(args, "bench_mode", None) == "sweep":
        return sweep.run(args)
    if getattr(args, "bench_mode", None) == "compare":
        return compare.run(args)
    trace = load_trace_arg(args)
    results = []
    for rps in args.rps or [None]:
        result = run_point(args, args.url.rstrip("/"), trace, rps, args.label, args.model)
        print(one_line(result), flush=True)
        results.append(result)
    finish_report(args, results)
    return 0 if any(r["completed"] for r in results) else 1


def main(argv: Sequence[str] | None = None) -> int:
    from adaserve.entry import standalone_main

    doc = __doc__.split("\n\n")[0]
    return standalone_main("adaserve bench", doc, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
