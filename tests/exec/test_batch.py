"""Trees travel as parents: the masks the torch backend builds from them are the masks the
scheduler and the drafters used to build themselves, for random trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.exec.batch import SequenceBatchBuilder, is_chain, tree_mask
from adaserve.request_manager.drafters.model import scratch_tree
from adaserve.tree import CandidateTree, tree_attention_mask


@st.composite
def parent_lists(draw, max_nodes: int = 24) -> list[int]:
    """Parents of a random verification tree: node 0 the root, parents listed first."""
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=200, deadline=None)
@given(parents=parent_lists(), context=st.integers(0, 40))
def test_verification_mask_from_parents_equals_the_ancestor_mask(parents, context) -> None:
    b = SequenceBatchBuilder()
    n = len(parents)
    b.add(list(range(n)), [context + 0] * n, context + n, [0], tree=parents)
    (mask,) = b.batch.metadata().masks
    want = tree_attention_mask(parents, context)
    if is_chain(parents):
        assert mask is None, "a chain is causal: no mask needed"
        mask = torch.ones(n, context + n, dtype=torch.bool).tril(context)
    assert torch.equal(mask, want), f"parents {parents}, context {context}"


def _old_draft_mask(tree: CandidateTree, frontier, scratch, committed: int, kv_len: int):
    """The mask the draft model's steps were fed before trees travelled as parents."""
    mask = torch.zeros(len(frontier), kv_len, dtype=torch.bool)
    mask[:, :committed] = True
    for row, node in enumerate(frontier):
        v = node
        while v > 0:
            mask[row, scratch[v]] = True
            v = tree.parents[v]
    return mask


@settings(max_examples=100, deadline=None)
@given(
    widths=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    committed=st.integers(1, 30),
    data=st.data(),
)
def test_draft_step_mask_from_scratch_parents_equals_the_old_mask(widths, committed, data):
    """A beam search grown level by level; every step's parents give the old step mask."""
    tree = CandidateTree.root(7)
    frontier = [0]
    scratch: dict[int, int] = {}
    for step, width in enumerate(widths):
        parents = [data.draw(st.sampled_from(frontier)) for _ in range(width)]
        frontier = tree.add_nodes(parents, [step] * width, [-1.0] * width)
        base = committed + len(scratch)
        for j, node in enumerate(frontier):
            scratch[node] = base + j
        kv_len = base + len(frontier)
        b = SequenceBatchBuilder()
        slots = scratch_tree(tree, scratch, committed)
        b.add([0] * len(frontier), [0] * len(frontier), kv_len, [0], tree=slots)
        (mask,) = b.batch.metadata().masks
        want = _old_draft_mask(tree, frontier, scratch, committed, kv_len)
        if mask is None:  # a chain: causal over every slot
            mask = torch.ones(len(frontier), kv_len, dtype=torch.bool).tril(kv_len - len(frontier))
        assert torch.equal(mask, want), f"step {step}: slots {slots}"


def test_tree_mask_rejects_parents_out_of_order() -> None:

    with pytest.raises(ValueError, match="tree parents"):
        tree_mask([-1, 2, 0], 3, 5)
    with pytest.raises(ValueError, match="query_len"):
        tree_mask([-1, 0], 3, 5)
    with pytest.raises(ValueError, match="cannot hold"):
        SequenceBatchBuilder().add([1, 2, 3], [0, 1, 2], 3, [0], tree=[-1, 0])


def test_cost_terms_count_chunk_and_tree_pairs_beyond_one_query_per_sequence() -> None:
    """A decode row adds nothing beyond the context term, a tree's nodes past its root add the
    keys they attend (their context, their ancestors, themselves), a prompt chunk's tokens are
    silent and add theirs."""
    b = SequenceBatchBuilder()
    b.add([7], [10], 11, [0])  # decode: one row at position 10
    b.add([1, 2, 3, 4], [600, 601, 601, 602], 604, [1], tree=[-1, 0, 0, 1])  # 4-node tree
    b.add([5, 6, 7], [0, 1, 2], 3, [2], logits="none")  # a prompt chunk
    b.add([8, 9], [3, 4], 5, [2], logits="last")  # its last chunk: one logits row
    silent, silent_pairs, tree_pairs = b.batch.cost_terms()
    assert silent == 3 + 1, "the chunk tokens without logits are silent"
    assert silent_pairs == 1 + 2 + 3 + 4, "chunk tokens at positions 0-3 attend 1-4 keys"
    assert tree_pairs == 602 + 602 + 603, "nodes past the root at positions 601, 601, 602"
    plain = SequenceBatchBuilder()
    for pos in (10, 600, 2000):
        plain.add([1], [pos], pos + 1, [0])
    assert plain.batch.cost_terms() == (0, 0, 0), "decode rows attend only what c counts"
