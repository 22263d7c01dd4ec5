"""Automatic prefix caching: full KV blocks found again by their content.

A full block of committed tokens is keyed by its own tokens and its prefix's key:

    key(block i) = (h(i - 1), tokens[i * bs : (i + 1) * bs]),   h(i) = hash(key(block i)), h(-1) = 0

so a block is only found after the very same tokens in front of it. Keys are compared whole
(a dict of tuples), so two blocks collide only if their prefixes' 64-bit hashes and their own
tokens all agree. Only committed tokens of full blocks are registered: speculative tree slots
and partial blocks never are. Blocks nobody holds stay cached until the allocator needs them
(least recently released first). The request manager calls `match` at admission and
`register` as tokens are committed; one PrefixCache per KV cache (target and draft), on the
torch engine's paged cache and on llama.cpp's (whose blocks are virtual: exec/ggml_cache.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from adaserve.exec.kv_cache import KVCacheLike

Key = tuple[int, tuple[int, ...]]


class PrefixCache:
    """Content keys of full blocks of one KV cache, and the hit statistics."""

    def __init__(self, cache: KVCacheLike) -> None:
        self.cache = cache
        self.block_size = cache.block_size
        self._block_of: dict[Key, int] = {}
        self._key_of: dict[int, Key] = {}
        cache.allocator.on_evict = self._forget
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block, None)
        if key is not None and self._block_of.get(key) == block:
            del self._block_of[key]
        # llama.cpp's cache keeps a released prefix's cells under a sequence id of its own
        # (exec/ggml_cache.py): they go when their block does.
        cells_gone = getattr(self.cache, "block_evicted", None)
        if cells_gone is not None:
            cells_gone(block)

    def _key(self, prev_hash: int, tokens: Sequence[int], i: int) -> Key:
        bs = self.block_size
        return (prev_hash, tuple(tokens[i * bs : (i + 1) * bs]))

    def cached_tokens(self, tokens: Sequence[int], max_tokens: int) -> int:
        """How many of `tokens` (at most `max_tokens`) a `match` would find cached now; takes
        no reference and counts nothing (admission prices the rest)."""
        prev, n = 0, 0
        for i in range(min(len(tokens), max_tokens) // self.block_size):
            key = self._key(prev, tokens, i)
            if key not in self._block_of:
                break
            prev = hash(key)
            n += self.block_size
        return n

    def match(self, tokens: Sequence[int], max_tokens: int, hashes: list[int]) -> list[int]:
        """Cached blocks holding a prefix of `tokens` (at most `max_tokens` of them).

        Takes a reference on every returned block (the caller's block table now holds them)
        and appends their hashes to `hashes` (the sequence's chain, for `register`).
        """
        alloc = self.cache.allocator
        blocks: list[int] = []
        prev = hashes[-1] if hashes else 0
        for i in range(min(len(tokens), max_tokens) // self.block_size):
            key = self._key(prev, tokens, i)
            block = self._block_of.get(key)
            if block is None:
                break
            alloc.share(block)
            blocks.append(block)
            prev = hash(key)
            hashes.append(prev)
        self.queried_tokens += max_tokens
        self.hit_tokens += len(blocks) * self.block_size
        return blocks

    def register(
        self,
        block_table: Sequence[int],
        tokens: Sequence[int],
        num_committed: int,
        hashes: list[int],
    ) -> None:
        """Register the full blocks among the first `num_committed` committed tokens."""
        alloc = self.cache.allocator
        for i in range(len(hashes), num_committed // self.block_size):
            key = self._key(hashes[-1] if hashes else 0, tokens, i)
            block = block_table[i]
            if key not in self._block_of and block not in self._key_of:
                self._block_of[key] = block
                self._key_of[block] = key
                alloc.cached.add(block)
            hashes.append(hash(key))

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)
