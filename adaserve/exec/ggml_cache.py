"""The scheduler's block-table view of llama.cpp's unified KV cache, shared prefixes included.

llama.cpp holds one pool of `n_ctx` cells; a cell belongs to every sequence id that holds it.
The scheduler's currency is still block tables: this cache hands out virtual blocks of
`block_size` cells, so admission, preemption and the KV metrics work as on the torch engine
(a request never holds more cells than its blocks cover). Each table gets a sequence id at
its first `reserve` (keyed by the table itself: its first block may be shared).

Trees (`begin_tree`, `keep_subset`) and draft scratch nodes (`scratch_node`) borrow spare ids
whose cells are the request's own (`seq_cp`: metadata, no KV copied); see exec/ggml.py.

Prefix caching. `PrefixCache` registers full committed blocks by content and `match` puts
cached blocks at the head of a new table, as on the torch engine; here a block is only a
count, so its content lives in whichever sequences hold its cells:
- `holders[block]`: the sequences whose cells at the block's positions are its content, with
  every earlier position of theirs intact. A live table's sequence holds each of its blocks.
- A table that a match filled gets, at `reserve`, a sequence made of a holder's cells for
  those positions: the holder of the last matched block holds all of them (a block's content
  key chains its whole prefix, so whoever holds it holds that prefix).
- A released sequence whose first blocks are registered keeps their cells, and nothing
  else, as a *keeper*: an id that never runs a query. It does not when every one of those
  blocks has another holder, and a keeper whose blocks a newer keeper covers is dropped.
  Keepers hold at most `max_kept_cells` in all (by default none: every forward pays for the
  cells in use, see MAX_KEPT_CELLS), a prompt's head first, the least recently used keeper
  dropped first. Without keepers a prefix is still shared while some request holds it.
- When the allocator evicts a cached block (`block_evicted`), each keeper holding it drops
  it and every later block (the chain breaks there); a block left with no holder is evicted
  too. When ids run out, the least recently used keeper goes.
So every cell llama.cpp holds lies in a block that is allocated or evictable, counted once,
and a block a match can find always has cells.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from adaserve.exec.kv_cache import BlockAllocator, NoFreeBlocksError

if TYPE_CHECKING:
    from adaserve.exec.ggml import LlamaCppContext

# Most cells released prefixes keep, by default none. A kept cell is not free: llama.cpp's
# attention walks the mask of every cell up to the highest one in use, for every query row of
# every forward (16,000 idle cells beside four 300-token requests: a 4-row decode 20.7 -> 29.4
# ms, a 16-row one 55.0 -> 84.7 ms; `python -m adaserve.bench.ggml_kv --idle`), and a kept
# cell high in the cache keeps that range wide however few cells are kept. Replaying 48 trace
# requests (docs/results.md), keeping 1,024 cells met 71% of SLOs at 1 rps where keeping none
# met 88%; a chat that resends its history gets its turns' first tokens 5x sooner with them
# (`--ggml-kept-prefix-cells`).
MAX_KEPT_CELLS = 0


@dataclass
class _Tree:
    """A verified tree's sequence ids, kept from its forward until its commit."""

    start: int  # position of the root
    leaf_of: list[int]  # per node: the id of one leaf below it (or itself)
    borrowed: list[int]  # leaf ids taken for this tree; returned at commit


class GgmlKVCache:
    """Block tables over llama.cpp's unified KV cache (see module doc)."""

    def __init__(
        self, llama: LlamaCppContext, block_size: int, max_kept_cells: int = MAX_KEPT_CELLS
    ) -> None:
        self.llama = llama
        self.block_size = block_size
        self.max_kept_blocks = max_kept_cells // block_size
        self.device = torch.device("cpu")
        self.allocator = BlockAllocator(llama.n_ctx // block_size)
        self._seq: dict[int, int] = {}  # id(block table) -> its sequence id
        self._free_ids = list(range(llama.max_seqs - 1, -1, -1))
        self._trees: dict[int, _Tree] = {}
        # Draft steps: per sequence, KV index of each scratch node fed -> the id holding its path.
        self._scratch: dict[int, dict[int, int]] = {}
        self._holders: dict[int, set[int]] = {}  # block -> sequences holding its cells
        self._keepers: OrderedDict[int, list[int]] = OrderedDict()  # id -> its blocks; LRU first

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_free_ids(self) -> int:
        """Ids a request or a tree leaf can take (a keeper's id is taken back when needed)."""
        return len(self._free_ids) + len(self._keepers)

    @property
    def num_keepers(self) -> int:
        """Released sequences kept for the cached prefix cells they hold."""
        return len(self._keepers)

    def blocks_needed(self, block_table: list[int], num_tokens: int) -> int:
        return max(0, -(-num_tokens // self.block_size) - len(block_table))

    def reserve(self, block_table: list[int], num_tokens: int) -> None:
        need = self.blocks_needed(block_table, num_tokens)
        seq = self._seq.get(id(block_table))
        if seq is None:
            if not need and not block_table:
                return
            if need > self.allocator.num_free:  # fail before an id is taken
                raise NoFreeBlocksError(
                    f"asked for {need} KV blocks, {self.allocator.num_free} free"
                )
            seq = self._new_seq(block_table)
        if need:
            blocks = self.allocator.allocate(need)  # may evict cached blocks (block_evicted)
            for b in blocks:
                self._holders[b] = {seq}
            block_table.extend(blocks)

    def _new_seq(self, block_table: list[int]) -> int:
        """An id for a table: empty, or holding the cells of the cached blocks a prefix match
        put at its head."""
        source = None
        if block_table:
            holders = self._holders.get(block_table[-1])
            if not holders:
                raise RuntimeError(f"cached KV block {block_table[-1]} has no cells in llama.cpp")
            source = min(holders)
            if source in self._keepers:
                self._keepers.move_to_end(source)
        seq = self._take_id(spare=source)
        self.llama.seq_rm(seq)  # a recycled id starts empty
        if source is not None:
            self.llama.seq_cp(source, seq, 0, len(block_table) * self.block_size)
            for b in block_table:
                self._holders[b].add(seq)
        self._seq[id(block_table)] = seq
        return seq

    def _take_id(self, spare: int | None = None) -> int:
        if not self._free_ids:
            oldest = next((k for k in self._keepers if k != spare), None)
            if oldest is None:
                raise NoFreeBlocksError(
                    f"all {self.llama.max_seqs} llama.cpp sequence ids are in use"
                )
            self._drop_keeper(oldest)
        return self._free_ids.pop()

    def seq_of(self, block_table: list[int]) -> int:
        seq = self._seq.get(id(block_table))
        if seq is None:
            raise ValueError("this block table holds no KV: reserve before a forward")
        return seq

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Keep the first `num_tokens` positions of the table's sequence, free the rest."""
        if not block_table:
            return
        keep = -(-num_tokens // self.block_size)
        seq = self._seq.get(id(block_table))
        if seq is None:  # cached blocks lent by a prefix match, never reserved
            self.allocator.free(block_table[keep:])
            del block_table[keep:]
            return
        self._end_tree(seq)
        self._end_scratch(seq)
        if keep == 0:
            self._release(seq, block_table)
            return
        if self.llama.seq_pos_max(seq) >= num_tokens:  # (seq_rm walks every cell: ~25 us)
            self.llama.seq_rm(seq, num_tokens, -1)
        if num_tokens % self.block_size and block_table[keep - 1] in self.allocator.cached:
            # A cached (full, committed) block cut short no longer holds its content.
            self._let_go(seq, block_table[keep - 1 : keep])
        if len(block_table) > keep:
            dropped = block_table[keep:]
            del block_table[keep:]
            self.allocator.free(dropped)
            self._let_go(seq, dropped)

    def release(self, block_table: list[int]) -> None:
        self.truncate(block_table, 0)

    def _release(self, seq: int, block_table: list[int]) -> None:
        """A table lets go of everything; its sequence stays as a keeper of the cells of its
        leading registered blocks if some of them have no other holder."""
        cached, n = self.allocator.cached, 0
        while (
            n < len(block_table)
            and block_table[n] in cached
            and seq in self._holders.get(block_table[n], ())
        ):
            n += 1
        n = min(n, self.max_kept_blocks)  # (a prompt's head is what is asked for again)
        kept = block_table[:n]
        if any(len(self._holders[b]) == 1 for b in kept):
            self.llama.seq_rm(seq, n * self.block_size, -1)
            self._keepers[seq] = kept
            covered = set(kept)
            for k in [k for k, blocks in self._keepers.items() if k != seq]:
                if self._keepers[k][-1] in covered:
                    self._drop_keeper(k)  # its cells are all this keeper's too
            while sum(map(len, self._keepers.values())) > self.max_kept_blocks:
                self._drop_keeper(next(iter(self._keepers)))  # least recently used first
            rest = block_table[n:]
        else:
            self.llama.seq_rm(seq)
            self._free_ids.append(seq)
            rest = list(block_table)
        del self._seq[id(block_table)]
        self.allocator.free(block_table)
        del block_table[:]
        self._let_go(seq, rest)

    def _drop_keeper(self, seq: int) -> None:
        blocks = self._keepers.pop(seq)
        self.llama.seq_rm(seq)
        self._free_ids.append(seq)
        self._let_go(seq, blocks)

    def _let_go(self, seq: int, blocks: list[int]) -> None:
        """`seq` no longer holds these blocks' cells; a cached block nobody holds any more has
        lost its content and leaves the prefix cache."""
        for b in blocks:
            holders = self._holders.get(b)
            if holders is None:
                continue
            holders.discard(seq)
            if not holders:
                del self._holders[b]
                if b in self.allocator.cached:
                    self.allocator.evict(b)

    def block_evicted(self, block: int) -> None:
        """The allocator evicted a cached block (PrefixCache tells us): the keepers holding it
        drop its cells and every later one's (their prefix chain breaks at it)."""
        holders = self._holders.pop(block, None)
        for k in sorted(holders or ()):
            blocks = self._keepers.get(k)
            if blocks is None:  # a live table's sequence never holds an evictable block
                continue
            i = blocks.index(block)
            later = blocks[i + 1 :]
            del blocks[i:]
            self.llama.seq_rm(k, i * self.block_size, -1)
            if not blocks:
                del self._keepers[k]
                self._free_ids.append(k)
            self._let_go(k, later)

    def keep_subset(self, block_table: list[int], start: int, keep: list[int]) -> None:
        """After verification: keep the tree nodes `keep` (the root, then the accepted path,
        node j at position start + j) as the sequence's, drop every other node."""
        seq = self.seq_of(block_table)
        tree = self._trees.get(seq)
        end = start + len(keep)
        if tree is not None:
            if tree.start != start:
                raise ValueError(f"the verified tree starts at {tree.start}, not {start}")
            leaf = tree.leaf_of[keep[-1]]
            if leaf != seq:
                # The path is another leaf's: take its cells as the request's own.
                self.llama.seq_rm(seq, start, -1)
                self.llama.seq_cp(leaf, seq, start, end)
        elif keep != list(range(len(keep))):
            raise ValueError(f"no tree was verified for this sequence; cannot keep {keep}")
        self.truncate(block_table, end)  # drops the rest and returns the borrowed ids

    # -------------------------------------------------------------- trees
    def begin_tree(self, seq: int, start: int, parents: list[int]) -> list[list[int]]:
        """Sequence ids per node for a tree whose root sits at `start`: each node gets the ids
        of the leaves below it, the first leaf being the request's own sequence."""
        self._end_tree(seq)
        n = len(parents)
        if any(p < 0 for p in parents[1:]):
            raise ValueError("a verification tree has one root, node 0")
        has_child = [False] * n
        for p in parents[1:]:
            has_child[p] = True
        leaves = [i for i in range(n) if not has_child[i]]
        if len(leaves) - 1 > self.num_free_ids:
            raise NoFreeBlocksError(
                f"a tree with {len(leaves)} leaves needs {len(leaves) - 1} spare llama.cpp "
                f"sequence ids, {self.num_free_ids} are free"
            )
        ids = {leaves[0]: seq}
        borrowed = []
        for leaf in leaves[1:]:
            s = self._take_id()
            self.llama.seq_rm(s)
            self.llama.seq_cp(seq, s, 0, start)  # the request's context, shared
            ids[leaf] = s
            borrowed.append(s)
        below: list[list[int]] = [[] for _ in range(n)]
        for leaf in leaves:  # walk each leaf up to the root
            v = leaf
            while v >= 0:
                below[v].append(ids[leaf])
                v = parents[v]
        self._trees[seq] = _Tree(start, [b[0] for b in below], borrowed)
        return below

    def scratch_node(self, seq: int, kv_index: int, parent_kv: int | None, pos: int) -> int:
        """A draft step's node at `kv_index` (RoPE position `pos`), child of the scratch node at
        `parent_kv` (None: of the committed context): a borrowed id holding its parent's path.
        The draft model feeds a tree level by level into scratch KV indices past the committed
        tokens; here each node gets a sequence of its own, made of its parent's cells."""
        if not self.num_free_ids:
            raise NoFreeBlocksError("no llama.cpp sequence id left for a draft node")
        nodes = self._scratch.setdefault(seq, {})
        src = seq if parent_kv is None else nodes[parent_kv]
        s = self._take_id()
        self.llama.seq_rm(s)
        self.llama.seq_cp(src, s, 0, pos)  # the context and the path down to the parent
        nodes[kv_index] = s
        return s

    def _end_scratch(self, seq: int) -> None:
        for s in self._scratch.pop(seq, {}).values():
            self.llama.seq_rm(s)
            self._free_ids.append(s)

    def _end_tree(self, seq: int) -> None:
        tree = self._trees.pop(seq, None)
        if tree is not None:
            for s in tree.borrowed:
                self.llama.seq_rm(s)
                self._free_ids.append(s)
