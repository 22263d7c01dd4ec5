"""The Python heap of a serving process: what start-up left alive kept out of the collector's
full passes.

CPython's cyclic collector walks every tracked object of the oldest generation in a full
pass, and it runs one once enough objects have survived since the last. A process that has
loaded torch, transformers and a model holds ~300,000 such objects, so a full pass takes
0.2 s here (0.46 s with two engines in one benchmark process), and it lands on whichever
step allocated last: every stream of the engine stops for it. Measured on the drafters
benchmark, one such pass was 0.46 s inside one step of a speculative engine, in a round of
5.9 s (docs/results.md, "Full garbage-collector passes"). Objects alive when serving starts
(modules, the model, the tokenizer) live as long as the process: `freeze_startup_heap`
moves them out of the collector's reach, so a full pass walks only what serving allocated.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager

logger = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then exclude every object still alive from the
    cyclic collector's passes (`gc.freeze`): for a process that serves until it exits.
    Returns how many objects are frozen."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    logger.info("froze %d start-up objects out of the garbage collector's passes", frozen)
    return frozen


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Within the block the collector passes over what was alive at its start, as in a server
    after `freeze_startup_heap`; after it, those objects are collectable again (engines a
    benchmark discards after a pass must be freed)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
