"""`adaserve bench sweep`: every policy x every RPS in one command, then the table and the plot.

    adaserve bench sweep --trace T.json --policies adaserve,specinfer,incremental \
        --rps 0.5,1,2 --max-requests 50 --output-length 64 --profile profile.json

For each policy one `adaserve serve --policy P` starts on a free local port (its log goes to
--server-log-dir), is warmed up with one short request, and serves the replays at every RPS
in turn; then it is stopped (SIGTERM) before the next policy starts, so policies never share
the machine. Results go to --out like `adaserve bench`'s, labelled by policy.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx

from adaserve.args import add_serve_arguments
from adaserve.bench.plot import plot_results
from adaserve.bench.report import format_table
from adaserve.bench.trace import prepare
from adaserve.bench.workload import (
    add_workload_arguments,
    load_trace_arg,
    one_line,
    run_point,
    trace_options,
)
from adaserve.config import POLICIES

# Speculative policies build the default draft on first use, and CPU start-up is slow.
DEFAULT_STARTUP_TIMEOUT_S = 900.0
SHUTDOWN_WAIT_S = 60.0
WARMUP_MAX_TOKENS = 2


def comma_choices(text: str, allowed: Sequence[str], what: str) -> list[str]:
    """A comma list of names from `allowed` (an argparse type: says what is allowed)."""
    names = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in names if p not in allowed]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{what} must be among {', '.join(allowed)}, got {text!r}")
    return names


def _policies(text: str) -> list[str]:
    return comma_choices(text, POLICIES, "policies")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--policies",
        type=_policies,
        default=list(POLICIES),
        help=f"comma list of policies (default: {','.join(POLICIES)})",
    )
    p.add_argument("--model", default=None, help="checkpoint to serve (default: the default model)")
    p.add_argument("--draft-model", default=None, help="draft checkpoint (serve --draft-model)")
    p.add_argument("--budget", type=int, default=None, help="B for every server (serve --budget)")
    p.add_argument(
        "--server-args",
        default=None,
        help="more `adaserve serve` flags for every server, one quoted string",
    )
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=DEFAULT_STARTUP_TIMEOUT_S,
        help="seconds a server may take to become healthy",
    )
    p.add_argument(
        "--server-log-dir", default=None, help="keep each server's log here (default: a temp dir)"
    )
    add_workload_arguments(p)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_supports(flag: str) -> bool:
    """Whether this installation's `adaserve serve` knows `flag` (e.g. --profile)."""
    probe = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    add_serve_arguments(probe)
    try:
        _, unknown = probe.parse_known_args([flag, "1"])
    except argparse.ArgumentError:  # known, but "1" is no valid value of it
        return True
    return not unknown


def server_command(args: argparse.Namespace, policy: str, port: int) -> list[str]:
    """The `adaserve serve` command line of one policy."""
    cmd = [sys.executable, "-m", "adaserve.cli", "serve"]
    cmd += [args.model] if args.model else []
    cmd += ["--policy", policy, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--log-level", "warning"]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    budget = args.budget
    if args.profile is not None:
        if serve_supports("--profile"):
            cmd += ["--profile", args.profile]
        elif budget is None:  # older serve: take B from the profile ourselves
            from adaserve.request_manager.control.profile import Profile

            budget = Profile.load(args.profile).budget
    if budget is not None:
        cmd += ["--budget", str(budget)]
    return cmd + shlex.split(args.server_args or "")


@contextlib.contextmanager
def running_server(cmd: list[str], log_path: Path, timeout_s: float) -> Iterator[str]:
    """Start `cmd` (which serves on the --port it names), wait for /health; yields the URL."""
    port = cmd[cmd.index("--port") + 1]
    url = f"http://127.0.0.1:{port}"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}; see {log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not healthy after {timeout_s:.0f} s; see {log_path}")
            try:
                if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=SHUTDOWN_WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def warm_up(url: str, api_key: str | None) -> None:
    """One short request, so first-call costs do not land on the first measured request."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    body = {"prompt": "Hello", "max_tokens": WARMUP_MAX_TOKENS, "temperature": 0}
    httpx.post(
        f"{url}/v1/completions", json=body, headers=headers, timeout=600.0
    ).raise_for_status()


def run(args: argparse.Namespace) -> int:
    """Run the sweep; 1 if some server failed to start, else 0."""
    trace = load_trace_arg(args)
    for rps in args.rps or [None]:  # bad options (a missing baseline) fail before any server starts
        prepare(trace, trace_options(args, rps))
    log_dir = Path(args.server_log_dir or tempfile.mkdtemp(prefix="adaserve-sweep-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    results, failed = [], []
    for policy in args.policies:
        cmd = server_command(args, policy, free_port())
        print(f"[{policy}] {shlex.join(cmd)}", file=sys.stderr, flush=True)
        try:
            with running_server(cmd, log_dir / f"serve-{policy}.log", args.startup_timeout) as url:
                warm_up(url, args.api_key)
                for rps in args.rps or [None]:
                    extra = {"policy": policy, "server_command": cmd}
                    result = run_point(args, url, trace, rps, policy, extra=extra)
                    print(one_line(result), flush=True)
                    results.append(result)
        except (RuntimeError, httpx.HTTPError) as exc:
            print(f"[{policy}] skipped: {exc}", file=sys.stderr, flush=True)
            failed.append(policy)
    return finish_runs(args, results, failed, log_dir, format_table, plot_results, "policies")


def finish_runs(
    args: argparse.Namespace,
    results: Sequence[dict],
    failed: Sequence[str],
    log_dir: Path,
    table: Callable[[Sequence[dict]], str],
    plot: Callable[[Sequence[dict], str], object],
    what: str,
) -> int:
    """After the servers ran: the table, the plot (--plot, default OUT.png), where everything
    went and what did not run (`what`: policies, points); 1 if something did not run."""
    if results:
        print(table(results))
        path = args.plot or str(Path(args.out).with_suffix(".png"))
        print(f"wrote {plot(results, path)}", file=sys.stderr)
    print(f"results appended to {args.out}; server logs in {log_dir}", file=sys.stderr)
    if failed:
        print(f"{what} that did not run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    from adaserve.entry import standalone_main

    doc = __doc__.split("\n\n")[0]
    return standalone_main("adaserve bench sweep", doc, add_arguments, run, argv)


if __name__ == "__main__":
    sys.exit(main())
