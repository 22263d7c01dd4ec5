"""Our Llama-family model against Hugging Face transformers, over the paged KV cache."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaserve.config import CacheConfig, ModelConfig
from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.engine import ExecutionEngine
from adaserve.tree import ancestor_mask

ATOL = 1e-4


def engine_for(path, block_size: int = 4) -> ExecutionEngine:
    return ExecutionEngine(
        ModelConfig(model=str(path)),
        CacheConfig(block_size=block_size, num_blocks=64),
        need_draft=False,
    )


def hf_logits(path, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen2"])
def test_prefill_then_decode_match_transformers(arch, request):
    path = request.getfixturevalue(arch)
    torch.manual_seed(1)
    ids = torch.randint(2, 96, (23,)).tolist()
    ref = hf_logits(path, ids)  # [23, V]
    eng = engine_for(path)
    runner, cache = eng.target, eng.target.cache
    table: list[int] = []
    # Prefill the first 15 tokens in one forward, then decode the rest one token at a time.
    cache.reserve(table, 15)
    b = SequenceBatchBuilder()
    b.add(ids[:15], list(range(15)), 15, table)
    got = [runner.forward(b.batch)]
    for pos in range(15, len(ids)):
        cache.reserve(table, pos + 1)
        b = SequenceBatchBuilder()
        b.add([ids[pos]], [pos], pos + 1, table)
        got.append(runner.forward(b.batch))
    got_t = torch.cat(got)
    err = (got_t - ref).abs().max().item()
    assert err < ATOL, (
        f"{arch}: max |logit diff| vs transformers = {err:.2e} (prefill+paged decode)"
    )


def test_batched_sequences_do_not_see_each_other(tiny_llama):
    """Three sequences of different lengths in one forward give each its own logits."""
    torch.manual_seed(2)
    seqs = [torch.randint(2, 96, (n,)).tolist() for n in (5, 17, 9)]
    eng = engine_for(tiny_llama)
    b = SequenceBatchBuilder()
    tables = []
    for s in seqs:
        t: list[int] = []
        eng.target.cache.reserve(t, len(s))
        tables.append(t)
        b.add(s, list(range(len(s))), len(s), t)
    got = eng.target.forward(b.batch)
    off = 0
    for s in seqs:
        err = (got[off : off + len(s)] - hf_logits(tiny_llama, s)).abs().max().item()
        assert err < ATOL, f"sequence of length {len(s)} in a batch differs by {err:.2e}"
        off += len(s)


def test_tree_forward_equals_each_path_alone(tiny_llama):
    """A token tree verified in one masked forward gives each node its path's logits."""
    torch.manual_seed(3)
    context = torch.randint(2, 96, (11,)).tolist()
    #        0
    #      /   \
    #     1     2
    #    / \     \
    #   3   4     5
    #   |
    #   6
    parents = [-1, 0, 0, 1, 1, 2, 3]
    tokens = torch.randint(2, 96, (len(parents),)).tolist()
    depths = [0] * len(parents)
    for i, p in enumerate(parents):
        depths[i] = 0 if p < 0 else depths[p] + 1
    eng = engine_for(tiny_llama)
    cache, table = eng.target.cache, []
    cache.reserve(table, len(context))
    b = SequenceBatchBuilder()
    b.add(context, list(range(len(context))), len(context), table, logits="none")
    eng.target.forward(b.batch)
    n, ctx = len(tokens), len(context)
    cache.reserve(table, ctx + n)
    b = SequenceBatchBuilder()
    b.add(tokens, [ctx + d for d in depths], ctx + n, table, tree=parents)
    got = eng.target.forward(b.batch)
    anc = ancestor_mask(parents)
    for node in range(n):
        path = [tokens[j] for j in range(n) if anc[node, j]]  # ancestors come before in index order
        ref = hf_logits(tiny_llama, context + path)[-1]
        err = (got[node] - ref).abs().max().item()
        assert err < ATOL, (
            f"tree node {node} (path {path}) differs from its path alone by {err:.2e}"
        )


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 33, 64, 65])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_is_f_linear_with_the_weights_streamed_once(rows, bias):
    # The model's linears run `W x^T` on CPU for 1-64 rows (MKL's few-row `x W^T` kernel costs
    # twice a row there; one row runs doubled, as two): the same function as F.linear to
    # float32 rounding, contiguous like it, and past 64 rows (prompt chunks) the very same bits.
    from adaserve.exec.model.llama import Linear, linear

    torch.manual_seed(rows)
    w, x = torch.randn(96, 40), torch.randn(rows, 40)
    b = torch.randn(96) if bias else None
    got, want = linear(x, w, b), torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if rows > 64:
        assert torch.equal(got, want)
    exact = (x.double() @ w.double().T + (b.double() if bias else 0)).float()
    assert (got - exact).abs().max() <= 4 * (want - exact).abs().max() + 1e-6
    # The module keeps nn.Linear's parameters and checkpoint names.
    mod = Linear(40, 96, bias=bias)
    assert set(mod.state_dict()) == set(torch.nn.Linear(40, 96, bias=bias).state_dict())
    torch.testing.assert_close(mod(x), torch.nn.functional.linear(x, mod.weight, mod.bias))
