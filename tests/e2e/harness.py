"""Real servers for tests: `adaserve serve` as a subprocess, or uvicorn in a thread."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx
from prometheus_client.parser import text_string_to_metric_families


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive():
            raise RuntimeError("server exited before it became healthy")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


@contextmanager
def serve_subprocess(*args: str, timeout_s: float = 600.0) -> Iterator[str]:
    """`python -m adaserve.cli serve ARGS --port P` on 127.0.0.1; yields the base URL.

    The limit covers the server's worst start: from an empty cache it profiles, and on a
    noisy machine twice (75 s each in a CI run) before it starts from the defaults."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", prefix="adaserve-serve-", suffix=".log", delete=False)
    cmd = [
        sys.executable,
        "-m",
        "adaserve.cli",
        "serve",
        *args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_healthy(url, timeout_s, alive=lambda: proc.poll() is None)
        except (RuntimeError, TimeoutError) as exc:
            log.seek(0)
            raise RuntimeError(f"{' '.join(cmd)} failed: {exc}\n{log.read()[-3000:]}") from None
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.seek(0)
        tail = log.read()[-3000:]
        log.close()
        os.unlink(log.name)
    # Reached when the test body passed: SIGTERM is a graceful shutdown that exits 0.
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode} on SIGTERM:\n{tail}")


class ThreadServer:
    """A uvicorn server for an app, running in a background thread of this process."""

    def __init__(self, app, shutdown_timeout_s: float = 10.0) -> None:
        from adaserve.api.server import make_server

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = make_server(
            app, "127.0.0.1", self.port, log_level="warning", shutdown_timeout_s=shutdown_timeout_s
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> ThreadServer:
        self.thread.start()
        wait_healthy(self.url, 30.0, alive=self.thread.is_alive)
        return self

    def stop(self) -> None:
        """What SIGTERM does to `adaserve serve`."""
        self.server.handle_exit(signal.SIGTERM, None)
        self.thread.join(timeout=30)

    def __exit__(self, *exc: object) -> None:
        if self.thread.is_alive():
            self.stop()


def read_metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics parsed: {(sample name, sorted label pairs): value}."""
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum over the samples `name` carrying these labels, whatever their other labels
    (PromQL's `sum(name{labels})`; 0 when none). Request-level metrics also carry
    `model_name`, which a test of one server need not name."""
    wanted = set(labels.items())
    return sum(value for (n, pairs), value in samples.items() if n == name and wanted <= set(pairs))


def wait_for(
    predicate: Callable[[], bool], timeout_s: float, what: str, interval_s: float = 0.1
) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(interval_s)
