"""Log-probabilities of emitted tokens, from the target's raw logits.

A token's logprob is log softmax of the logits that predicted it: the target's own, before
penalties, temperature, top-k/top-p (vLLM's default, "raw" logprobs). Under speculation an
accepted token's row is its parent's row of the verified tree, the very logits plain decoding
would have computed for that prefix, so logprobs do not depend on whether a token was drafted.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class TokenLogprob:
    """One emitted token: its logprob and the `top` most likely tokens at its position."""

    token_id: int
    token: str  # the token decoded alone
    logprob: float
    top: tuple[tuple[int, str, float], ...]  # (id, decoded, logprob), most likely first


def token_logprobs(
    logits: torch.Tensor, tokens: Sequence[int], num_top: int, decode: Callable[[int], str]
) -> list[TokenLogprob]:
    """`logits` [k, V]: row i predicted tokens[i]. One host sync for all k rows."""
    lp = torch.log_softmax(logits.float(), dim=-1)  # [k, V]
    ids = torch.tensor(list(tokens), device=lp.device).unsqueeze(1)  # [k, 1]
    chosen = lp.gather(1, ids).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if num_top > 0:
        best = lp.topk(num_top, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    return [
        TokenLogprob(t, decode(t), c, tuple((i, decode(i), v) for i, v in top))
        for t, c, top in zip(tokens, chosen, tops)
    ]
