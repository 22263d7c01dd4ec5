"""OpenMP thread pools: the engine's forwards must be the only parallel regions on the cores.

torch and llama.cpp's CPU backend run their parallel work on one libgomp (torch's wheel
ships `libgomp.so.1`, llama.cpp links the same soname, so the process loads it once). libgomp
keeps a pool of worker threads per thread that ever opened a parallel region, docked until the
next one. The server builds its engine on the main thread (weights, warm-up, the start-up
profile: parallel regions there) and then runs every forward on the engine thread, which opens
a second pool. With more pooled threads than cores libgomp stops spinning at barriers and
sleeps in the kernel at each one, and llama.cpp meets a barrier after every op of the graph:
on 2 cores a one-token forward of the default model took 22-27 ms on the engine thread against
6-7 ms on the thread that built it (docs/results.md, "Forwards at a third of their speed").

`release_thread_pool()` frees the calling thread's pool (OpenMP 5.0 `omp_pause_resource_all`
with `omp_pause_hard`): the thread that built the engine calls it before handing the engine to
its own thread. A later parallel region on that thread opens a pool again, so nothing on the
event loop may run torch ops that go parallel.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

logger = logging.getLogger(__name__)

LIBGOMP = "libgomp.so.1"
OMP_PAUSE_HARD = 2  # omp_pause_resource_t: threads and their state freed


def _libgomp() -> ctypes.CDLL | None:
    """The libgomp the process has loaded (torch loads it at import), or None."""
    import torch  # noqa: F401  (torch brings the process's libgomp)

    try:
        # RTLD_NOLOAD: only the library already in the process, never a second copy.
        return ctypes.CDLL(LIBGOMP, mode=os.RTLD_NOLOAD)
    except OSError:
        return None  # torch built with another OpenMP (macOS: libomp): nothing to free here


def release_thread_pool() -> bool:
    """Free the OpenMP worker threads the calling thread has docked; True when freed (or
    none were). Must not be called inside a parallel region."""
    lib = _libgomp()
    if lib is None:
        return False
    lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
    lib.omp_pause_resource_all.restype = ctypes.c_int
    rc = lib.omp_pause_resource_all(OMP_PAUSE_HARD)
    if rc != 0:
        logger.warning(
            "could not free thread %s's OpenMP workers (omp_pause_resource_all: %d)",
            threading.current_thread().name,
            rc,
        )
    return rc == 0
