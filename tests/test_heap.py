"""The serving process's heap: what is alive when serving starts stays out of the cyclic
collector's passes, and a benchmark's discarded engines are freed after their pass."""

from __future__ import annotations

import gc
import weakref

from adaserve.heap import frozen_heap


class _Cycle:
    """An object only the cyclic collector can free (it refers to itself)."""

    def __init__(self) -> None:
        self.me = self


def test_a_frozen_heap_is_skipped_by_collections_and_freed_after_the_block():
    before = _Cycle()
    gone_before = weakref.ref(before)
    with frozen_heap():
        assert gc.get_freeze_count() > 0
        del before  # garbage now, but frozen: no pass walks it
        gc.collect()
        assert gone_before() is not None, "a frozen object was walked by a full pass"
        during = _Cycle()
        gone_during = weakref.ref(during)
        del during
        gc.collect()
        assert gone_during() is None, "what serving allocates is still collected"
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert gone_before() is None, "after the block the discarded objects are freed"
