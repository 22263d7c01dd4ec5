"""Context-dependent logits processing: penalties, min_p and min_tokens, per tree node.

A speculative tree verifies several continuations in one forward, so each node's logits are
processed with the context *its own path* would have: the request's prompt and output, plus
the drafted tokens from the root down to that node. Verification then reads processed logits
exactly as plain decoding would after committing that path, so greedy output equals the
target's greedy output under the same parameters and sampling keeps its distribution.

With vLLM's semantics, applied in this order to the raw logits of node i:
  logit_bias: logit[x] += bias[x] (context-free, OpenAI's)
  repetition_penalty r: for every token in prompt + output + path,
      logit > 0 -> logit / r, else logit * r
  frequency_penalty f, presence_penalty p, with c = the token's count in output + path:
      logit -= f * c + p * [c > 0]
  min_tokens m: while output + path < m tokens, EOS and stop_token_ids are -inf
  min_p q at temperature T (after temperature, before top-k/top-p): keep x iff
      softmax(logit / T)[x] >= q * max softmax  <=>  logit[x] >= max logit + T ln q
  (greedy: the argmax always stays, so min_p changes nothing).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import torch

from adaserve.request_manager.request import SamplingParams


def needs_processing(p: SamplingParams) -> bool:
    """Whether a request's logits depend on more than temperature, top-k and top-p."""
    return (
        p.repetition_penalty != 1.0
        or p.frequency_penalty != 0.0
        or p.presence_penalty != 0.0
        or p.min_tokens > 0
        or p.min_p > 0.0
        or bool(p.logit_bias)
    )


def path_tokens(tokens: Sequence[int], parents: Sequence[int]) -> list[list[int]]:
    """Per tree node: the tokens from below the root down to it (the root's list is empty)."""
    paths: list[list[int]] = [[]]
    for node in range(1, len(tokens)):
        paths.append(paths[parents[node]] + [tokens[node]])
    return paths


def process_tree_logits(
    logits: torch.Tensor,
    tokens: Sequence[int],
    parents: Sequence[int],
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    params: SamplingParams,
    stop_ids: Collection[int],
) -> torch.Tensor:
    """[N, V] logits of a verify tree (node 0 = root, its parents -1) -> processed [N, V].

    `stop_ids`: the ids min_tokens holds back (EOS unless ignore_eos, and stop_token_ids)."""
    out = logits.float().clone()  # [N, V]
    n, vocab = out.shape
    paths = path_tokens(tokens, parents)
    device = out.device
    if params.logit_bias:
        biased, biases = zip(*params.logit_bias)
        out[:, list(biased)] += torch.tensor(biases, device=device)
    counts = _output_counts(output_ids, paths, vocab, device) if _penalises(params) else None
    if params.repetition_penalty != 1.0:
        assert counts is not None
        seen = counts > 0
        seen[:, _valid(prompt_ids, vocab)] = True  # [N, V] bool
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        assert counts is not None
        out -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
    if params.min_tokens > 0 and stop_ids:
        held = [i for i in range(n) if len(output_ids) + len(paths[i]) < params.min_tokens]
        ids = _valid(stop_ids, vocab)
        if held and ids:
            rows = torch.tensor(held, device=device)
            out[rows.unsqueeze(1), torch.tensor(ids, device=device)] = float("-inf")
    if params.min_p > 0.0 and params.temperature > 0.0:
        floor = out.max(dim=-1, keepdim=True).values + params.temperature * math.log(params.min_p)
        out = out.masked_fill(out < floor, float("-inf"))
    return out


def _penalises(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _valid(ids: Collection[int], vocab: int) -> list[int]:
    return sorted({int(t) for t in ids if 0 <= int(t) < vocab})


def _output_counts(
    output_ids: Sequence[int], paths: list[list[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """[N, V] float32: how often each token occurs in the output plus node i's path."""
    kept = torch.tensor([t for t in output_ids if 0 <= t < vocab], dtype=torch.long)
    base = torch.bincount(kept, minlength=vocab).float()  # [V]
    counts = base.to(device).repeat(len(paths), 1)  # [N, V]
    rows = [i for i, path in enumerate(paths) for _ in path]
    cols = [t for path in paths for t in path]
    if rows:
        counts.index_put_(
            (torch.tensor(rows, device=device), torch.tensor(cols, device=device)),
            torch.ones(len(rows), device=device),
            accumulate=True,
        )
    return counts
