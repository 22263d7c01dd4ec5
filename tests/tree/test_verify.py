"""Lossless verification: greedy walk, sampling walk, target sampling filters."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve.tree import (
    CandidateTree,
    expand_step,
    target_probs,
    verify,
    verify_greedy,
    verify_sampling,
)
from tests.stats import chi_square

from .helpers import TableModel, candidate_trees, node_paths

V = 5  # tiny vocabulary for the distribution tests


def _hand_tree() -> tuple[list[int], list[int], torch.Tensor]:
    #          0(7)
    #        /      \
    #     1(1)      2(2)
    #    /    \        \
    #  3(3)   4(4)     5(3)
    tokens = [7, 1, 2, 3, 4, 3]
    parents = [-1, 0, 0, 1, 1, 2]
    logits = torch.full((6, 10), -1.0)
    for node, best in enumerate([1, 4, 0, 6, 9, 8]):  # argmax of each node's target logits
        logits[node, best] = 2.0
    return tokens, parents, logits


def test_verify_greedy_accepts_the_argmax_path_and_bonus() -> None:
    tokens, parents, logits = _hand_tree()
    accepted, bonus = verify_greedy(logits, tokens, parents)
    assert accepted == [1, 4], f"greedy must follow 0 -> 1 (token 1) -> 4 (token 4), got {accepted}"
    assert bonus == 9, f"bonus must be argmax at node 4 (9), got {bonus}"
    logits[0] = 0.0
    logits[0, 5] = 3.0  # root's argmax matches no child
    assert verify_greedy(logits, tokens, parents) == ([], 5), "no child matches: bonus only"


def test_root_only_tree_is_incremental_decoding() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0]])
    assert verify(logits, [4], [-1], 0.0, 0, 1.0, None) == ([], 1), "greedy root-only = argmax"
    gen = torch.Generator().manual_seed(0)
    accepted, bonus = verify(logits, [4], [-1], 1.0, 0, 1.0, gen)
    assert accepted == [] and 0 <= bonus < 3, "sampling root-only = one draw"


@settings(max_examples=100, deadline=None)
@given(tree=candidate_trees(max_nodes=10), seed=st.integers(0, 2**16))
def test_verify_greedy_equals_plain_greedy_decoding(tree: CandidateTree, seed: int) -> None:
    # Re-token the random tree onto a 3-token vocabulary so draft paths often match the target.
    tree.tokens = [t % 3 for t in tree.tokens]
    model = TableModel(vocab=3, seed=seed)
    paths = node_paths(tree)
    logits = torch.stack([model.logits(p) for p in paths])
    accepted, bonus = verify_greedy(logits, tree.tokens, tree.parents)
    emitted = [tree.tokens[v] for v in accepted] + [bonus]
    greedy: list[int] = []
    for _ in emitted:
        greedy.append(int(model.logits(tuple(greedy)).argmax()))
    assert emitted == greedy, f"tree greedy {emitted} differs from plain greedy {greedy}"


def test_target_probs_temperature_top_k_top_p() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 11, generator=gen) * 2
    probs = target_probs(logits, 0.7, 0, 1.0)
    assert probs.dtype == torch.float32, "probabilities must be float32"
    assert torch.allclose(probs, torch.softmax(logits / 0.7, -1)), "temperature: softmax(l / T)"
    top3 = target_probs(logits, 1.0, 3, 1.0)
    assert ((top3 > 0).sum(-1) == 3).all(), "top-k must keep exactly k tokens"
    kept = torch.zeros_like(top3, dtype=torch.bool).scatter_(-1, logits.topk(3).indices, True)
    assert torch.equal(top3 > 0, kept), "top-k must keep the k highest logits"
    full = torch.softmax(logits, -1)
    for p in (0.3, 0.6, 0.9):
        nucleus = target_probs(logits, 1.0, 0, p)
        for row in range(logits.shape[0]):
            mass = full[row].sort(descending=True).values.cumsum(0)
            m = int((nucleus[row] > 0).sum())
            assert mass[m - 1] >= p - 1e-6, f"top-p={p}: kept mass {mass[m - 1]:.3f} < p"
            assert m == 1 or mass[m - 2] < p, f"top-p={p}: kept more than the smallest prefix"
            ratio = nucleus[row][nucleus[row] > 0] / full[row][nucleus[row] > 0]
            assert torch.allclose(ratio, ratio[0].expand_as(ratio)), "top-p must only renormalize"
    both = target_probs(logits, 1.0, 3, 0.8)  # top-p applies to the top-k-renormalized mass
    for row in range(logits.shape[0]):
        mass = top3[row].sort(descending=True).values.cumsum(0)
        m = int((both[row] > 0).sum())
        assert m <= 3 and mass[m - 1] >= 0.8 - 1e-6 and (m == 1 or mass[m - 2] < 0.8), (
            "top-k then top-p: nucleus must be taken over the top-k distribution"
        )
    assert torch.allclose(both.sum(-1), torch.ones(6)), "filtered probabilities must sum to 1"
    with pytest.raises(ValueError, match="temperature"):
        target_probs(logits, 0.0, 0, 1.0)


def _draft_tree(draft: TableModel) -> CandidateTree:
    """Depth-3 tree from a draft model: root -> top-3, first two of those -> top-2, one -> top-2."""
    tree = CandidateTree.root(0)
    tokens, lps = expand_step(draft.logprobs(()).unsqueeze(0), 3)
    level1 = tree.add_nodes([0] * 3, tokens[0].tolist(), lps[0].tolist())
    level2 = []
    for node in level1[:2]:
        tokens, lps = expand_step(draft.logprobs(node_paths(tree)[node]).unsqueeze(0), 2)
        level2 += tree.add_nodes([node] * 2, tokens[0].tolist(), lps[0].tolist())
    tokens, lps = expand_step(draft.logprobs(node_paths(tree)[level2[0]]).unsqueeze(0), 2)
    tree.add_nodes([level2[0]] * 2, tokens[0].tolist(), lps[0].tolist())
    return tree


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 4, 0.9)])
def test_verify_sampling_is_lossless(temperature: float, top_k: int, top_p: float) -> None:
    num_samples, num_tokens = 20000, 3
    target, draft = TableModel(V, seed=11), TableModel(V, seed=12)
    tree = _draft_tree(draft)
    logits = torch.stack([target.logits(p) for p in node_paths(tree)])  # [N, V]
    gen = torch.Generator().manual_seed(2024)
    counts: dict[tuple[int, ...], int] = {}
    accepted_any = 0
    for _ in range(num_samples):
        accepted, bonus = verify_sampling(
            logits, tree.tokens, tree.parents, temperature, top_k, top_p, gen
        )
        accepted_any += bool(accepted)
        emitted = [tree.tokens[v] for v in accepted] + [bonus]
        while len(emitted) < num_tokens:  # continue as the next iteration would: a fresh root
            step = target.logits(tuple(emitted)).unsqueeze(0)
            _, bonus = verify_sampling(step, [emitted[-1]], [-1], temperature, top_k, top_p, gen)
            emitted.append(bonus)
        key = tuple(emitted[:num_tokens])
        counts[key] = counts.get(key, 0) + 1
    assert accepted_any > num_samples // 4, "the draft tree was hardly used; the test is too weak"

    # exact target joint: P(x1, x2, x3) = q(x1) q(x2 | x1) q(x3 | x1 x2)
    def q(path: tuple[int, ...]) -> torch.Tensor:
        return target_probs(target.logits(path).unsqueeze(0), temperature, top_k, top_p)[0]

    expected = {
        (a, b, c): float(q(())[a] * q((a,))[b] * q((a, b))[c])
        for a in range(V)
        for b in range(V)
        for c in range(V)
    }
    impossible = [k for k, p in expected.items() if p == 0.0 and counts.get(k, 0)]
    assert not impossible, f"emitted sequences the target cannot produce: {impossible[:5]}"
    stat, critical, df = chi_square(counts, expected, num_samples)
    assert stat < critical, (
        f"emitted token distribution differs from the target: chi2 = {stat:.1f} >= {critical:.1f} "
        f"(df = {df}, p = 0.001)"
    )


def test_walk_greedy_on_read_back_argmaxes_is_verify_greedy() -> None:
    from adaserve.tree import walk_greedy

    tokens, parents, logits = _hand_tree()
    best = logits.argmax(dim=-1).tolist()
    assert walk_greedy(best, tokens, parents) == verify_greedy(logits, tokens, parents)
    with pytest.raises(ValueError, match="5 argmax rows for a tree of 6 nodes"):
        walk_greedy(best[:5], tokens, parents)
