"""The OpenMP workers a thread docks are freed before the engine thread takes the engine: two
pools on the cores made every ggml forward of the server sleep at its barriers (3-4x slower on
2 cores, docs/results.md "Forwards at a third of their speed")."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator

import pytest
import torch

from adaserve.api.async_engine import AsyncEngine
from adaserve.api.metrics import ServerMetrics
from adaserve.config import ServerConfig
from adaserve.exec.openmp import release_thread_pool
from tests.api.test_server_tiny import make_engine


def thread_ids() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def gone(tids: set[int], timeout_s: float = 5.0) -> bool:
    """Whether every thread in `tids` has exited: a freed worker is told to exit and leaves
    on its own a moment later (1 in 200 was still listed right after the release), so the
    condition is polled, yielding the core to it, until the deadline."""
    deadline = time.monotonic() + timeout_s
    while tids & thread_ids():
        if time.monotonic() > deadline:
            return False
        os.sched_yield()
    return True


@pytest.fixture
def two_threads() -> Iterator[None]:
    """torch on two threads, so a parallel region docks a worker whatever the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def dock_workers() -> set[int]:
    """Run a parallel region on this thread from a freed pool; the worker threads it docked."""
    assert release_thread_pool()
    before = thread_ids()
    x = torch.ones(1 << 22)
    assert float(x.exp().sum()) == pytest.approx(float(torch.e) * (1 << 22), rel=1e-4)
    return thread_ids() - before


def test_release_frees_the_workers_this_thread_docked(two_threads) -> None:
    workers = dock_workers()
    assert workers, "a two-thread parallel region docked no worker thread"
    assert release_thread_pool()
    assert gone(workers), f"workers {workers} still alive after the release"
    # Parallel regions work afterwards (a fresh pool).
    assert float(torch.ones(1 << 22).sum()) == float(1 << 22)
    release_thread_pool()


def test_the_engine_thread_starts_with_no_pool_left_on_the_thread_that_built_it(
    tiny_llama, two_threads
) -> None:
    engine = make_engine(tiny_llama)
    workers = dock_workers()  # what building and warming an engine leaves here
    assert workers
    front = AsyncEngine(engine, ServerMetrics(ServerConfig().slo_classes))
    front.start()
    try:
        assert gone(workers), "the building thread's OpenMP workers outlived the engine start"
    finally:
        asyncio.run(front.shutdown())
