"""Which candidate nodes get verified: AdaServe Algorithm 2 and the baselines' selections.

Every selection is, per request, a sorted list of node indices of that request's
CandidateTree that always holds the root 0 and is connected (each selected node's
parent is selected). `budget` counts every verified token, roots included (each
root costs 1): sum of len(selection) <= budget, except when there are more
requests than budget, where every request still gets its root and nothing else.

Expected accepted tokens of a tree T (paper, Theorem 3.1, root included with f = 1):
    E[acc(T)] = sum_{v in T} f(v)
Greedy by f(v) keeps parents before children because f(child) <= f(parent)
(paper, A.1); we pop from a frontier of children of selected nodes, so the
selection stays connected even with ties (a log-prob of exactly 0).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence

from adaserve.tree.candidate import CandidateTree


def tree_shape(budget: int, num_requests: int, max_depth: int, max_width: int) -> tuple[int, int]:
    """Candidate-tree depth and beam width for this load (paper, Eq. 8-9).

    d = max(1, min(D_max, ceil(B / n))),  w = max(1, min(W_max, floor(B / n))).
    """
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    per_request_ceil = -(-budget // num_requests)
    per_request_floor = budget // num_requests
    depth = max(1, min(max_depth, per_request_ceil))
    width = max(1, min(max_width, per_request_floor))
    return depth, width


def required_accepts(
    elapsed_since_first_token_s: float, t_spec_s: float, slo_tpot_s: float, num_output_tokens: int
) -> float:
    """A(r) = (l_r + t_spec) / tpot_r - o_r: tokens r must accept this iteration to stay on SLO.

    The caller derives the selection target A_cap(r) = min(A(r), d + 1): a tree of depth d
    cannot yield more than d + 1 tokens (d accepted + 1 bonus).
    """
    if slo_tpot_s <= 0:
        raise ValueError(f"slo_tpot_s must be > 0, got {slo_tpot_s}")
    return (elapsed_since_first_token_s + t_spec_s) / slo_tpot_s - num_output_tokens


def _greedy_nodes(
    trees: Sequence[CandidateTree], selections: Sequence[Sequence[int]], requests: Sequence[int]
) -> Iterator[tuple[int, int]]:
    """Yield (request, node) of unselected nodes in non-increasing f(v), parents first.

    Max-heap over the frontier (children of selected nodes) keyed by
    (-path_logprob, depth, request, node): ties go to the shallower node, then the lower
    request index, then the lower node index. A yielded node's children join the
    frontier only when the consumer asks for the next node, i.e. after it took this one.
    """
    children = {r: trees[r].children() for r in requests}
    chosen = {r: set(selections[r]) for r in requests}
    heap: list[tuple[float, int, int, int]] = []

    def push_children(r: int, node: int) -> None:
        tree = trees[r]
        for child in children[r][node]:
            if child not in chosen[r]:
                heapq.heappush(heap, (-tree.path_logprobs[child], tree.depths[child], r, child))

    for r in requests:
        for node in selections[r]:
            push_children(r, node)
    while heap:
        _, _, r, node = heapq.heappop(heap)
        chosen[r].add(node)
        yield r, node
        push_children(r, node)


def _check_lengths(trees: Sequence[CandidateTree], *others: Sequence[object]) -> None:
    for other in others:
        if len(other) != len(trees):
            raise ValueError(f"expected one entry per request ({len(trees)}), got {len(other)}")


def slo_customized_select(
    trees: Sequence[CandidateTree],
    a_cap: Sequence[float | None],
    a_order: Sequence[float | None],
    budget: int,
    n_max: int,
) -> tuple[list[list[int]], int]:
    """SLO-customized selection (Algorithm 2, lines 3-17). Returns (selections, budget left).

    a_cap:   A_cap(r) = min(A(r), d + 1), computed by the caller; None = no SLO.
    a_order: A(r), the sort key; requests go in descending A(r) (ties: request order).
             Requests whose a_cap or a_order is None take nothing here.
    n_max:   cap on |T(r)| in this step, root included, as in line 12 (|T(r)| < n_max),
             so a request takes at most n_max - 1 non-root nodes here.
    Each request takes its own nodes in descending f(v) while
        n_acc < A_cap(r)  and  |T(r)| < n_max  and  budget left > 0,
    with n_acc = 1 (the root) + sum of the taken f(v). Budget left is B - n - taken, >= 0.
    """
    _check_lengths(trees, a_cap, a_order)
    selections = [[0] for _ in trees]
    budget_left = budget - len(trees)  # line 7: every root costs 1
    with_slo = [r for r in range(len(trees)) if a_cap[r] is not None and a_order[r] is not None]
    # line 9: descending A(r); `sorted` is stable, so equal A(r) keep request order
    order = sorted(with_slo, key=lambda r: float(a_order[r]), reverse=True)  # type: ignore[arg-type]
    for r in order:
        target = float(a_cap[r])  # type: ignore[arg-type]
        n_acc = 1.0  # line 6: the root's bonus token is always accepted, f(root) = 1
        nodes = _greedy_nodes(trees, selections, [r])
        # line 12; the paper writes B >= 0, but its Figure 2 spends exactly B, so B > 0
        while n_acc < target and len(selections[r]) < n_max and budget_left > 0:
            picked = next(nodes, None)  # line 13: GetTop(T_cand(r) - S_added)
            if picked is None:
                break  # the candidate tree is exhausted
            _, node = picked
            selections[r].append(node)
            n_acc += trees[r].path_prob(node)  # line 15: n_acc += f(v)
            budget_left -= 1
    return [sorted(s) for s in selections], max(budget_left, 0)


def throughput_optimized_select(
    trees: Sequence[CandidateTree], selections: Sequence[Sequence[int]], budget_left: int
) -> list[list[int]]:
    """Throughput-optimized selection (Algorithm 2, lines 18-23).

    Adds up to `budget_left` nodes to the given (connected, root-holding) selections, taking
    the highest f(v) among all requests' remaining candidates, one at a time.
    """
    _check_lengths(trees, selections)
    grown = [list(s) for s in selections]
    for r, s in enumerate(grown):
        if 0 not in s:
            raise ValueError(f"selection of request {r} lacks the root 0: {s}")
    nodes = _greedy_nodes(trees, grown, range(len(trees)))
    while budget_left > 0:  # line 18; B > 0 for the same reason as in the SLO step
        picked = next(nodes, None)  # line 19: GetTop over the union of candidate trees
        if picked is None:
            break
        r, node = picked
        grown[r].append(node)
        budget_left -= 1
    return [sorted(s) for s in grown]


def adaserve_select(
    trees: Sequence[CandidateTree],
    a_cap: Sequence[float | None],
    a_order: Sequence[float | None],
    budget: int,
    n_max: int,
) -> list[list[int]]:
    """AdaServe: SLO-customized selection, then throughput-optimized selection."""
    selections, budget_left = slo_customized_select(trees, a_cap, a_order, budget, n_max)
    return throughput_optimized_select(trees, selections, budget_left)


def global_greedy_select(trees: Sequence[CandidateTree], budget: int) -> list[list[int]]:
    """Baseline: roots, then the highest f(v) over all requests (throughput step only)."""
    roots = [[0] for _ in trees]
    return throughput_optimized_select(trees, roots, max(budget - len(trees), 0))


def equal_greedy_select(trees: Sequence[CandidateTree], budget: int) -> list[list[int]]:
    """Baseline: each request gets floor(B / n) tokens (root included, at least the root),
    greedy by f(v) in its own tree; budget a request cannot use is left unused."""
    if not trees:
        return []
    per_request = max(1, budget // len(trees))
    selections = [[0] for _ in trees]
    for r in range(len(trees)):
        nodes = _greedy_nodes(trees, selections, [r])
        while len(selections[r]) < per_request:
            picked = next(nodes, None)
            if picked is None:
                break
            selections[r].append(picked[1])
    return [sorted(s) for s in selections]


def select_all(trees: Sequence[CandidateTree]) -> list[list[int]]:
    """SpecInfer / sequence baselines: verify every node of every candidate tree."""
    return [list(range(len(tree))) for tree in trees]
