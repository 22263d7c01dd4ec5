"""CandidateTree bookkeeping, batched beam search and static expansion."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings

from adaserve.tree import CandidateTree, beam_search_step, expand_step

from .helpers import candidate_trees


def test_root_and_add_nodes_compute_depth_and_path_logprob() -> None:
    tree = CandidateTree.root(42)
    assert len(tree) == 1 and tree.path_prob(0) == 1.0, "root must have f = 1"
    first = tree.add_nodes([0, 0], [5, 6], [math.log(0.6), math.log(0.3)])
    second = tree.add_nodes([1, 3], [7, 8], [math.log(0.5), math.log(0.2)])
    assert first == [1, 2] and second == [3, 4], "add_nodes must return the appended indices"
    assert tree.depths == [0, 1, 1, 2, 3], f"depths wrong: {tree.depths}"
    assert tree.parents == [-1, 0, 0, 1, 3], f"parents wrong: {tree.parents}"
    assert tree.path_prob(4) == pytest.approx(0.6 * 0.5 * 0.2), "f(v) is the product along the path"
    assert tree.children() == [[1, 2], [3], [], [4], []], f"children wrong: {tree.children()}"


def test_add_nodes_rejects_missing_parent_and_ragged_input() -> None:
    tree = CandidateTree.root(1)
    with pytest.raises(ValueError, match="parent"):
        tree.add_nodes([1], [2], [0.0])
    with pytest.raises(ValueError, match="one entry per node"):
        tree.add_nodes([0, 0], [2], [0.0])


@settings(max_examples=60, deadline=None)
@given(tree=candidate_trees())
def test_random_trees_keep_parents_first_and_path_sums(tree: CandidateTree) -> None:
    for node in range(1, len(tree)):
        parent = tree.parents[node]
        assert parent < node, "a parent must precede its child"
        assert tree.depths[node] == tree.depths[parent] + 1, "depth must be parent depth + 1"
        expected = tree.path_logprobs[parent] + tree.logprobs[node]
        assert tree.path_logprobs[node] == expected, "path log-prob must add the node's log-prob"


def _brute_force_beam(path: torch.Tensor, logprobs: torch.Tensor, width: int) -> list[tuple]:
    """All (score, beam, token) children of one request, best first."""
    children = [
        (float(path[b] + logprobs[b, t]), b, t)
        for b, t in itertools.product(range(logprobs.shape[0]), range(logprobs.shape[1]))
    ]
    return sorted(children, key=lambda c: -c[0])[:width]


@pytest.mark.parametrize("seed", range(25))
def test_beam_search_step_matches_brute_force(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    num_requests, prev_width, vocab = 3, int(torch.randint(1, 4, (1,), generator=gen)), 6
    logprobs = torch.log_softmax(torch.randn(num_requests, prev_width, vocab, generator=gen), -1)
    path = -3 * torch.rand(num_requests, prev_width, generator=gen)
    if prev_width > 1:
        path[0, -1] = -math.inf  # a padding beam never produces a child while real ones remain
    width = int(torch.randint(1, vocab * (prev_width - (prev_width > 1)) + 1, (1,), generator=gen))
    parent, token, token_lp, path_lp = beam_search_step(path, logprobs, width)
    assert parent.shape == token.shape == token_lp.shape == path_lp.shape == (num_requests, width)
    assert parent.dtype == token.dtype == torch.int64, "indices must be int64"
    for r in range(num_requests):
        expected = _brute_force_beam(path[r], logprobs[r], width)
        got = list(zip(path_lp[r].tolist(), parent[r].tolist(), token[r].tolist(), strict=True))
        assert [(b, t) for _, b, t in got] == [(b, t) for _, b, t in expected], (
            f"request {r}: beam children differ from brute force"
        )
        assert torch.allclose(path_lp[r], torch.tensor([s for s, _, _ in expected])), "scores"
        assert torch.equal(token_lp[r], logprobs[r][parent[r], token[r]]), "token log-prob"
        assert torch.allclose(path_lp[r], path[r][parent[r]] + token_lp[r]), "path = parent + token"


def test_beam_search_step_rejects_bad_width() -> None:
    with pytest.raises(ValueError, match="width"):
        beam_search_step(torch.zeros(1, 2), torch.zeros(1, 2, 3), 7)


@pytest.mark.parametrize("seed", range(10))
def test_expand_step_equals_per_row_topk(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    logprobs = torch.log_softmax(torch.randn(4, 9, generator=gen), -1)
    k = 1 + seed % 4
    token, token_lp = expand_step(logprobs, k)
    for row in range(logprobs.shape[0]):
        expected = sorted(range(9), key=lambda t: -float(logprobs[row, t]))[:k]
        assert token[row].tolist() == expected, f"row {row}: expand_step is not the row's top-{k}"
        assert torch.equal(token_lp[row], logprobs[row, expected]), f"row {row}: log-probs differ"
