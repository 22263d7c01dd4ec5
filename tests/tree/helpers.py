"""Shared builders for the tree tests: random candidate trees and a table 'language model'."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import strategies as st

from adaserve.tree import CandidateTree


@st.composite
def candidate_trees(draw: st.DrawFn, max_nodes: int = 12) -> CandidateTree:
    """Random shapes (parents before children) and random draft log-probs <= 0.

    Log-probs include exact 0 (ties between parent and child) and -inf (f = 0).
    """
    num_nodes = draw(st.integers(1, max_nodes))
    tree = CandidateTree.root(draw(st.integers(0, 99)))
    logprob = st.one_of(
        st.floats(-6.0, 0.0, allow_nan=False), st.just(0.0), st.just(-math.inf), st.just(-1.0)
    )
    for node in range(1, num_nodes):
        parent = draw(st.integers(0, node - 1))
        tree.add_nodes([parent], [draw(st.integers(0, 99))], [draw(logprob)])
    return tree


def is_connected_selection(tree: CandidateTree, selection: list[int]) -> bool:
    """Sorted, unique, holds the root, and every selected node's parent is selected."""
    chosen = set(selection)
    return (
        selection == sorted(chosen)
        and 0 in chosen
        and all(tree.parents[node] in chosen for node in selection if node != 0)
        and all(0 <= node < len(tree) for node in selection)
    )


class TableModel:
    """A 'language model' given by a random logits table keyed by the token path.

    The same path always gets the same logits, so node logits of any tree are
    consistent with plain decoding from this model.
    """

    def __init__(self, vocab: int, seed: int, scale: float = 1.5) -> None:
        self.vocab = vocab
        self.scale = scale
        self.rng = np.random.default_rng(seed)
        self.table: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, path: tuple[int, ...]) -> torch.Tensor:
        if path not in self.table:
            values = self.rng.normal(0.0, self.scale, self.vocab)
            self.table[path] = torch.tensor(values, dtype=torch.float32)
        return self.table[path]  # [V]

    def logprobs(self, path: tuple[int, ...]) -> torch.Tensor:
        return torch.log_softmax(self.logits(path), dim=-1)  # [V]


def node_paths(tree: CandidateTree) -> list[tuple[int, ...]]:
    """Token path of each node after the root (the root's path is ())."""
    paths: list[tuple[int, ...]] = [()]
    for node in range(1, len(tree)):
        paths.append(paths[tree.parents[node]] + (tree.tokens[node],))
    return paths
