"""The draft-model drafter: a small model grows one candidate tree per request by beam search.

Draft KV layout of a request with L committed tokens (the last one is the root):
  KV indices [0, L)       committed tokens (kept across iterations)
  KV indices [L, L + S)   scratch: frontier nodes fed in steps 2..d, in feeding order (freed after)
A node's RoPE position is L - 1 + depth; its KV index is wherever it was fed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.runner import Runner
from adaserve.request_manager.drafters.base import Drafter, KeepGoing
from adaserve.request_manager.policies import SpecShape
from adaserve.request_manager.request import Request
from adaserve.tree import CandidateTree, beam_search_step, expand_step

if TYPE_CHECKING:
    from adaserve.exec.cuda_graph import DraftGraphRunner


def draft_scratch_tokens(shape: SpecShape) -> int:
    """Scratch KV entries one request needs: every frontier fed in steps 2..d."""
    return sum(shape.frontier_sizes()[:-1])


class ModelDrafter(Drafter):
    """Beam search (or SpecInfer expansion) with a draft model that has its own paged KV."""

    name = "model"
    costly = True

    def __init__(self, draft: Runner, graphs: DraftGraphRunner | None = None) -> None:
        self.draft, self.graphs = draft, graphs

    def scratch_tokens(self, shape: SpecShape) -> int:
        return draft_scratch_tokens(shape)

    def propose(
        self, requests: Sequence[Request], shape: SpecShape, keep_going: KeepGoing | None = None
    ) -> list[CandidateTree]:
        return speculate(self.draft, requests, shape, self.graphs, keep_going)


def speculate(
    draft: Runner,
    requests: Sequence[Request],
    shape: SpecShape,
    graphs: DraftGraphRunner | None = None,
    keep_going: KeepGoing | None = None,
) -> list[CandidateTree]:
    """Run the draft for up to `shape.depth` steps; returns one candidate tree per request.

    The caller has reserved draft KV for L + draft_scratch_tokens(shape) entries per request;
    afterwards each request's draft KV holds exactly its L committed tokens again. Drafting
    stops early when `keep_going(trees, frontier)` says the next level is not worth its cost.
    """
    trees = [CandidateTree.root(r.last_token) for r in requests]
    # Step 1: each request feeds every committed token the draft has not seen (at least the root).
    builder = SequenceBatchBuilder()
    for r in requests:
        n = r.num_tokens
        builder.add(
            r.all_token_ids[r.draft_num_cached :],
            list(range(r.draft_num_cached, n)),
            n,
            r.draft_block_table,
            logits="last",
        )
        r.draft_num_cached = n
    # With a reduced-vocabulary head, column j is token vocab[j] (K columns instead of V).
    vocab = draft.head_token_ids
    logits = draft.forward(builder.batch)
    assert logits is not None  # every row asks for logits
    logprobs = torch.log_softmax(logits, dim=-1)  # [R, V or K]
    frontier = _grow(trees, [[0] for _ in requests], logprobs[:, None, :], shape, 0, vocab)
    scratch: list[dict[int, int]] = [{} for _ in requests]  # node -> draft KV index
    for step in range(1, shape.depth):
        if keep_going is not None and not keep_going(trees, frontier):
            break
        builder = SequenceBatchBuilder()
        for i, r in enumerate(requests):
            base = r.num_tokens + len(scratch[i])
            for j, node in enumerate(frontier[i]):
                scratch[i][node] = base + j
            kv_len = base + len(frontier[i])
            builder.add(
                [trees[i].tokens[v] for v in frontier[i]],
                [r.num_tokens - 1 + trees[i].depths[v] for v in frontier[i]],
                kv_len,
                r.draft_block_table,
                tree=scratch_tree(trees[i], scratch[i], r.num_tokens),
            )
        width = len(frontier[0])
        # Steps 2..d repeat one shape per (R, width): replay it from a CUDA graph when one fits.
        if graphs is not None and graphs.covers(builder.batch):
            logits = graphs.forward(builder.batch)  # [R * width, V]
        else:
            logits = draft.forward(builder.batch)  # [R * width, V]
        assert logits is not None  # every row asks for logits
        logprobs = torch.log_softmax(logits, dim=-1).view(len(requests), width, -1)
        frontier = _grow(trees, frontier, logprobs, shape, step, vocab)
    for r in requests:
        draft.cache.truncate(r.draft_block_table, r.num_tokens)
    return trees


def _grow(
    trees: list[CandidateTree],
    frontier: list[list[int]],
    logprobs: torch.Tensor,
    shape: SpecShape,
    step: int,
    vocab: torch.Tensor | None = None,
) -> list[list[int]]:
    """Add the next level to every tree; logprobs [R, F, V] for the F frontier nodes of each.

    `vocab` [V'] maps logit columns to token ids for a reduced-vocabulary head.
    """
    new_frontier = []
    if shape.expansion is None:
        # On the draft's device: beam search adds it to logprobs there (on a GPU a host
        # tensor made every draft fail, so speculation silently ran roots only).
        path = torch.tensor(
            [[trees[i].path_logprobs[v] for v in f] for i, f in enumerate(frontier)],
            device=logprobs.device,
        )
        parent, token, tok_lp, _ = beam_search_step(path, logprobs, shape.width)
        if vocab is not None:
            token = vocab.to(token.device)[token]
        for i, tree in enumerate(trees):
            parents = [frontier[i][p] for p in parent[i].tolist()]
            new_frontier.append(tree.add_nodes(parents, token[i].tolist(), tok_lp[i].tolist()))
        return new_frontier
    k = shape.expansion[step]
    r, f, v = logprobs.shape
    token, tok_lp = expand_step(logprobs.reshape(r * f, v), k)  # [R*F, k]
    if vocab is not None:
        token = vocab.to(token.device)[token]
    token, tok_lp = token.view(r, f * k), tok_lp.view(r, f * k)
    for i, tree in enumerate(trees):
        parents = [node for node in frontier[i] for _ in range(k)]
        new_frontier.append(tree.add_nodes(parents, token[i].tolist(), tok_lp[i].tolist()))
    return new_frontier


def scratch_tree(tree: CandidateTree, scratch: dict[int, int], committed: int) -> list[int]:
    """Parents of a draft step's tree slots (`exec/batch.py`): every scratch node fed so far,
    in KV order from `committed`; a node whose parent is the root (the last committed token)
    attaches to the context (-1)."""
    nodes = sorted(scratch, key=scratch.__getitem__)
    parents = []
    for v in nodes:
        p = tree.parents[v]
        parents.append(-1 if p == 0 else scratch[p] - committed)
    return parents
