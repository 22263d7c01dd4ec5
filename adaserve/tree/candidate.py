"""Candidate token trees: the draft model's proposals, before selection.

A candidate tree is stored flat, one entry per node, parents before children
(`parents[i] < i`), so any prefix of the node list is itself a tree and a sorted
list of node indices lists every parent before its children.

Path probability (paper, Eq. 7):  f(v) = prod_{u in path(v)} M_q(u | X, path(u.parent))
kept in log space:                path_logprob(v) = path_logprob(parent(v)) + logprob(v)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class CandidateTree:
    """Candidate token tree of one request; node 0 is the root (the last committed token)."""

    tokens: list[int] = field(default_factory=list)  # token id per node
    parents: list[int] = field(default_factory=list)  # parent node index; -1 for the root
    depths: list[int] = field(default_factory=list)  # root depth 0
    logprobs: list[float] = field(default_factory=list)  # draft log-prob of the token | path
    path_logprobs: list[float] = field(default_factory=list)  # sum of logprobs root..node

    @classmethod
    def root(cls, token: int) -> CandidateTree:
        """A tree holding only the root (f(root) = 1, i.e. path log-prob 0)."""
        return cls(
            tokens=[int(token)], parents=[-1], depths=[0], logprobs=[0.0], path_logprobs=[0.0]
        )

    def add_nodes(
        self, parents: Sequence[int], tokens: Sequence[int], logprobs: Sequence[float]
    ) -> list[int]:
        """Append nodes (in order); returns their indices.

        A parent must already exist when its child is appended (it may be a node
        appended earlier in the same call), which keeps `parents[i] < i`.
        """
        if not (len(parents) == len(tokens) == len(logprobs)):
            raise ValueError(
                f"parents, tokens and logprobs must have one entry per node, got lengths "
                f"{len(parents)}, {len(tokens)}, {len(logprobs)}"
            )
        new_nodes: list[int] = []
        for parent, token, logprob in zip(parents, tokens, logprobs, strict=True):
            parent = int(parent)
            node = len(self.tokens)
            if not 0 <= parent < node:
                raise ValueError(f"parent {parent} of new node {node} is not an existing node")
            self.tokens.append(int(token))
            self.parents.append(parent)
            self.depths.append(self.depths[parent] + 1)
            self.logprobs.append(float(logprob))
            self.path_logprobs.append(self.path_logprobs[parent] + float(logprob))
            new_nodes.append(node)
        return new_nodes

    def __len__(self) -> int:
        return len(self.tokens)

    def path_prob(self, node: int) -> float:
        """f(v) = exp(path_logprob(v)): the draft's estimate that the target accepts root..v."""
        return math.exp(self.path_logprobs[node])

    def children(self) -> list[list[int]]:
        """Child lists per node, each in increasing node index."""
        kids: list[list[int]] = [[] for _ in self.tokens]
        for node, parent in enumerate(self.parents):
            if parent >= 0:
                kids[parent].append(node)
        return kids


def beam_search_step(
    path_logprobs: Tensor, logprobs: Tensor, width: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One batched beam-search step over R requests.

    path_logprobs: [R, W_prev] path log-prob of each current beam (-inf for padding beams)
    logprobs:      [R, W_prev, V] draft log-probs of the next token for each beam
    Returns (beam_parent [R, width] int64 index into W_prev, token [R, width] int64,
    token_logprob [R, width] float, path_logprob [R, width] float): the top-`width` of the
    W_prev * V children by path log-prob, best first.
    """
    if path_logprobs.dim() != 2 or logprobs.dim() != 3 or logprobs.shape[:2] != path_logprobs.shape:
        raise ValueError(
            f"expected path_logprobs [R, W_prev] and logprobs [R, W_prev, V], got "
            f"{tuple(path_logprobs.shape)} and {tuple(logprobs.shape)}"
        )
    num_requests, prev_width, vocab = logprobs.shape
    if not 1 <= width <= prev_width * vocab:
        raise ValueError(f"width must be in [1, W_prev * V = {prev_width * vocab}], got {width}")
    # child score: path(beam) + log M_q(token | beam)
    child_logprob = path_logprobs.unsqueeze(-1).to(logprobs.dtype) + logprobs  # [R, W_prev, V]
    top_logprob, flat = child_logprob.reshape(num_requests, -1).topk(width, dim=-1)  # [R, width]
    beam_parent = torch.div(flat, vocab, rounding_mode="floor")
    token = flat % vocab
    token_logprob = logprobs.reshape(num_requests, -1).gather(1, flat)
    return beam_parent, token, token_logprob, top_logprob


def expand_step(logprobs: Tensor, num_children: int) -> tuple[Tensor, Tensor]:
    """SpecInfer-style static expansion: each of N nodes keeps its own top-`num_children` tokens.

    logprobs [N, V] -> (token [N, k] int64, token_logprob [N, k] float), best first.
    """
    if logprobs.dim() != 2:
        raise ValueError(f"expected logprobs [N, V], got {tuple(logprobs.shape)}")
    if not 1 <= num_children <= logprobs.shape[1]:
        raise ValueError(
            f"num_children must be in [1, V = {logprobs.shape[1]}], got {num_children}"
        )
    token_logprob, token = logprobs.topk(num_children, dim=-1)
    return token, token_logprob


def subtree(tree: CandidateTree, keep: Sequence[int]) -> CandidateTree:
    """The nodes `keep` (sorted, root included, each node's parent kept too), re-indexed."""
    kept = CandidateTree.root(tree.tokens[0])
    new_id = {0: 0}
    for v in keep[1:]:
        (new_id[v],) = kept.add_nodes(
            [new_id[tree.parents[v]]], [tree.tokens[v]], [tree.logprobs[v]]
        )
    return kept


def top_chain(tree: CandidateTree) -> CandidateTree:
    """The single path that follows the most probable child from the root down."""
    kids = tree.children()
    chain = CandidateTree.root(tree.tokens[0])
    node, parent = 0, 0
    while kids[node]:
        node = max(kids[node], key=lambda v: (tree.logprobs[v], -v))
        (parent,) = chain.add_nodes([parent], [tree.tokens[node]], [tree.logprobs[node]])
    return chain


def merge_trees(a: CandidateTree, b: CandidateTree) -> CandidateTree:
    """Union of two trees over the same root; identical paths become one node.

    A node both trees hold gets the noisy-OR of their conditional probabilities,
        P(v | parent) = 1 - (1 - p_a)(1 - p_b),
    treating the two drafters as independent witnesses that the target continues that way.
    """
    if a.tokens[0] != b.tokens[0]:
        raise ValueError(f"trees have different roots: {a.tokens[0]} and {b.tokens[0]}")
    probs: dict[tuple[int, ...], float] = {}
    order: list[tuple[int, ...]] = []
    for tree in (a, b):
        paths: list[tuple[int, ...]] = [()]
        for v in range(1, len(tree)):
            path = paths[tree.parents[v]] + (tree.tokens[v],)
            paths.append(path)
            p = math.exp(tree.logprobs[v])
            if path in probs:
                probs[path] = 1.0 - (1.0 - probs[path]) * (1.0 - p)
            else:
                probs[path] = p
                order.append(path)
    merged = CandidateTree.root(a.tokens[0])
    node_of: dict[tuple[int, ...], int] = {(): 0}
    # Shorter paths first keeps parents before children.
    for path in sorted(order, key=len):
        p = min(probs[path], 1.0)
        (node_of[path],) = merged.add_nodes(
            [node_of[path[:-1]]], [path[-1]], [math.log(p) if p > 0 else -math.inf]
        )
    return merged
