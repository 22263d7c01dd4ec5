"""Our Llama-family model against Hugging Face transformers, over the paged KV cache."""

from __future__ import annotations

import platform

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaserve.config import CacheConfig, ModelConfig
from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.engine import ExecutionEngine
from adaserve.tree import ancestor_mask

ATOL = 1e-4


@pytest.fixture(params=[False, True], ids=["plain", "packed"])
def packed_linears(request, monkeypatch) -> bool:
    """Both ways a CPU model's linears run: as loaded, and with every weight packed for
    oneDNN (`pack_cpu_weight`) and `linear` told to use them at every row count (what
    `choose_cpu_linears` chooses for a large model where they are faster; the tiny models
    here are never timed; the table is the process's, so "plain" sets it too: a large model
    loaded earlier in the process may have chosen packed weights)."""
    from adaserve.exec.model import llama

    if request.param and llama.pack_cpu_weight(torch.randn(8, 8)) is None:
        assert platform.machine() not in ("x86_64", "AMD64"), "x86-64 torch has oneDNN"
        pytest.skip("this build of torch cannot pack weights for oneDNN")
    monkeypatch.setattr(llama, "_PACKED_ROWS", [request.param] * (llama.SKINNY_MAX_ROWS + 2))
    return request.param


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
def test_prefill_then_decode_match_transformers(arch, request, packed_linears):
    path = request.getfixturevalue(arch)
    torch.manual_seed(1)
    ids = torch.randint(2, 96, (23,)).tolist()
    ref = hf_logits(path, ids)  # [23, V]
    eng = engine_for(path)
    assert eng.target.model.linears_packed == packed_linears
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


def test_tree_forward_equals_each_path_alone(tiny_llama, packed_linears):
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


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 65, 130])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_weights_compute_f_linear(rows, bias, monkeypatch):
    # A weight packed once for oneDNN gives F.linear's products (to float32 rounding) at any
    # row count `linear` is told to use it for; a product whose gradient is wanted does not
    # use it (oneDNN's op has no backward).
    from adaserve.exec.model import llama

    torch.manual_seed(rows)
    w, x = torch.randn(96, 40), torch.randn(rows, 40)
    b = torch.randn(96) if bias else None
    packed = llama.pack_cpu_weight(w)
    if packed is None:
        assert platform.machine() not in ("x86_64", "AMD64"), "x86-64 torch has oneDNN"
        pytest.skip("this build of torch cannot pack weights for oneDNN")
    assert llama.pack_cpu_weight(w.half()) is None, "only float32 weights are packed"
    want = torch.nn.functional.linear(x, w, b)
    monkeypatch.setattr(llama, "_PACKED_ROWS", [True] * (llama.SKINNY_MAX_ROWS + 2))
    got = llama.linear(x, w, b, packed)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    xg = x.clone().requires_grad_()
    out = llama.linear(xg, w, b, packed)
    out.sum().backward()
    torch.testing.assert_close(xg.grad, w.sum(0).expand(rows, 40))
    # Told not to (the row count timed slower packed), `linear` runs the other kernels.
    monkeypatch.setattr(llama, "_PACKED_ROWS", [False] * (llama.SKINNY_MAX_ROWS + 2))
    assert torch.equal(llama.linear(x, w, b, packed), llama.linear(x, w, b))


def test_pick_packed_takes_packed_weights_only_where_clearly_faster():
    # {rows: (packed s, the faster other kernel s)}: packed 2x faster at 1-8 rows, a near tie
    # at 16, slower at 32-64, faster again for prompt chunks (PACK_LARGE_ROWS).
    from adaserve.exec.model.llama import PACK_LARGE_ROWS, SKINNY_MAX_ROWS, pick_packed

    times = {1: (1.0, 2.0), 2: (1.0, 2.0), 3: (1.0, 2.0), 4: (1.0, 2.0), 8: (1.0, 2.0)}
    times |= {16: (0.95, 1.0)}
    times |= {32: (3.0, 2.0), 64: (3.0, 2.0), PACK_LARGE_ROWS: (1.0, 2.0)}
    table = pick_packed(times)
    assert len(table) == SKINNY_MAX_ROWS + 2 and not table[0]
    assert all(table[1:9]) and not any(table[9:-1]) and table[-1]
    del times[PACK_LARGE_ROWS]
    assert not pick_packed(times)[-1], "prompt chunks untimed: not packed"


def test_pick_linears_takes_f_linear_only_where_it_is_clearly_faster():
    # {rows: (F.linear s, W x^T s)}: F.linear 2x faster at 1-4 rows, a near tie at 8 (the
    # default W x^T stands), W x^T faster from 16. A row count between two timed points is
    # decided by the next point up (5-8 by 8).
    from adaserve.exec.model.llama import SKINNY_MAX_ROWS, pick_linears

    times = {1: (1.0, 2.0), 2: (1.0, 2.0), 3: (1.0, 2.0), 4: (1.0, 2.0), 8: (0.95, 1.0)}
    times |= {16: (3.0, 2.0), 32: (3.0, 2.0), 64: (3.0, 2.0)}
    table = pick_linears(times)
    assert len(table) == SKINNY_MAX_ROWS + 1 and not table[0]
    assert all(table[1:5]) and not any(table[5:])
    # 3 rows are timed on their own: MKL's F.linear changes kernel at 4 rows on some CPUs, and
    # 3 rows decided by 4 ran the slower kernel.
    times[4] = (3.0, 2.0)
    table = pick_linears(times)
    assert all(table[1:4]) and not any(table[4:]), "3 rows followed 4's choice"


@pytest.fixture
def restore_linears():
    from adaserve.exec.model import llama

    saved, chosen, size = list(llama._F_LINEAR_ROWS), dict(llama._CHOSEN), llama._APPLIED_BYTES[0]
    packed = list(llama._PACKED_ROWS)
    llama._APPLIED_BYTES[0] = 0
    yield llama
    llama._F_LINEAR_ROWS[:] = saved
    llama._PACKED_ROWS[:] = packed
    llama._APPLIED_BYTES[0] = size
    llama._CHOSEN.clear()
    llama._CHOSEN.update(chosen)


def test_choose_cpu_linears_times_large_float32_weights_once_and_linear_follows(
    restore_linears, monkeypatch
):
    llama = restore_linears
    before = list(llama._F_LINEAR_ROWS)
    # Weights that stay in the CPU's caches are not timed: nothing changes.
    assert llama.choose_cpu_linears([torch.randn(96, 40)] * 4) is None
    assert llama._F_LINEAR_ROWS == before
    assert llama.choose_cpu_linears([torch.randn(1024, 1024).half()] * 40) is None

    torch.manual_seed(0)
    weights = [torch.randn(1024, 512) for _ in range(33)]  # 66 MiB of float32
    table = llama.choose_cpu_linears(weights, repeats=1)
    assert table is not None and llama._F_LINEAR_ROWS == table and not table[0]
    for lo, hi in zip((0,) + llama.SKINNY_POINTS, llama.SKINNY_POINTS):
        assert len(set(table[lo + 1 : hi + 1])) == 1  # one choice per timed point's span
    w = weights[0]
    for rows in (1, 3, 8, 20, 64):
        x = torch.randn(rows, 512)
        want = torch.nn.functional.linear(x, w) if table[rows] else llama.w_xt(x, w, None)
        assert torch.equal(llama.linear(x, w), want), f"{rows} rows ran the other kernel"
    # Packed weights were timed beside them, and a packed weight runs where they won.
    packs = list(llama._PACKED_ROWS)
    assert len(packs) == llama.SKINNY_MAX_ROWS + 2 and not packs[0]
    for lo, hi in zip((0,) + llama.SKINNY_POINTS, llama.SKINNY_POINTS):
        assert len(set(packs[lo + 1 : hi + 1])) == 1
    assert llama.packed_linears_pay() == any(packs)
    packed = llama.pack_cpu_weight(w)
    if packed is not None:
        for rows in (1, 3, 8, 20, 64, 100):
            x = torch.randn(rows, 512)
            use = packs[min(rows, llama.SKINNY_MAX_ROWS + 1)]
            want = llama._packed_linear(x, packed, None) if use else llama.linear(x, w)
            assert torch.equal(llama.linear(x, w, None, packed), want), f"{rows} rows"

    # The same shapes again (a second engine on the model): the choice is reused, not re-timed.
    monkeypatch.setattr(llama, "_measure", lambda *a: pytest.fail("timed again"))
    llama._F_LINEAR_ROWS[:] = [False] * len(table)
    llama._PACKED_ROWS[:] = [False] * len(packs)
    assert llama.choose_cpu_linears(weights) == table and llama._PACKED_ROWS == packs
