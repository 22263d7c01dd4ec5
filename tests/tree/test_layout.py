"""Verify-tree re-indexing and tree-attention masks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.tree import (
    CandidateTree,
    ancestor_mask,
    build_verify_tree,
    chain_parents,
    tree_attention_mask,
)


def _example_tree() -> CandidateTree:
    #        0(10)
    #       /     \
    #     1(11)   2(12)
    #    /    \      \
    #  3(13) 4(14)   5(15)
    tree = CandidateTree.root(10)
    tree.add_nodes([0, 0, 1, 1, 2], [11, 12, 13, 14, 15], [-0.1, -0.2, -0.3, -0.4, -0.5])
    return tree


def test_build_verify_tree_reindexes_in_sorted_order() -> None:
    vt = build_verify_tree(_example_tree(), [5, 0, 2, 1, 4])
    assert vt.source_nodes == [0, 1, 2, 4, 5], f"nodes must be sorted: {vt.source_nodes}"
    assert vt.tokens == [10, 11, 12, 14, 15], f"tokens wrong: {vt.tokens}"
    assert vt.parents == [-1, 0, 0, 1, 2], f"parents must be re-indexed: {vt.parents}"
    assert vt.depths == [0, 1, 1, 2, 2], f"depths wrong: {vt.depths}"


def test_build_verify_tree_rejects_bad_selections() -> None:
    with pytest.raises(ValueError, match="not connected"):
        build_verify_tree(_example_tree(), [0, 3])
    with pytest.raises(ValueError, match="root"):
        build_verify_tree(_example_tree(), [1, 3])
    with pytest.raises(ValueError, match="duplicate"):
        build_verify_tree(_example_tree(), [0, 1, 1])


def test_root_only_and_chain_layouts() -> None:
    vt = build_verify_tree(_example_tree(), [0])
    assert vt.parents == [-1] and vt.tokens == [10], "root-only tree is incremental decoding"
    assert chain_parents(1) == [-1] and chain_parents(4) == [-1, 0, 1, 2], "chain parents wrong"
    assert torch.equal(ancestor_mask(chain_parents(5)), torch.ones(5, 5).tril().bool()), (
        "a chain's ancestor mask must be causal (lower triangular)"
    )


@st.composite
def parent_lists(draw: st.DrawFn) -> list[int]:
    """parents[i] < i; now and then an extra root (-1), since a forest works too."""
    parents = [-1]
    for i in range(1, draw(st.integers(1, 16))):
        parents.append(-1 if draw(st.integers(0, 9)) == 0 else draw(st.integers(0, i - 1)))
    return parents


@settings(max_examples=200, deadline=None)
@given(parents=parent_lists(), context_len=st.integers(0, 5))
def test_tree_attention_mask_equals_ancestor_walk(parents: list[int], context_len: int) -> None:
    n = len(parents)
    mask = tree_attention_mask(parents, context_len)
    assert mask.shape == (n, context_len + n) and mask.dtype == torch.bool, "mask shape/dtype"
    assert mask[:, :context_len].all(), "every node must see the whole context"
    for i in range(n):
        visible = set()
        node = i
        while node != -1:  # walk up to the root
            visible.add(node)
            node = parents[node]
        row = {j for j in range(n) if mask[i, context_len + j]}
        assert row == visible, f"node {i} sees {sorted(row)}, ancestors+self are {sorted(visible)}"


def test_ancestor_mask_requires_parents_first() -> None:
    with pytest.raises(ValueError, match="parents"):
        ancestor_mask([-1, 2, 0])
