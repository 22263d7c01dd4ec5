"""FlashInfer backend: page/mask layout (CPU), wiring against a FlashInfer stand-in (CPU), and the
real kernels against the torch reference and HF transformers (CUDA, skipped without it)."""

from __future__ import annotations

import importlib
import importlib.util
import random
import sys
import types

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from adaserve.exec.attention.base import AttentionMetadata
from adaserve.exec.attention.torch_ref import TorchAttentionBackend
from adaserve.exec.kv_cache import KVCache

MODULE = "adaserve.exec.attention.flashinfer"
HAS_CUDA = torch.cuda.is_available()
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")


@pytest.fixture
def fi():
    """The backend module; without flashinfer installed, imported over an empty stand-in.

    Only its pure functions (and the stand-in wrappers below) are used then; the module is
    removed again afterwards so `engine._has_flashinfer()` still sees the truth.
    """
    saved = {name: sys.modules.get(name) for name in (MODULE, "flashinfer")}
    sys.modules.pop(MODULE, None)
    if importlib.util.find_spec("flashinfer") is None:
        sys.modules["flashinfer"] = types.ModuleType("flashinfer")
    try:
        yield importlib.import_module(MODULE)
    finally:
        for name, mod in saved.items():
            if mod is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = mod
        pkg = sys.modules["adaserve.exec.attention"]
        if saved[MODULE] is None and hasattr(pkg, "flashinfer"):
            delattr(pkg, "flashinfer")


def test_module_raises_import_error_without_flashinfer() -> None:
    if importlib.util.find_spec("flashinfer") is not None:
        pytest.skip("flashinfer is installed here")
    sys.modules.pop(MODULE, None)
    with pytest.raises(ImportError):
        importlib.import_module(MODULE)
    from adaserve.exec.torch_runner import has_flashinfer as _has_flashinfer

    assert not _has_flashinfer(), "_has_flashinfer() must be False without flashinfer"


# ------------------------------------------------------------------ metadata builders
def ancestor_mask(q_len: int, kv_len: int, rng: random.Random) -> torch.Tensor:
    """A random tree over the q_len new tokens: context + own ancestors + self."""
    ctx = kv_len - q_len
    mask = torch.zeros(q_len, kv_len, dtype=torch.bool)
    mask[:, :ctx] = True
    parents = [-1] + [rng.randrange(i) for i in range(1, q_len)]
    for i in range(q_len):
        v = i
        while v >= 0:
            mask[i, ctx + v] = True
            v = parents[v]
    return mask


def make_meta(
    q_lens: list[int], kv_lens: list[int], block_size: int, num_blocks: int, masked: list[bool]
) -> AttentionMetadata:
    """Sequences with shuffled (non-contiguous) block tables, one spare block each."""
    rng = random.Random(sum(kv_lens) * 31 + len(q_lens))
    blocks = list(range(num_blocks))
    rng.shuffle(blocks)
    tables, masks = [], []
    for q, kv, m in zip(q_lens, kv_lens, masked):
        n = -(-kv // block_size) + 1
        tables.append([blocks.pop() for _ in range(n)])
        masks.append(ancestor_mask(q, kv, rng) if m else None)
    return AttentionMetadata(q_lens, kv_lens, tables, masks)


SCENARIOS = {
    "decode": ([1, 1, 1], [1, 17, 40], [False] * 3),
    "causal": ([5, 1, 37], [5, 16, 80], [False] * 3),
    "tree": ([6, 1, 9], [30, 16, 9], [True, False, True]),
    "tree-draft-step": ([4, 4, 4, 4], [20, 33, 48, 4], [True, True, True, False]),
}


# ------------------------------------------------------------------ pure layout
def test_paged_layout_follows_block_tables(fi) -> None:
    bs = 16
    meta = make_meta([1, 5, 37, 3], [1, 16, 37, 50], bs, 64, [False] * 4)
    lay = fi.paged_layout(meta, bs)
    assert lay.qo_indptr.tolist() == [0, 1, 6, 43, 46]
    pages = [1, 1, 3, 4]
    assert lay.kv_indptr.tolist() == [0, 1, 2, 5, 9]
    cache = KVCache(1, 64, bs, 1, 1, torch.float32, "cpu")
    for s, (q, kv, table) in enumerate(zip(meta.query_lens, meta.kv_lens, meta.block_tables)):
        got = lay.kv_indices[lay.kv_indptr[s] : lay.kv_indptr[s + 1]].tolist()
        assert got == table[: pages[s]], f"sequence {s}: pages {got} != its block table prefix"
        last = int(lay.kv_last_page_len[s])
        assert 1 <= last <= bs and (pages[s] - 1) * bs + last == kv, (
            f"sequence {s}: FlashInfer would read kv_len {(pages[s] - 1) * bs + last}, not {kv}"
        )
        slots = lay.write_slots[lay.qo_indptr[s] : lay.qo_indptr[s + 1]]
        assert slots.tolist() == cache.slots(table, kv - q, kv).tolist(), (
            f"sequence {s}: new tokens would be written to the wrong slots"
        )
    assert lay.qo_indptr.dtype == lay.kv_indptr.dtype == lay.kv_indices.dtype == np.int32


def test_paged_layout_rejects_empty_kv_and_short_tables(fi) -> None:
    with pytest.raises(ValueError, match="kv_len"):
        fi.paged_layout(AttentionMetadata([0], [0], [[0]], [None]), 16)
    with pytest.raises(ValueError, match="block table"):
        fi.paged_layout(AttentionMetadata([1], [17], [[0]], [None]), 16)


def reference_pack(bits: np.ndarray) -> list[int]:
    """Little-endian bit packing written out by hand: element i -> bit i % 8 of byte i // 8."""
    out = [0] * (-(-len(bits) // 8))
    for i, b in enumerate(bits):
        if b:
            out[i // 8] |= 1 << (i % 8)
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_pack_masks_bit_layout(fi, name: str) -> None:
    q_lens, kv_lens, masked = SCENARIOS[name]
    meta = make_meta(q_lens, kv_lens, 16, 64, masked)
    packed, indptr = fi.pack_masks(meta)
    assert indptr[0] == 0 and len(packed) == indptr[-1]
    for s, (q, kv, m) in enumerate(zip(q_lens, kv_lens, meta.masks)):
        dense = fi.causal_mask(q, kv) if m is None else m.numpy()
        seg = packed[indptr[s] : indptr[s + 1]]
        assert len(seg) == -(-q * kv // 8), f"sequence {s} does not start on a byte boundary"
        assert seg.tolist() == reference_pack(dense.reshape(-1)), f"sequence {s}: bit order"
        # The kernel's read: (mask[base + off / 8] >> (off % 8)) & 1 with off = row * kv + col.
        for row in range(q):
            for col in range(kv):
                off = row * kv + col
                bit = (packed[indptr[s] + off // 8] >> (off % 8)) & 1
                assert bool(bit) == bool(dense[row, col]), f"seq {s} ({row}, {col}) misread"


def test_decode_rows_pack_as_all_ones_at_every_length(fi) -> None:
    """Decode rows take a shortcut (no dense mask): the bytes must be the reference packing
    of kv_len ones, a partial last byte included."""
    kv_lens = [1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 300]
    meta = make_meta([1] * len(kv_lens), kv_lens, 16, 64, [False] * len(kv_lens))
    packed, indptr = fi.pack_masks(meta)
    for s, kv in enumerate(kv_lens):
        seg = packed[indptr[s] : indptr[s + 1]].tolist()
        assert seg == reference_pack(np.ones(kv, dtype=bool)), f"kv_len {kv}"


def test_causal_mask_is_the_reference_rule(fi) -> None:
    for q, kv in [(1, 1), (1, 9), (5, 5), (3, 20)]:
        ref = torch.arange(kv)[None, :] <= (kv - q) + torch.arange(q)[:, None]
        assert (fi.causal_mask(q, kv) == ref.numpy()).all(), f"causal mask ({q}, {kv})"


def test_attention_mode(fi) -> None:
    meta = {k: make_meta(*v[:2], 16, 64, v[2]) for k, v in SCENARIOS.items()}
    assert fi.attention_mode(meta["decode"]) == "decode"
    assert fi.attention_mode(meta["causal"]) == "causal"
    assert fi.attention_mode(meta["tree"]) == "masked"
    assert fi.attention_mode(meta["tree-draft-step"]) == "masked"


# ------------------------------------------------------------------ wiring, on a stand-in
class _FakeWrapper:
    """FlashInfer's paged wrappers as their docs and kernels describe them, in plain torch.

    Keeps the detail the backend works around: plan(packed_custom_mask=...) stores the mask
    offsets in bits while the kernel adds them to a byte pointer.
    """

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, **buffers) -> None:
        assert kv_layout == "NHD"
        self.graph = use_cuda_graph
        self.bufs = buffers
        self._custom_mask_buf = buffers.get("custom_mask_buf")
        self._mask_indptr_buf = buffers.get("mask_indptr_buf")

    def reset_workspace_buffer(self, float_ws, int_ws) -> None:
        pass

    def plan(self, *args, packed_custom_mask=None, causal=False, **kw) -> None:
        if len(args) == 7:  # decode: (indptr, indices, last, Hq, Hkv, D, page_size)
            kv_indptr, indices, last, _, _, _, page = args
            qo = torch.arange(len(kv_indptr), dtype=torch.int32)
            causal = True
        else:
            qo, kv_indptr, indices, last, _, _, _, page = args
        kv_lens = (kv_indptr[1:] - kv_indptr[:-1] - 1) * page + last
        self.plan_args = (qo.clone(), kv_indptr.clone(), indices.clone(), kv_lens, causal)
        bit_indptr = torch.zeros(len(qo), dtype=torch.int64)
        bit_indptr[1:] = torch.cumsum((qo[1:] - qo[:-1]) * kv_lens, 0)
        if self.graph:  # copies into the caller's buffers; always custom-mask mode
            if packed_custom_mask is not None:
                self._custom_mask_buf[: len(packed_custom_mask)].copy_(packed_custom_mask)
                self._mask_indptr_buf.copy_(bit_indptr)
        elif packed_custom_mask is not None:
            self._custom_mask_buf, self._mask_indptr_buf = packed_custom_mask.clone(), bit_indptr
        else:
            self._custom_mask_buf = self._mask_indptr_buf = None

    def run(self, q, paged_kv) -> torch.Tensor:
        k_pages, v_pages = paged_kv
        qo, kv_indptr, indices, kv_lens, causal = self.plan_args
        out = torch.empty_like(q)
        for s in range(len(qo) - 1):
            pages = indices[kv_indptr[s] : kv_indptr[s + 1]].long()
            kv = int(kv_lens[s])
            keys = k_pages[pages].flatten(0, 1)[:kv]  # [kv, Hkv, D]
            vals = v_pages[pages].flatten(0, 1)[:kv]
            rows = slice(int(qo[s]), int(qo[s + 1]))
            n = rows.stop - rows.start
            if self._custom_mask_buf is not None:
                base = int(self._mask_indptr_buf[s])
                off = torch.arange(n * kv)
                byte = self._custom_mask_buf[base + off // 8].long()
                mask = ((byte >> (off % 8)) & 1).bool().view(n, kv)
            elif causal:
                mask = torch.arange(kv)[None, :] <= (kv - n) + torch.arange(n)[:, None]
            else:
                mask = torch.ones(n, kv, dtype=torch.bool)
            o = F.scaled_dot_product_attention(
                q[rows].transpose(0, 1),
                keys.transpose(0, 1),
                vals.transpose(0, 1),
                attn_mask=mask,
                enable_gqa=True,
            )
            out[rows] = o.transpose(0, 1)
        return out


@pytest.fixture
def fake_fi(fi, monkeypatch):
    stand_in = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=_FakeWrapper,
        BatchDecodeWithPagedKVCacheWrapper=_FakeWrapper,
        __version__="stand-in",
    )
    monkeypatch.setattr(fi, "flashinfer", stand_in)
    monkeypatch.setattr(fi, "_check_cache", lambda cache: None)  # CPU float32 here
    return fi


def random_cache(device, dtype, num_layers=2, num_blocks=64, bs=16, hkv=2, d=32) -> KVCache:
    cache = KVCache(num_layers, num_blocks, bs, hkv, d, dtype, device)
    cache.k.normal_()
    cache.v.normal_()
    return cache


def clone_cache(cache: KVCache, dtype: torch.dtype) -> KVCache:
    layers, slots, hkv, d = cache.k.shape
    other = KVCache(
        layers, slots // cache.block_size, cache.block_size, hkv, d, dtype, cache.device
    )
    other.k.copy_(cache.k)
    other.v.copy_(cache.v)
    return other


def run_both(backend, ref, meta, hq: int, layers: list[int], dtype, ref_dtype, plan=True):
    """Plan each backend once (plan=False: `backend` is already), run several layers.

    Yields (layer, out, ref_out, k, v) per layer.
    """
    if plan:
        backend.plan(meta)
    ref.plan(meta)
    _, _, hkv, d = backend.cache.k.shape
    dev = backend.cache.device
    for layer in layers:
        q = torch.randn(meta.num_tokens, hq, d, device=dev, dtype=dtype)
        k = torch.randn(meta.num_tokens, hkv, d, device=dev, dtype=dtype)
        v = torch.randn(meta.num_tokens, hkv, d, device=dev, dtype=dtype)
        out = backend.forward(q, k, v, layer)
        expect = ref.forward(q.to(ref_dtype), k.to(ref_dtype), v.to(ref_dtype), layer)
        yield layer, out, expect, k, v


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_backend_wiring_matches_torch_reference(fake_fi, name: str) -> None:
    """Plan/forward through the documented wrapper semantics equals the torch reference."""
    q_lens, kv_lens, masked = SCENARIOS[name]
    cache = random_cache("cpu", torch.float32)
    ref = TorchAttentionBackend(clone_cache(cache, torch.float32))
    backend = fake_fi.FlashInferAttentionBackend(cache)
    meta = make_meta(q_lens, kv_lens, 16, 64, masked)
    for layer, out, expect, k, v in run_both(
        backend, ref, meta, 4, [0, 1], torch.float32, torch.float32
    ):
        assert torch.allclose(out, expect, atol=1e-5), f"{name}, layer {layer}: output differs"
        slots = torch.from_numpy(fake_fi.paged_layout(meta, 16).write_slots)
        assert torch.equal(cache.k[layer][slots], k) and torch.equal(cache.v[layer][slots], v)
    mode = fake_fi.attention_mode(meta)
    assert (backend._planned.wrapper is backend._decode) == (mode == "decode")


def test_graph_mode_wiring_replans_with_new_lengths(fake_fi) -> None:
    """Capture-shape plan, then replay plans with other KV lengths and masks: still exact."""
    cache = random_cache("cpu", torch.float32)
    ref = TorchAttentionBackend(clone_cache(cache, torch.float32))
    backend = fake_fi.FlashInferAttentionBackend(cache, num_qo_heads=4)
    capture = make_meta([4] * 4, [4] * 4, 16, 64, [False] * 4)
    backend.prepare_for_capture(16, capture)
    for kv_lens in ([20, 33, 48, 4], [64, 5, 17, 90]):
        meta = make_meta([4] * 4, kv_lens, 16, 64, [True, True, True, False])
        backend.prepare_for_replay(meta)
        for _, out, expect, _, _ in run_both(
            backend, ref, meta, 4, [0], torch.float32, torch.float32, plan=False
        ):
            # prepare_for_replay already planned; forward must not re-plan eagerly
            assert backend._planned.wrapper is backend._graphs[(4, 16)].wrapper
            assert torch.allclose(out, expect, atol=1e-5), f"replay with kv {kv_lens} differs"
    with pytest.raises(RuntimeError, match="no CUDA graph"):
        backend.prepare_for_replay(make_meta([4] * 2, [8, 8], 16, 64, [True] * 2))


def test_backend_refuses_cpu_and_float32(fi) -> None:
    with pytest.raises(ValueError, match="CUDA"):
        fi.FlashInferAttentionBackend(random_cache("cpu", torch.bfloat16))
    if HAS_CUDA:
        with pytest.raises(ValueError, match="float16 or bfloat16"):
            fi.FlashInferAttentionBackend(random_cache("cuda", torch.float32))


# ------------------------------------------------------------------ real kernels (CUDA)
def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_flashinfer_matches_torch_reference(name: str, head_dim: int, dtype) -> None:
    fi = pytest.importorskip(MODULE)
    q_lens, kv_lens, masked = SCENARIOS[name]
    cache = random_cache("cuda", dtype, d=head_dim)
    ref = TorchAttentionBackend(clone_cache(cache, torch.float32))  # float32 on the same GPU
    backend = fi.FlashInferAttentionBackend(cache)
    meta = make_meta(q_lens, kv_lens, 16, 64, masked)
    for layer, out, expect, k, _ in run_both(backend, ref, meta, 8, [0, 1], dtype, torch.float32):
        assert not out.isnan().any(), f"{name}: NaN in the output"
        err = rel_error(out, expect)
        assert err < 1e-2, f"{name}, {dtype}, head_dim {head_dim}, layer {layer}: error {err:.2e}"
        slots = torch.from_numpy(fi.paged_layout(meta, 16).write_slots).cuda()
        assert torch.equal(cache.k[layer][slots], k), f"{name}: new K not in the cache"


@cuda_only
@pytest.mark.cuda
def test_flashinfer_graph_mode_replays_with_new_lengths() -> None:
    """A captured attention call replays correctly after re-planning with other lengths."""
    fi = pytest.importorskip(MODULE)
    dtype, hq = torch.bfloat16, 8
    cache = random_cache("cuda", dtype, d=64)
    backend = fi.FlashInferAttentionBackend(cache, num_qo_heads=hq)
    backend.prepare_for_capture(16, make_meta([4] * 4, [4] * 4, 16, 64, [False] * 4))
    q = torch.randn(16, hq, 64, device="cuda", dtype=dtype)
    k = torch.randn(16, 2, 64, device="cuda", dtype=dtype)
    v = torch.randn(16, 2, 64, device="cuda", dtype=dtype)
    backend.forward(q, k, v, 0)  # warm-up: kernels load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = backend.forward(q, k, v, 0)
    # The reference copies the cache after the capture's own K/V writes, which later
    # sequences read as context where their blocks overlap the capture's.
    ref = TorchAttentionBackend(clone_cache(cache, torch.float32))
    for kv_lens in ([20, 33, 48, 4], [64, 5, 17, 90]):
        meta = make_meta([4] * 4, kv_lens, 16, 64, [True, True, True, False])
        backend.prepare_for_replay(meta)
        for t in (q, k, v):
            t.normal_()
        graph.replay()
        ref.plan(meta)
        expect = ref.forward(q.float(), k.float(), v.float(), 0)
        err = rel_error(out, expect)
        assert err < 1e-2, f"replay with kv_lens {kv_lens}: error {err:.2e}"


def _greedy(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], int]:
    """Greedy outputs in prompt order, and the tree tokens accepted on the way."""
    from adaserve import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done, accepted = {}, 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        accepted += engine.last_stats.accepted_tokens
    return [done[i] for i in ids], accepted


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["incremental", "adaserve", "sequence"])
def test_greedy_generation_on_gpu_is_transformers_greedy(tmp_path_factory, policy: str) -> None:
    """FlashInfer has no float32, so the reference is HF transformers on the GPU in float16.

    Checked teacher-forced: every token we emit must be HF's argmax given the same prefix, up
    to float16 ties (a top logit within 0.05), which then let the two paths part honestly.
    `sequence` drafts every iteration (no control) with the target as its own draft, so trees
    are drafted on the GPU and accepted: a drafter that fails there (it did, on a host tensor)
    would otherwise pass here by verifying roots only.
    """
    pytest.importorskip(MODULE)
    from transformers import AutoModelForCausalLM

    from adaserve import LLMEngine
    from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from tests.conftest import make_tiny_checkpoint

    # hidden 256 over 4 heads: head_dim 64, which FlashInfer's kernels are built for
    target = make_tiny_checkpoint(tmp_path_factory.mktemp("target"), hidden=256)
    draft = None
    if policy == "adaserve":
        draft = make_tiny_checkpoint(
            tmp_path_factory.mktemp("draft"), num_layers=1, seed=1, hidden=256
        )
    elif policy == "sequence":
        draft = target  # its own draft: every drafted token it proposes is accepted
    engine = LLMEngine(
        ModelConfig(
            model=str(target),
            draft_model=None if draft is None else str(draft),
            dtype="float16",
            device="cuda",
            attention_backend="flashinfer",
        ),
        CacheConfig(block_size=16, num_blocks=64),
        SchedulerConfig(policy=policy),
    )
    rng = random.Random(0)
    prompts = [[rng.randrange(2, 96) for _ in range(n)] for n in (5, 13, 21)]
    outputs, accepted = _greedy(engine, prompts, 24)
    assert engine.scheduler.planner.num_draft_failures == 0
    if policy == "sequence":
        assert accepted > 0, "the self-draft's trees were never accepted"
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float16).cuda().eval()
    for prompt, out in zip(prompts, outputs):
        assert len(out) == 24
        seq = torch.tensor([prompt + out[:-1]], device="cuda")
        with torch.no_grad():
            logits = hf(seq).logits[0, len(prompt) - 1 :].float()  # [24, V]
        chosen = logits.gather(1, torch.tensor(out, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        bad = (gap > 0.05).nonzero().flatten().tolist()
        assert not bad, f"{policy}: tokens at {bad} are not HF's greedy choice (gaps {gap[bad]})"
