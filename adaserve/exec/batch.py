"""ForwardBatch: one forward over several sequences' new tokens, as plain lists.

Who fills it: the request manager (the scheduler's plan, the drafters' steps). Who reads it:
a runner (`exec/runner.py`). Tree structure travels as parents, not masks: each runner turns
it into what its kernels take (the torch and FlashInfer backends a boolean mask built by
`tree_mask`, llama.cpp sequence ids per token).

A sequence's KV indices [0, kv_len) split into its committed context [0, kv_len - len(tree))
and its tree slots [kv_len - len(tree), kv_len). `tree[j]` is the parent of tree slot j, as
an index into the tree slots, or -1 when its parent is the committed context's last token.
Its query tokens are the last `query_len` tree slots; the earlier ones (a draft step's
scratch nodes of earlier steps) are already in KV. A query token attends the whole committed
context plus itself and its ancestors among the tree slots. `tree = None` is a causal chunk.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from adaserve.exec.attention.base import AttentionMetadata


def tree_mask(tree: Sequence[int], query_len: int, kv_len: int) -> torch.Tensor:
    """[query_len, kv_len] bool: the committed context, then ancestors-or-self among the tree
    slots (the last len(tree) KV indices); the rows are the last query_len tree slots.

    Needs parents listed first (-1 <= tree[j] < j): then row j is row tree[j] plus j itself.
    """
    n = len(tree)
    if not 0 < query_len <= n <= kv_len:
        raise ValueError(f"need 0 < query_len {query_len} <= tree slots {n} <= kv_len {kv_len}")
    context = kv_len - n
    # Each slot's ancestors-or-self as a list (host lists, then one scatter: row copies in
    # torch cost ~5 us each, the host time of every tree forward).
    seen: list[list[int]] = []
    for j, parent in enumerate(tree):
        parent = int(parent)
        if not -1 <= parent < j:
            raise ValueError(
                f"tree parents must satisfy -1 <= tree[j] < j, got tree[{j}] = {parent}"
            )
        seen.append((seen[parent] if parent >= 0 else []) + [context + j])
    first = n - query_len
    rows = torch.zeros(query_len, kv_len, dtype=torch.bool)
    rows[:, :context] = True
    r = [i for i, cols in enumerate(seen[first:]) for _ in cols]
    c = [col for cols in seen[first:] for col in cols]
    rows[r, c] = True
    return rows


def is_chain(tree: Sequence[int]) -> bool:
    """The tree is one path from the context (each slot the child of the one before): causal."""
    return all(int(p) == j - 1 for j, p in enumerate(tree))


@dataclass
class ForwardBatch:
    """One forward over several sequences' new tokens (flat, sequence after sequence)."""

    token_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    kv_lens: list[int]
    block_tables: list[list[int]]
    # Per sequence: None (causal) or the parents of its tree slots (see the module docstring).
    trees: list[list[int] | None]
    # Flat indices of tokens whose logits are wanted (None: every token).
    logits_indices: list[int] | None = None
    # An EAGLE head's input features, one row per token [T, hidden] (None: zeros).
    features: torch.Tensor | None = None

    def metadata(self) -> AttentionMetadata:
        """What a mask-taking attention backend needs: the trees as boolean masks."""
        masks = [
            None if t is None or is_chain(t) and len(t) == q else tree_mask(t, q, kv)
            for t, q, kv in zip(self.trees, self.query_lens, self.kv_lens)
        ]
        return AttentionMetadata(self.query_lens, self.kv_lens, self.block_tables, masks)

    def cost_terms(self) -> tuple[int, int, int]:
        """(silent tokens, their pairs, tree pairs): what a forward adds to the cost of one
        decode row per sequence over the same context (control/cost_model.py).

        Silent tokens return no logits (prompt-chunk tokens); their pairs are the query-key
        pairs they compute. Tree pairs are those of each logits token after its sequence's
        first (a tree's nodes past the root), which the cost model's context term does not
        see: a 5-node tree 600 tokens into a request computes ~3,000 pairs where a decode row
        computes 600. A token at position p attends p + 1 keys (a tree node: the context, its
        ancestors and itself).
        """
        wanted = self.logits_indices
        out = set(range(len(self.token_ids)) if wanted is None else wanted)
        silent = silent_pairs = tree_pairs = 0
        start = 0
        for q in self.query_lens:
            first = True
            for i in range(start, start + q):
                if i not in out:
                    silent += 1
                    silent_pairs += self.positions[i] + 1
                elif first:
                    first = False
                else:
                    tree_pairs += self.positions[i] + 1
            start += q
        return silent, silent_pairs, tree_pairs


@dataclass
class SequenceBatchBuilder:
    """Accumulates sequences into a ForwardBatch; who fills it: the request manager."""

    batch: ForwardBatch = field(default_factory=lambda: ForwardBatch([], [], [], [], [], [], []))

    def add(
        self,
        tokens: list[int],
        positions: list[int],
        kv_len: int,
        block_table: list[int],
        tree: list[int] | None = None,
        logits: str = "all",
    ) -> list[int]:
        """Append a sequence; returns the flat indices (into logits rows) of its wanted logits.

        `tree`: parents of the sequence's tree slots (module docstring); None: causal.
        """
        b = self.batch
        if tree is not None and not len(tokens) <= len(tree) <= kv_len:
            raise ValueError(
                f"a tree of {len(tree)} slots cannot hold {len(tokens)} query tokens "
                f"within kv_len {kv_len}"
            )
        start = len(b.token_ids)
        b.token_ids += tokens
        b.positions += positions
        b.query_lens.append(len(tokens))
        b.kv_lens.append(kv_len)
        b.block_tables.append(block_table)
        b.trees.append(None if tree is None else list(tree))
        assert b.logits_indices is not None
        first = len(b.logits_indices)
        if logits == "all":
            b.logits_indices += range(start, start + len(tokens))
        elif logits == "last":
            b.logits_indices.append(start + len(tokens) - 1)
        return list(range(first, len(b.logits_indices)))

    def __len__(self) -> int:
        return len(self.batch.query_lens)
