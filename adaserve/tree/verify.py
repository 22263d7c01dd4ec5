"""Lossless tree verification: accepted path + bonus token from one target forward.

`logits[i]` is the target's next-token distribution after the path root..i, so a
walk down the tree reads the target exactly as plain decoding would.

Greedy (temperature 0): descend into the child whose token is argmax(logits[cur]);
the bonus is argmax at the last accepted node. Output equals greedy decoding.

Sampling: at node cur draw x ~ q(cur); if a child carries x, descend, else emit x
as the bonus and stop (at a leaf the draw is the bonus). Each emitted token is a
draw from q(. | emitted prefix), so
    P(x_1..x_k) = prod_j q(x_j | x_<j)
exactly the target's own distribution, whatever the draft proposed; a child is
accepted with probability q(child token), which f(v) approximates.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# Below this temperature sampling is greedy (as in vLLM): logits / T would overflow to inf.
GREEDY_BELOW_TEMPERATURE = 1e-5


def target_probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 probabilities after temperature, top-k, top-p (in order).

    top_k <= 0 or >= V: off; top_p == 1.0: off. temperature must be > 0 here.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for sampling, got {temperature}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    scaled = logits.float() / temperature  # [N, V]
    vocab = scaled.shape[-1]
    if 0 < top_k < vocab:
        # keep exactly k tokens (topk indices, not a threshold, so ties cannot keep more)
        top = scaled.topk(top_k, dim=-1)
        scaled = torch.full_like(scaled, float("-inf")).scatter_(-1, top.indices, top.values)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        # keep the smallest most-probable prefix whose mass reaches top_p: token j (in
        # descending order) stays iff the mass strictly before it is < top_p (true for j = 0)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = mass_before >= top_p
        drop[..., 0] = False  # the top token always stays, even if top_p rounds to 0 in float32
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
    return probs


def _children_by_token(tokens: Sequence[int], parents: Sequence[int]) -> list[dict[int, int]]:
    """Per node: child token -> child node (the first such child if tokens repeat)."""
    if len(tokens) != len(parents):
        raise ValueError(f"tokens ({len(tokens)}) and parents ({len(parents)}) differ in length")
    if len(tokens) == 0:
        raise ValueError("a verify tree needs at least its root")
    kids: list[dict[int, int]] = [{} for _ in tokens]
    for node in range(1, len(tokens)):
        kids[int(parents[node])].setdefault(int(tokens[node]), node)
    return kids


def is_greedy(temperature: float) -> bool:
    """Whether `verify` decodes greedily at this temperature."""
    return temperature < GREEDY_BELOW_TEMPERATURE


def verify_greedy(
    logits: torch.Tensor, tokens: Sequence[int], parents: Sequence[int]
) -> tuple[list[int], int]:
    """Greedy walk. Returns (accepted node indices excluding the root, in path order; bonus)."""
    # one host sync for all rows instead of one per step
    return walk_greedy(logits.argmax(dim=-1).tolist(), tokens, parents)


def walk_greedy(
    best: Sequence[int], tokens: Sequence[int], parents: Sequence[int]
) -> tuple[list[int], int]:
    """`verify_greedy` given each node's argmax token `best[i]` (read back already: a batch
    reads every request's rows back at once)."""
    if len(best) != len(tokens):
        raise ValueError(f"{len(best)} argmax rows for a tree of {len(tokens)} nodes")
    kids = _children_by_token(tokens, parents)
    accepted: list[int] = []
    node = 0
    while best[node] in kids[node]:
        node = kids[node][best[node]]
        accepted.append(node)
    return accepted, int(best[node])


def verify_sampling(
    logits: torch.Tensor,
    tokens: Sequence[int],
    parents: Sequence[int],
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """Sampling walk (lossless). Returns (accepted node indices excluding the root; bonus).

    Probabilities are computed only for the nodes on the walked path. Each step syncs to
    the host (the next node depends on the drawn token); a walk has at most depth+1 steps.
    """
    kids = _children_by_token(tokens, parents)
    device = generator.device if generator is not None else logits.device
    accepted: list[int] = []
    node = 0
    while True:
        probs = target_probs(logits[node : node + 1], temperature, top_k, top_p)[0]  # [V]
        # multinomial needs the generator and the tensor on one device; for one draw
        # replacement=True is the same distribution and a cheaper kernel
        draw = int(torch.multinomial(probs.to(device), 1, True, generator=generator).item())
        child = kids[node].get(draw)
        if child is None:
            return accepted, draw
        accepted.append(child)
        node = child


def verify(
    logits: torch.Tensor,
    tokens: Sequence[int],
    parents: Sequence[int],
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
) -> tuple[list[int], int]:
    """temperature < GREEDY_BELOW_TEMPERATURE -> verify_greedy, else verify_sampling."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if is_greedy(temperature):
        return verify_greedy(logits, tokens, parents)
    return verify_sampling(logits, tokens, parents, temperature, top_k, top_p, generator)
