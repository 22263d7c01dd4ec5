"""Paged KV cache: fixed-size blocks, a free-list allocator, per-sequence block tables.

A block table is a plain `list[int]` owned by whoever owns the sequence (the Request); the
cache grows, shrinks and compacts it in place and never keeps a reference to it.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

import torch

# Up to this many KV slots, `KVCache.slots` lists them in Python (faster than tensor ops).
SLOTS_IN_PYTHON = 64


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockAllocator:
    """Reference-counted blocks: a LIFO free list, plus cached blocks nobody holds (LRU).

    A block whose content is registered in the prefix cache stays cached when its last holder
    lets go (`free`): it is "evictable", still counts as free, and is handed out again only
    when the free list is empty, least recently released first (`on_evict` is told, so the
    prefix cache forgets it). `share` takes another reference, reviving an evictable block.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._ref = [0] * num_blocks  # holders per block; 0 = free or evictable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.cached: set[int] = set()  # blocks whose content the prefix cache knows
        self.on_evict: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        """Blocks some sequence holds (evictable cached blocks are free)."""
        return self.num_blocks - self.num_free

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            if self._free:
                b = self._free.pop()
            else:
                b, _ = self._evictable.popitem(last=False)
                self.cached.discard(b)
                if self.on_evict is not None:
                    self.on_evict(b)
            self._ref[b] = 1
            blocks.append(b)
        return blocks

    def share(self, block: int) -> None:
        """One more holder of `block` (an evictable block is revived)."""
        if self._ref[block] == 0:
            if block not in self._evictable:
                raise RuntimeError(f"KV block {block} is free, nothing to share")
            del self._evictable[block]
        self._ref[block] += 1

    def evict(self, block: int) -> None:
        """Forget a cached block's content now (its KV is gone): an evictable one becomes
        plainly free, one still held stays with its holders, uncached."""
        if block not in self.cached:
            raise RuntimeError(f"KV block {block} is not cached")
        self.cached.discard(block)
        if block in self._evictable:
            del self._evictable[block]
            self._free.append(block)
        if self.on_evict is not None:
            self.on_evict(block)

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if self._ref[b] <= 0:
                raise RuntimeError(f"KV block {b} freed twice")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if b in self.cached:
                    self._evictable[b] = None  # newest at the end
                else:
                    self._free.append(b)


def blocks_for_memory(bytes_per_block: int, fraction: float, device: torch.device) -> int:
    """How many blocks fit in `fraction` of system RAM (CPU) or of free GPU memory (CUDA)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * fraction
    else:
        budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * fraction
    return max(1, int(budget // bytes_per_block))


class KVCacheLike(Protocol):
    """What the request manager uses of a runner's KV cache: `KVCache` (torch, sim) or
    `GgmlKVCache` (llama.cpp). Block tables in, KV slots out."""

    block_size: int
    device: torch.device
    allocator: BlockAllocator

    @property
    def num_blocks(self) -> int: ...

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int: ...

    def reserve(self, block_table: list[int], num_tokens: int) -> None: ...

    def truncate(self, block_table: list[int], num_tokens: int) -> None: ...

    def release(self, block_table: list[int]) -> None: ...

    def keep_subset(self, block_table: list[int], start: int, keep: list[int]) -> None: ...


class KVCache:
    """Per-layer K and V over `num_blocks * block_size` slots: k[layer] is [slots, Hkv, D]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        shape = (num_layers, num_blocks * block_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)
        self.allocator = BlockAllocator(num_blocks)

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * block_size * num_kv_heads * head_dim * elem

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        """Extra blocks `block_table` needs to hold `num_tokens` KV entries."""
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def reserve(self, block_table: list[int], num_tokens: int) -> None:
        """Grow `block_table` in place so it holds at least `num_tokens` entries."""
        need = self.blocks_needed(block_table, num_tokens)
        if need:
            block_table.extend(self.allocator.allocate(need))

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Shrink `block_table` in place to the blocks that `num_tokens` entries occupy."""
        keep = -(-num_tokens // self.block_size)
        if len(block_table) > keep:
            self.allocator.free(block_table[keep:])
            del block_table[keep:]

    def release(self, block_table: list[int]) -> None:
        """Free every block of a finished or aborted sequence."""
        self.truncate(block_table, 0)

    def slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Cache slots of KV indices [start, end) of a sequence: [end - start] int64, CPU.

        Called per sequence per forward (and per tree verification), so it is host time
        of every iteration: a few slots are listed in Python (~6-12 us), many by one
        broadcast over the blocks they span (~25-70 us; the tensor ops cost that at any size).
        """
        if end <= start:
            return torch.empty(0, dtype=torch.long)
        bs = self.block_size
        first, last = start // bs, (end - 1) // bs
        if last >= len(block_table):
            raise IndexError(
                f"KV index {end - 1} is past the {len(block_table)} blocks of the sequence"
            )
        if end - start <= SLOTS_IN_PYTHON:
            out: list[int] = []
            for b in range(first, last + 1):
                base = block_table[b] * bs - b * bs
                out.extend(range(base + max(start, b * bs), base + min(end, (b + 1) * bs)))
            return torch.tensor(out, dtype=torch.long)
        table = torch.tensor(block_table[first : last + 1], dtype=torch.long)
        offsets = torch.arange(bs)
        return (table[:, None] * bs + offsets).flatten()[start - first * bs : end - first * bs]

    def keep_subset(self, block_table: list[int], start: int, keep: list[int]) -> None:
        """Keep chosen fresh entries, compacted, and free the rest.

        The entries at KV indices start + keep[j] (keep strictly increasing) move to start + j for
        every layer; blocks past start + len(keep) are freed. Tree verification uses this to keep
        the accepted path's KV and drop the rejected branches.
        """
        if any(b <= a for a, b in zip(keep, keep[1:])) or (keep and keep[0] < 0):
            raise ValueError(f"keep offsets must be strictly increasing and >= 0, got {keep}")
        moved = [j for j, off in enumerate(keep) if off != j]
        if moved:
            src = self.slots(block_table, 0, start + keep[-1] + 1)[[start + keep[j] for j in moved]]
            dst = self.slots(block_table, start, start + len(keep))[moved]
            src, dst = src.to(self.device), dst.to(self.device)
            # Advanced indexing on the right copies first, so overlapping moves are safe.
            self.k[:, dst] = self.k[:, src]
            self.v[:, dst] = self.v[:, src]
        self.truncate(block_table, start + len(keep))
