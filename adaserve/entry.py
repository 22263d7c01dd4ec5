"""How every adaserve command runs: bad input is one line on stderr and exit code 2, no trace."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def call(prog: str, run: Callable[[argparse.Namespace], int], args: argparse.Namespace) -> int:
    """run(args), turning ValueError / FileNotFoundError (bad flags, paths) into exit code 2."""
    try:
        return run(args)
    except (ValueError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def standalone_main(
    prog: str,
    description: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    run: Callable[[argparse.Namespace], int],
    argv: Sequence[str] | None = None,
) -> int:
    """`python -m ...` entry point of one command (the same command `adaserve` registers)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    add_arguments(parser)
    return call(prog, run, parser.parse_args(argv))
