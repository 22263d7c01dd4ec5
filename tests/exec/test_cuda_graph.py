"""CUDA graphs (draft steps, any small forward): buckets and padding (CPU); replay equals eager
(on a plain-torch stand-in on the CPU, on FlashInfer on CUDA)."""

from __future__ import annotations

import pytest
import torch

from adaserve.exec import cuda_graph
from adaserve.exec.attention.torch_ref import TorchAttentionBackend
from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.cuda_graph import (
    DraftGraphRunner,
    ForwardGraphRunner,
    choose_bucket,
    pad_batch,
    pad_forward,
    request_buckets,
    step_width,
)
from adaserve.exec.kv_cache import KVCache
from adaserve.exec.model.llama import LlamaArgs, LlamaForCausalLM
from adaserve.exec.torch_runner import ModelRunner
from tests.exec.test_flashinfer import fake_fi, fi  # noqa: F401  (fixtures: FlashInfer stand-in)

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

# head_dim 64: a size FlashInfer's kernels are built for
ARGS = LlamaArgs(
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rope_scaling=None,
    qkv_bias=False,
    tie_word_embeddings=True,
    sliding_window=None,
)


# ------------------------------------------------------------------ buckets (CPU)
@pytest.mark.parametrize("max_num_seqs", [1, 3, 8, 13, 64, 256])
def test_request_buckets_cover_every_count_with_bounded_padding(max_num_seqs: int) -> None:
    buckets = request_buckets(max_num_seqs)
    assert list(buckets) == sorted(set(buckets)) and buckets[-1] == max_num_seqs
    for n in range(1, max_num_seqs + 1):
        b = choose_bucket(n, buckets)
        assert b is not None and b >= n, f"{n} requests got bucket {b}"
        smaller = [x for x in buckets if n <= x < b]
        assert not smaller, f"{n} requests got {b}, though {smaller[0]} fits"
        assert b <= 2 * n or b - n < 8, f"{n} requests padded to {b}: too much padding"
    assert choose_bucket(max_num_seqs + 1, buckets) is None


def test_choose_bucket_rejects_nonpositive_counts() -> None:
    with pytest.raises(ValueError, match="num_requests"):
        choose_bucket(0, (1, 2))
    with pytest.raises(ValueError, match="max_num_seqs"):
        request_buckets(0)


def step_batch(kv_lens: list[int], tables: list[list[int]], width: int):
    """A draft step: `width` chained nodes per sequence after kv_len - width cached tokens."""
    builder = SequenceBatchBuilder()
    for i, (kv, table) in enumerate(zip(kv_lens, tables)):
        ctx = kv - width
        ids = [(5 * i + j) % 90 + 2 for j in range(width)]
        chain = list(range(-1, width - 1))
        builder.add(ids, [ctx + j for j in range(width)], kv, table, tree=chain)
    return builder.batch


def test_pad_batch_appends_dummy_sequences_only() -> None:
    batch = step_batch([10, 20, 7], [[3], [4, 5], [6]], width=2)
    padded = pad_batch(batch, 8, 2, dummy_table=[9])
    assert padded.query_lens == [2] * 8 and padded.kv_lens[:3] == [10, 20, 7]
    assert padded.token_ids[:6] == batch.token_ids and padded.positions[:6] == batch.positions
    assert padded.block_tables[:3] == [[3], [4, 5], [6]]
    assert all(t == [9] for t in padded.block_tables[3:]), "dummies must use the dummy table"
    assert padded.kv_lens[3:] == [2] * 5 and padded.trees[3:] == [None] * 5
    assert padded.logits_indices is None
    assert len(batch.query_lens) == 3, "pad_batch must not change its input"
    with pytest.raises(ValueError):
        pad_batch(batch, 2, 2, [9])


def test_step_width_accepts_only_uniform_all_logit_batches() -> None:
    batch = step_batch([10, 20], [[3], [4, 5]], width=3)
    assert step_width(batch) == 3
    ragged = SequenceBatchBuilder()
    ragged.add([1, 2], [0, 1], 2, [0])
    ragged.add([1], [0], 1, [1])
    assert step_width(ragged.batch) is None
    last_only = SequenceBatchBuilder()
    last_only.add([1, 2], [0, 1], 2, [0], logits="last")
    assert step_width(last_only.batch) is None


def test_runner_refuses_backends_without_graph_support() -> None:
    cache = KVCache(2, 8, 16, 2, 64, torch.float32, "cpu")
    runner = ModelRunner(LlamaForCausalLM(ARGS), cache, TorchAttentionBackend(cache))
    with pytest.raises(ValueError, match="CUDA graphs"):
        DraftGraphRunner(runner, max_num_seqs=4, max_width=4)


class _EagerGraph:
    """Stands in for a CUDA graph on the CPU: replay reruns the forward into the static output."""

    def __init__(self, fn, out: torch.Tensor) -> None:
        self.fn, self.out = fn, out

    def replay(self) -> None:
        self.out.copy_(self.fn())


def _eager_record(self, fn):
    out = fn()
    return _EagerGraph(fn, out), out


def test_runner_wiring_on_cpu(fake_fi, monkeypatch) -> None:  # noqa: F811
    """Padding, static buffers, plan-before-replay and slicing, with graphs replaced by reruns."""
    monkeypatch.setattr(cuda_graph, "_check_runner", lambda runner: None)
    monkeypatch.setattr(DraftGraphRunner, "_record", _eager_record)
    torch.manual_seed(0)
    cache = KVCache(2, 64, 16, 2, 64, torch.float32, "cpu")
    runner = ModelRunner(
        LlamaForCausalLM(ARGS).eval(), cache, fake_fi.FlashInferAttentionBackend(cache)
    )
    check_replay_equals_eager(runner, tol=1e-5)


def check_replay_equals_eager(runner: ModelRunner, tol: float) -> None:
    graphs = DraftGraphRunner(runner, max_num_seqs=8, max_width=4)
    cache, dev = runner.cache, runner.device
    lens = [5, 20, 33, 40]
    tables = prefill(runner, lens)
    width = 2
    # step 1: 3 requests (bucket 4, one dummy); step 2: 4 requests, longer KV, same graph
    for step, n in ((1, 3), (2, 4)):
        kv = [lens[i] + step * width for i in range(n)]
        batch = step_batch(kv, tables[:n], width)
        assert graphs.covers(batch)
        eager = runner.forward(batch)
        slots = torch.cat([cache.slots(tables[i], kv[i] - width, kv[i]) for i in range(n)]).to(dev)
        k_eager = cache.k[:, slots].clone()
        cache.k[:, slots] = float("nan")  # the replay must write them again
        replay = graphs.forward(batch)
        assert replay.shape == eager.shape
        assert_same_logits(replay, eager, f"step {step}, {n} requests", tol)
        assert torch.allclose(cache.k[:, slots], k_eager, atol=10 * tol), f"step {step}: K differs"
    assert graphs.num_graphs == 1, "(bucket 4, width 2) must be captured once and replayed"
    # the eager path still works after replays (the backend leaves graph mode on plan())
    assert_same_logits(runner.forward(batch), eager, "eager after replay", tol)
    graphs.close()
    for t in tables:
        cache.release(t)
    assert cache.allocator.num_used == 0, "graph runner leaked its dummy KV block"


# ------------------------------------------------------------------ replay vs eager (CUDA)
def flashinfer_runner(num_blocks: int = 64) -> ModelRunner:
    backend_module = pytest.importorskip("adaserve.exec.attention.flashinfer")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(ARGS).half().eval()
    cache = KVCache(2, num_blocks, 16, 2, 64, torch.float16, "cuda")
    return ModelRunner(model, cache, backend_module.FlashInferAttentionBackend(cache))


def prefill(runner: ModelRunner, lens: list[int]) -> list[list[int]]:
    tables: list[list[int]] = [[] for _ in lens]
    builder = SequenceBatchBuilder()
    for i, (n, table) in enumerate(zip(lens, tables)):
        runner.cache.reserve(table, n + 16)  # room for a few draft steps
        builder.add(
            [(3 * i + j) % 90 + 2 for j in range(n)], list(range(n)), n, table, logits="none"
        )
    runner.forward(builder.batch)
    return tables


def assert_same_logits(replay: torch.Tensor, eager: torch.Tensor, what: str, tol: float) -> None:
    assert not replay.isnan().any(), f"{what}: NaN in the replayed logits (KV not rewritten?)"
    err = float((replay - eager).norm() / eager.norm())
    assert err < tol, f"{what}: replay differs from eager by {err:.2e}"
    top2 = eager.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 0.05
    same = replay.argmax(-1) == eager.argmax(-1)
    assert same[clear].all(), f"{what}: replay changes a clear argmax"


@cuda_only
@pytest.mark.cuda
def test_replay_equals_eager_across_lengths_and_request_counts() -> None:
    check_replay_equals_eager(flashinfer_runner(), tol=1e-2)


@cuda_only
@pytest.mark.cuda
def test_each_width_gets_its_own_graph() -> None:
    runner = flashinfer_runner()
    graphs = DraftGraphRunner(runner, max_num_seqs=4, max_width=4)
    tables = prefill(runner, [9, 17])
    for width in (1, 3, 4):
        batch = step_batch([9 + width, 17 + width], tables, width)
        replay = graphs.forward(batch)
        assert_same_logits(replay, runner.forward(batch), f"width {width}", 1e-2)
    assert graphs.num_graphs == 3
    too_wide = step_batch([9 + 5, 17 + 5], tables, 5)
    assert not graphs.covers(too_wide)


# ------------------------------------------------------------------ any forward
def verify_batch(
    ctxs: list[int], tables: list[list[int]], trees: list[list[int] | None], logits: str = "all"
):
    """Per sequence a tree (parents over its new tokens, -1: on the context) or a decode token."""
    builder = SequenceBatchBuilder()
    for i, (ctx, table, tree) in enumerate(zip(ctxs, tables, trees)):
        parents = tree if tree is not None else [-1]
        depth: list[int] = []
        for p in parents:
            depth.append(0 if p < 0 else depth[p] + 1)
        ids = [(7 * i + j) % 90 + 2 for j in range(len(parents))]
        builder.add(
            ids, [ctx + d for d in depth], ctx + len(parents), table, tree=tree, logits=logits
        )
    return builder.batch


def test_pad_forward_fills_the_buckets_with_dummy_sequences() -> None:
    batch = verify_batch([10, 20, 7], [[3], [4, 5], [6]], [[-1, 0], None, [-1, 0, 0]])
    assert batch.query_lens == [2, 1, 3]
    padded = pad_forward(batch, 4, 16, dummy_table=[9])
    assert padded.query_lens == [2, 1, 3, 10] and len(padded.token_ids) == 16
    assert padded.token_ids[:6] == batch.token_ids and padded.positions[:6] == batch.positions
    assert padded.kv_lens == [12, 21, 10, 10] and padded.positions[6:] == list(range(10))
    assert padded.block_tables[3] == [9] and padded.trees[3] is None
    assert padded.logits_indices is None
    several = pad_forward(batch, 8, 16, [9])
    assert several.query_lens[3:] == [6, 1, 1, 1, 1], "one token per dummy, the rest on the first"
    assert len(batch.query_lens) == 3, "pad_forward must not change its input"
    with pytest.raises(ValueError, match="cannot pad"):
        pad_forward(batch, 8, 8, [9])  # five dummies need five tokens, two are left
    with pytest.raises(ValueError, match="cannot pad"):
        pad_forward(batch, 3, 8, [9])  # padding tokens and no dummy to hold them


def cpu_stand_in_runner(fake_fi, monkeypatch) -> ModelRunner:  # noqa: F811
    monkeypatch.setattr(cuda_graph, "_check_runner", lambda runner: None)
    monkeypatch.setattr(cuda_graph._GraphRunner, "_record", _eager_record)
    torch.manual_seed(0)
    cache = KVCache(2, 64, 16, 2, 64, torch.float32, "cpu")
    return ModelRunner(
        LlamaForCausalLM(ARGS).eval(), cache, fake_fi.FlashInferAttentionBackend(cache)
    )


def test_forward_buckets_leave_room_for_dummies(fake_fi, monkeypatch) -> None:  # noqa: F811
    runner = cpu_stand_in_runner(fake_fi, monkeypatch)
    graphs = ForwardGraphRunner(runner, max_num_seqs=16, max_tokens=32, max_kv_len=100)
    assert graphs.buckets(verify_batch([5], [[0]], [None])) == (1, 1)
    # 3 tokens on one sequence: token bucket 4 needs a dummy sequence for its 4th token
    assert graphs.buckets(verify_batch([5], [[0]], [[-1, 0, 0]])) == (2, 4)
    # 3 sequences, 5 tokens: bucket 4 sequences, one dummy token: 6 -> 8 tokens
    assert graphs.buckets(verify_batch([5, 6, 7], [[0], [1], [2]], [[-1, 0], [-1, 0], None])) == (
        4,
        8,
    )
    for s in range(1, 17):  # every shape within the bounds is covered, padding fits
        for t in range(s, 33 - (s > 1)):
            lens = [t - s + 1] + [1] * (s - 1)
            trees = [list(range(-1, n - 1)) if n > 1 else None for n in lens]
            batch = verify_batch([5] * s, [[i] for i in range(s)], trees)
            key = graphs.buckets(batch)
            if key is None:  # only when the dummies the buckets need push it past 32 tokens
                b = choose_bucket(s, graphs.seq_buckets)
                if b == s and t not in graphs.tok_buckets:  # a dummy must hold the padding
                    b = choose_bucket(s + 1, graphs.seq_buckets) or 10**6
                assert t + b - s > 32, f"{s} sequences, {t} tokens not covered"
                continue
            padded = pad_forward(batch, *key, [63])
            assert (len(padded.query_lens), len(padded.token_ids)) == key
    big = verify_batch([5], [[0, 1, 2]], [list(range(-1, 32))])  # 33 tokens
    assert graphs.buckets(big) is None
    assert graphs.buckets(verify_batch([99], [[0, 1, 2, 3, 4, 5, 6]], [[-1, 0]])) is None
    with_features = verify_batch([5], [[0]], [None])
    with_features.features = torch.zeros(1, ARGS.hidden_size)
    assert graphs.buckets(with_features) is None, "an EAGLE head's features are not captured"
    graphs.close()


def test_start_up_capture_covers_every_decode_iteration_within_the_budget(
    fake_fi,  # noqa: F811
    monkeypatch,
) -> None:
    """After `capture(start_keys(R, B))`, no iteration of up to R decode rows with tree nodes
    up to B tokens in all captures anything: every decode shape a server meets is held."""
    runner = cpu_stand_in_runner(fake_fi, monkeypatch)
    graphs = ForwardGraphRunner(runner, max_num_seqs=24, max_tokens=32, max_kv_len=100)
    keys = graphs.start_keys(max_num_seqs=6, budget=8)
    assert len(set(keys)) == len(keys)
    assert graphs.capture(keys) == len(keys) == graphs.num_graphs
    assert graphs.capture(keys) == 0, "held graphs are not captured again"
    for rows in range(1, 7):
        for extra in range(max(8 - rows, 0) + 1):  # tree nodes beyond the roots, B = 8 in all
            trees = [list(range(-1, extra)) if extra else None] + [None] * (rows - 1)
            batch = verify_batch([5] * rows, [[i] for i in range(rows)], trees)
            key = graphs.buckets(batch)
            assert key in keys, f"{rows} rows + {extra} tree tokens -> {key}, not captured"
    # no more than those: 6 rows pad to 8 sequences at most, 8 tokens to 16 at most
    assert max(s for s, _ in keys) == 8 and max(t for _, t in keys) <= 16
    assert graphs.start_keys(max_num_seqs=6, budget=0) == [(1, 1), (2, 2), (4, 4), (8, 8)]
    graphs.close()
    assert runner.cache.allocator.num_used == 0


@pytest.mark.parametrize("at_start", [False, True])
def test_forward_graph_wiring_on_cpu(fake_fi, monkeypatch, at_start: bool) -> None:  # noqa: F811
    """Padding, static buffers, plan-before-replay and slicing, with graphs replaced by reruns."""
    runner = cpu_stand_in_runner(fake_fi, monkeypatch)
    check_forward_replay_equals_eager(runner, tol=1e-5, at_start=at_start)


def check_forward_replay_equals_eager(
    runner: ModelRunner, tol: float, at_start: bool = False
) -> None:
    """at_start: capture the decode shapes of 4 requests and B = 16 first, as a server starts;
    the forwards below then replay those graphs and capture none."""
    graphs = ForwardGraphRunner(runner, max_num_seqs=8, max_tokens=32, max_kv_len=128)
    held = graphs.capture(graphs.start_keys(4, 16)) if at_start else 0
    cache, dev = runner.cache, runner.device
    ctxs = [5, 20, 33, 40]
    tables = prefill(runner, ctxs)
    shapes = [  # (trees, logits): verification trees beside a decode row, then fewer requests
        ([[-1, 0, 0, 1], None, [-1, 0, 1, 2, 0], [-1]], "all"),
        ([[-1, 0, 0, 1, 1], [-1, 0], [-1, 0, 1, 2], [-1]], "last"),
        ([None, [-1, -1, 0]], "all"),
    ]
    for step, (trees, logits) in enumerate(shapes):
        n = len(trees)
        batch = verify_batch(ctxs[:n], tables[:n], trees, logits)
        assert graphs.covers(batch)
        runner.graphs = None
        eager = runner.forward(batch)
        kv = batch.kv_lens
        slots = torch.cat(
            [cache.slots(tables[i], kv[i] - batch.query_lens[i], kv[i]) for i in range(n)]
        ).to(dev)
        k_eager = cache.k[:, slots].clone()
        cache.k[:, slots] = float("nan")  # the replay must write them again
        runner.graphs = graphs
        replay = runner.forward(batch)
        assert replay is not None and eager is not None and replay.shape == eager.shape
        assert_same_logits(replay, eager, f"shape {step}", tol)
        assert torch.allclose(cache.k[:, slots], k_eager, atol=10 * tol), f"shape {step}: K"
        assert graphs.buckets(batch) == [(8, 16), (8, 16), (2, 4)][step]
    if at_start:
        assert graphs.num_graphs == held, "a shape captured at start-up was captured again"
    else:
        assert graphs.num_graphs == 2, "one graph per (sequence, token) bucket, replayed after"
    # a forward past max_tokens runs eagerly, and right, beside the graphs
    long_tree = list(range(-1, 39))
    cache.reserve(tables[0], ctxs[0] + len(long_tree))
    batch = verify_batch([ctxs[0]], [tables[0]], [long_tree])
    assert not graphs.covers(batch)
    with_graphs = runner.forward(batch)
    runner.graphs = None
    assert_same_logits(with_graphs, runner.forward(batch), "eager beside graphs", tol)
    graphs.close()
    for t in tables:
        cache.release(t)
    assert cache.allocator.num_used == 0, "graph runner leaked its dummy KV blocks"


@cuda_only
@pytest.mark.cuda
@pytest.mark.parametrize("at_start", [False, True])
def test_forward_replay_equals_eager_on_flashinfer(at_start: bool) -> None:
    check_forward_replay_equals_eager(flashinfer_runner(), tol=1e-2, at_start=at_start)
