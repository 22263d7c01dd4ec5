"""Selected subtrees -> what the target forward needs: tokens, depths, parent ids, masks.

A node of a verify tree sits at position `context_len + depth` and attends to the
whole committed context plus itself and its ancestors (tree attention).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from adaserve.tree.candidate import CandidateTree


@dataclass
class VerifyTree:
    """A selected subtree, re-indexed 0..n-1 in the selection's sorted order; node 0 = root."""

    tokens: list[int]
    parents: list[int]  # index into this VerifyTree; -1 for the root
    depths: list[int]
    source_nodes: list[int]  # index of each node in the CandidateTree it was selected from

    def __len__(self) -> int:
        return len(self.tokens)


def build_verify_tree(tree: CandidateTree, selection: Sequence[int]) -> VerifyTree:
    """Re-index a connected selection (must contain the root 0) as a VerifyTree."""
    source = sorted(set(int(node) for node in selection))
    if len(source) != len(selection):
        raise ValueError(f"selection has duplicate nodes: {list(selection)}")
    if not source or source[0] != 0:
        raise ValueError(f"selection must contain the root 0, got {list(selection)}")
    if source[-1] >= len(tree):
        raise ValueError(f"selection node {source[-1]} is outside a tree of {len(tree)} nodes")
    new_index = {node: i for i, node in enumerate(source)}
    parents = [-1]
    for node in source[1:]:
        parent = tree.parents[node]
        if parent not in new_index:
            raise ValueError(
                f"selection is not connected: node {node}'s parent {parent} is missing"
            )
        parents.append(new_index[parent])
    return VerifyTree(
        tokens=[tree.tokens[node] for node in source],
        parents=parents,
        depths=[tree.depths[node] for node in source],
        source_nodes=source,
    )


def ancestor_mask(parents: Sequence[int]) -> torch.Tensor:
    """[n, n] bool; mask[i, j] = j is i or an ancestor of i.

    Needs parents listed first (`parents[i] < i`, -1 for a root): then row i is
    row parents[i] plus the diagonal entry, one row copy per node.
    """
    n = len(parents)
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        parent = int(parent)
        if parent >= i or parent < -1:
            raise ValueError(
                f"parents must satisfy -1 <= parents[i] < i, got parents[{i}] = {parent}"
            )
        if parent >= 0:
            mask[i] = mask[parent]
        mask[i, i] = True
    return mask


def tree_attention_mask(parents: Sequence[int], context_len: int) -> torch.Tensor:
    """[n, context_len + n] bool: all context columns, then ancestors/self among tree columns."""
    if context_len < 0:
        raise ValueError(f"context_len must be >= 0, got {context_len}")
    tree_part = ancestor_mask(parents)  # [n, n]
    context_part = torch.ones(len(parents), context_len, dtype=torch.bool)
    return torch.cat([context_part, tree_part], dim=1)


def chain_parents(n: int) -> list[int]:
    """Parents of a chain of n nodes: [-1, 0, 1, ..., n-2] (sequence speculation, prefill)."""
    return list(range(-1, n - 1))
