"""The ggml backend (llama.cpp via llama-cpp-python) on the default model's own GGUF file.

What is exact here, and what is not (docs/ggml.md): llama.cpp's logits of a token depend,
by float rounding that its 8-bit activation quantization then amplifies, on where the
sequence's KV sits in the shared cache. So these tests compare bitwise only where the cell
order is the same (a tree node against its path alone; a kept path against a fresh prefill),
and end to end they compare each policy with incremental decoding on one request at a time.
"""

from __future__ import annotations

import os
import platform

import pytest
import torch

from adaserve.exec.ggml import ggml_available

if not ggml_available():
    if os.environ.get("ADASERVE_REQUIRE_GGML"):  # CI: a skip here would hide a broken install
        raise ImportError("ADASERVE_REQUIRE_GGML is set and llama-cpp-python is not installed")
    pytest.skip("the ggml backend needs the `cpu` extra", allow_module_level=True)

from adaserve import LLM, LLMEngine, SamplingParams  # noqa: E402
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from adaserve.exec.batch import SequenceBatchBuilder  # noqa: E402
from adaserve.exec.default_model import default_gguf_file, default_model_dir  # noqa: E402
from adaserve.exec.ggml import GgmlRunner, amx_build  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = [1, 504, 3458, 282, 4649, 314, 253, 2115, 30]
# A tree of 9 nodes, 5 leaves, depth 4 (node 0 is the root: the last committed token).
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4, 7]
TOKENS = [28, 100, 200, 300, 400, 500, 600, 700, 800]


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(parents: list[int], node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


@pytest.fixture(scope="module")
def runner():
    r = GgmlRunner(default_gguf_file(), default_model_dir(), 2048, 16, 512)
    yield r
    r.close()


def prefill(runner: GgmlRunner, table: list[int], tokens: list[int], reserve: int) -> torch.Tensor:
    runner.cache.reserve(table, reserve)
    b = SequenceBatchBuilder()
    b.add(tokens, list(range(len(tokens))), len(tokens), table, logits="last")
    logits = runner.forward(b.batch)
    assert logits is not None
    return logits[0]


def verify_tree(runner: GgmlRunner, table: list[int]) -> torch.Tensor:
    n, start = len(TOKENS), len(PROMPT)
    runner.cache.reserve(table, start + n)
    b = SequenceBatchBuilder()
    b.add(
        TOKENS,
        [start + d for d in depths(PARENTS)],
        start + n,
        table,
        tree=PARENTS,
    )
    logits = runner.forward(b.batch)
    assert logits is not None
    return logits


def test_llama_cpps_amx_kernels_never_run(runner):
    """On some AMX-capable VMs (this project's 2-core KVM machines among them) llama.cpp's AMX
    kernels kill the process with SIGILL: the Makefile builds llama.cpp without them on x86-64,
    and a library built with them (a wheel from elsewhere) gets no extra buffer types, the
    only place those kernels run (docs/ggml.md)."""
    lc = runner.llama.lc
    info = lc.llama_print_system_info().decode()
    assert "AVX" in info or "NEON" in info, info  # the check reads llama.cpp's real feature list
    if amx_build(lc):
        assert not runner.llama.extra_buffers
    elif platform.machine() in ("x86_64", "AMD64"):
        assert runner.llama.extra_buffers, "a build without AMX keeps llama.cpp's repacking"


def test_every_tree_node_gets_the_logits_of_its_path_alone(runner):
    """Sequence ids per token express the tree: a node attends to its context and its
    ancestors only, never to a sibling that shares its position."""
    table: list[int] = []
    prefill(runner, table, PROMPT, len(PROMPT))
    tree_logits = verify_tree(runner, table)
    for node in range(len(PARENTS)):
        path = path_to(PARENTS, node)
        expect = prefill_logits_of(runner, PROMPT + [TOKENS[v] for v in path])
        assert torch.equal(tree_logits[node], expect), f"node {node} (path {path}) differs"
    runner.cache.release(table)
    assert runner.cache.num_free_ids == runner.llama.max_seqs


def test_trees_reach_llama_cpp_as_parents_never_as_masks(runner, monkeypatch):
    """The ggml runner turns a batch's parents into sequence ids itself: building the torch
    backend's masks (ForwardBatch.metadata) is never needed, and each kind of tree is told
    apart (a chunk or chain is causal, one root is a verification tree, scratch is a draft)."""
    from adaserve.exec.batch import ForwardBatch
    from adaserve.exec.ggml import tree_kind

    def no_masks(self):
        raise AssertionError("the ggml runner built attention masks")

    monkeypatch.setattr(ForwardBatch, "metadata", no_masks)
    table: list[int] = []
    prefill(runner, table, PROMPT, len(PROMPT))
    tree_logits = verify_tree(runner, table)
    assert tree_logits.shape[0] == len(PARENTS)
    runner.cache.release(table)
    assert tree_kind(None, 4) == "causal" and tree_kind([-1, 0, 1], 3) == "causal"
    assert tree_kind(PARENTS, len(PARENTS)) == "verify"
    assert tree_kind([-1, -1], 2) == "draft", "several roots: a draft step's frontier"
    assert tree_kind([-1, -1, 0, 1], 2) == "draft", "scratch slots before the queries"


def prefill_logits_of(runner: GgmlRunner, tokens: list[int]) -> torch.Tensor:
    table: list[int] = []
    try:
        return prefill(runner, table, tokens, len(tokens))
    finally:
        runner.cache.release(table)


@pytest.mark.parametrize("accept", [[0, 1, 4, 7, 8], [0, 3], [0, 2, 6], [0]])
def test_kv_after_accepting_a_path_equals_a_fresh_prefill(runner, accept):
    """Keep the root and an accepted path (on the request's own leaf, on a borrowed leaf, or
    none): the sequence's KV, as llama.cpp serializes it (positions, K and V of every cell),
    is byte for byte that of a fresh prefill of the accepted tokens; every borrowed
    sequence id is back and holds nothing."""
    table: list[int] = []
    prefill(runner, table, PROMPT, len(PROMPT))
    verify_tree(runner, table)
    start = len(PROMPT)
    runner.cache.keep_subset(table, start, accept)
    seq = runner.cache.seq_of(table)
    end = start + len(accept)
    assert (runner.llama.seq_pos_min(seq), runner.llama.seq_pos_max(seq)) == (0, end - 1)
    assert runner.cache.num_free_ids == runner.llama.max_seqs - 1
    held = [s for s in range(runner.llama.max_seqs) if runner.llama.seq_pos_max(s) >= 0]
    assert held == [seq]
    state = runner.llama.seq_state(seq)
    assert len(state) > end * 1000  # K and V of 30 layers per cell, not just positions
    runner.cache.release(table)
    assert runner.cache.num_free_ids == runner.llama.max_seqs
    assert runner.llama.seq_pos_max(seq) == -1
    fresh: list[int] = []
    prefill(runner, fresh, PROMPT + [TOKENS[v] for v in accept], end)
    # (The serialized state names the sequence id: the fresh one reuses the freed id.)
    assert runner.cache.seq_of(fresh) == seq
    assert runner.llama.seq_state(seq) == state
    runner.cache.release(fresh)


def test_greedy_decoding_equals_llama_cpp_generate(runner):
    """Our incremental forwards give llama-cpp-python's own greedy tokens (same file)."""
    import llama_cpp

    ref = llama_cpp.Llama(
        str(default_gguf_file()),
        n_ctx=256,
        n_threads=runner.llama.threads,
        n_threads_batch=runner.llama.threads,
        flash_attn=True,
        verbose=False,
    )
    want = []
    for tok in ref.generate(PROMPT, temp=0.0):
        want.append(tok)
        if len(want) == 24:
            break
    table: list[int] = []
    got = [int(prefill(runner, table, PROMPT, len(PROMPT) + 24).argmax())]
    n = len(PROMPT)
    while len(got) < 24:
        b = SequenceBatchBuilder()
        b.add([got[-1]], [n], n + 1, table)
        got.append(int(runner.forward(b.batch).argmax()))  # type: ignore[union-attr]
        n += 1
    runner.cache.release(table)
    assert got == want


def test_32_requests_with_preemption_and_aborts_leak_nothing():
    """Continuous batching on llama.cpp's shared cache: 32 requests in a cache too small for
    them (preemption), trees verified (the suffix drafter borrows sequence ids), some
    aborted mid-way. Afterwards every block, sequence id and cell is free."""
    engine = LLMEngine(
        ModelConfig(backend="ggml", drafter="suffix"),
        CacheConfig(block_size=16, num_blocks=24),  # 384 cells for 32 x (50..100) tokens
        SchedulerConfig(policy="adaserve", max_num_seqs=32, budget=16),
    )
    runner = engine.engine.target
    assert isinstance(runner, GgmlRunner)
    words = "the cat sat on the mat and the dog ran to the park".split()
    lengths = {}
    for i in range(32):
        prompt = " ".join(words[i % 5 :] * 3)  # repeats: the suffix index finds drafts
        params = SamplingParams(max_tokens=40 + i % 24, temperature=0.0, ignore_eos=True)
        engine.add_request(prompt, params, request_id=str(i))
        lengths[str(i)] = params.max_tokens
    finished, aborted, steps = {}, set(), 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
        if steps in (5, 12, 20):
            victim = next(r.request_id for r in engine.scheduler.running)
            engine.abort(victim)
            aborted.add(victim)
    assert engine.scheduler.num_preemptions > 0, "meant to exercise preemption; it did not"
    for rid, out in finished.items():
        if rid not in aborted:
            assert len(out.outputs[0].token_ids) == lengths[rid]
    assert len(finished) + len(aborted) >= 32
    cache = runner.cache
    assert cache.allocator.num_free == cache.num_blocks
    assert cache.num_free_ids == runner.llama.max_seqs
    # What still holds cells is the prefix cache's, and only until the allocator needs it.
    held = [s for s in range(runner.llama.max_seqs) if runner.llama.seq_pos_max(s) >= 0]
    assert held == sorted(cache._keepers), f"sequence ids {held} hold cells for nobody"
    hog: list[int] = []
    cache.reserve(hog, cache.num_blocks * cache.block_size)
    cache.release(hog)
    held = [s for s in range(runner.llama.max_seqs) if runner.llama.seq_pos_max(s) >= 0]
    assert held == [] and cache.num_keepers == 0, f"sequence ids {held} still hold cells"


def test_every_policy_gives_incremental_greedy_output():
    """Lossless on the same backend: each policy (and drafter) emits ggml incremental
    decoding's greedy tokens, one request at a time (see the module doc for why not batched).
    """
    prompts = [
        "Tell me about the history of Paris.",
        "Write a python function that sorts a list.",
        "Name three colors.",
    ]
    params = SamplingParams(max_tokens=40, temperature=0.0)

    def run(**kw) -> list[list[int]]:
        llm = LLM(backend="ggml", budget=16, **kw)
        assert llm.llm_engine.engine.backend == "ggml"
        ctl = llm.llm_engine.scheduler.controller
        if hasattr(ctl, "max_pad_tokens"):
            # llama.cpp runs every forward at its own size: control must price it there.
            assert ctl.max_pad_tokens == 0, "control prices padded forwards ggml never runs"
        return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]

    want = run(policy="incremental")
    for kw in (
        dict(policy="adaserve", drafter="suffix"),
        dict(policy="adaserve", drafter="suffix", budget_ceiling=48),
        dict(policy="adaserve", drafter="model"),
        dict(policy="adaserve_paper"),
        dict(policy="specinfer"),
        dict(policy="sequence"),
    ):
        assert run(**kw) == want, f"{kw} differs from incremental"


def test_hidden_states_are_the_final_normed_features(runner):
    """What an EAGLE head drafts from: llama.cpp's rows equal the torch model's final hidden
    states after the final norm (up to the 4-bit weights), not some other layer's."""
    from transformers import AutoModelForCausalLM

    runner.capture_hidden = True
    try:
        table: list[int] = []
        prefill(runner, table, PROMPT, len(PROMPT))
        runner.cache.release(table)
        got = runner.last_hidden
    finally:
        runner.capture_hidden = False
    assert got is not None and got.shape == (len(PROMPT), 576)
    hf = AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()
    with torch.no_grad():
        states = hf(torch.tensor([PROMPT]), output_hidden_states=True).hidden_states
    normed, last_layer = states[-1][0], states[-2][0]  # (transformers: the last is normed)
    cos = torch.nn.functional.cosine_similarity(got, normed, dim=-1)
    assert float(cos.min()) > 0.98, cos
    # ... and not a pre-norm state, which points elsewhere.
    assert float(torch.nn.functional.cosine_similarity(got, last_layer, dim=-1).min()) < 0.9


def test_an_eagle_head_drafts_beside_a_ggml_target():
    """The head runs on torch and reads llama.cpp's features: its drafts get accepted."""
    llm = LLM(backend="ggml", drafter="eagle", policy="adaserve_paper", budget=16)
    assert llm.llm_engine.engine.backend == "ggml"
    outs = llm.generate(
        ["Write a python function that sorts a list."],
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
    )
    m = outs[0].metrics
    assert len(outs[0].outputs[0].token_ids) == 40
    assert m.num_accepted_tokens >= 10, (m.num_accepted_tokens, m.num_iterations)


def test_the_default_draft_beside_a_ggml_target_is_the_torch_four_layer_draft():
    """No draft named: the default target's 4-layer draft on torch (not the target's own
    GGUF file, which a draft_model=None once resolved to)."""
    from adaserve.exec.torch_runner import ModelRunner

    llm = LLM(backend="ggml", policy="adaserve_paper", drafter="model")
    draft = llm.llm_engine.engine.draft
    assert isinstance(draft, ModelRunner) and draft.args.num_layers == 4


def test_a_gguf_draft_runs_on_ggml_too():
    """A GGUF draft beside a ggml target runs on llama.cpp as well: its beam-search steps
    feed each node under a sequence id made of its parent's cells. With the target's own
    file as the draft nearly every drafted token is accepted, the output is incremental's,
    and the draft's cache is empty afterwards."""
    prompts = ["Write a python function that sorts a list.", "Name three colors."]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [
        o.outputs[0].token_ids
        for p in prompts
        for o in LLM(backend="ggml", policy="incremental").generate([p], params)
    ]
    llm = LLM(
        backend="ggml",
        policy="sequence",
        drafter="model",
        draft_model=str(default_gguf_file()),
        budget=16,
    )
    draft = llm.llm_engine.engine.draft
    assert isinstance(draft, GgmlRunner)
    outs = [llm.generate([p], params)[0] for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    iterations = sum(o.metrics.num_iterations for o in outs)
    assert accepted >= 2 * iterations, (accepted, iterations)
    assert draft.cache.num_free_ids == draft.llama.max_seqs
    assert draft.cache.allocator.num_free == draft.cache.num_blocks


def test_backend_selection(tiny_llama):
    """auto: ggml for the default (GGUF) model when installed; torch for a checkpoint dir.
    Asking for ggml on a model without a GGUF file says what to do."""
    from adaserve.exec.engine import pick_backend

    assert pick_backend(ModelConfig(), default_model_dir())[0] == "ggml"
    assert pick_backend(ModelConfig(backend="torch"), default_model_dir())[0] == "torch"
    assert pick_backend(ModelConfig(model=str(tiny_llama)), tiny_llama)[0] == "torch"
    with pytest.raises(ValueError, match="pass the .gguf file"):
        pick_backend(ModelConfig(model=str(tiny_llama), backend="ggml"), tiny_llama)
    with pytest.raises(ValueError, match="runs on the CPU"):
        pick_backend(ModelConfig(backend="ggml", device="cuda"), default_model_dir())
    with pytest.raises(ValueError, match="backend must be one of"):
        ModelConfig(backend="llamacpp")


def test_per_sequence_streams_compute_what_the_unified_cache_does():
    """`LlamaCppContext(streams=N)`, which `adaserve.bench.ggml_kv` prices the unified cache
    against, runs the same model: two sequences decoded in one batch get the logits they get
    in the unified cache (same argmax, close values; float rounding depends on cell order)."""
    import numpy as np

    from adaserve.exec.ggml import LlamaCppContext

    other = [1, 504, 2115, 30, 282, 4649, 314]
    tokens = np.array(PROMPT + other, np.int32)
    positions = np.array(list(range(len(PROMPT))) + list(range(len(other))), np.int32)
    seqs = np.array([0] * len(PROMPT) + [1] * len(other), np.int32)
    want = np.zeros(len(tokens), bool)
    want[[len(PROMPT) - 1, len(tokens) - 1]] = True
    out = {}
    for streams in (None, 4):
        ctx = LlamaCppContext(default_gguf_file(), 4 * 256, 512, streams=streams)
        try:
            assert ctx.max_seqs == (streams or ctx.max_seqs)
            out[streams], _ = ctx.decode(tokens, positions, seqs, {}, want)
            # A stream holds n_ctx / streams = 256 cells; the unified cache lends any sequence
            # all 1,024.
            long = np.full(300, 504, np.int32)
            args = (long, np.arange(300, dtype=np.int32), np.full(300, 2, np.int32), {})
            if streams is None:
                ctx.decode(*args, np.arange(300) == 299)
            else:
                with pytest.raises(RuntimeError, match="no free KV cell"):
                    ctx.decode(*args, np.arange(300) == 299)
        finally:
            ctx.close()
    unified, streamed = out[None], out[4]
    assert unified.shape == streamed.shape == (2, unified.shape[1])
    assert (unified.argmax(1) == streamed.argmax(1)).all()
    assert np.abs(unified - streamed).max() < 0.5, np.abs(unified - streamed).max()


def test_a_forward_that_reaches_the_attention_tile_runs_each_prompt_chunk_apart():
    """`segments`: below the 64-token tile, or with one part only, one call; at the tile,
    each prompt chunk (given by (start, tokens)) alone and everything else together, in
    batch order."""
    from adaserve.exec.ggml import segments

    def calls(n, chunks):
        return [p.tolist() for p in segments(n, chunks, 64)]

    assert calls(40, [(8, 32)]) == [list(range(40))], "below the tile"
    assert calls(100, [(0, 100)]) == [list(range(100))], "a prompt chunk alone"
    assert calls(100, []) == [list(range(100))], "decode rows and trees only"
    assert calls(100, [(3, 80)]) == [[0, 1, 2, *range(83, 100)], list(range(3, 83))]
    assert calls(100, [(0, 50), (50, 50)]) == [list(range(50)), list(range(50, 100))]


def test_decode_rows_and_a_prompt_chunk_split_apart_give_the_one_call_logits(runner, monkeypatch):
    """Three requests decode a token each while a 70-token prompt is prefilled in the same
    forward: run as two llama.cpp calls (the rows, then the chunk) it gives the logits one
    call gives, in batch order (the chunk's exactly, the rows' within rounding), and writes
    the same KV."""
    prompts = [[1, 504, 3458, 282 + i, 4649, 314, 253] for i in range(3)]
    doc = [(17 * j) % 4000 + 2 for j in range(70)]
    results = {}
    for own_call in (runner.own_call_tokens, 10**9):  # split, then one call
        monkeypatch.setattr(runner, "own_call_tokens", own_call)
        tables: list[list[int]] = [[] for _ in prompts]
        for table, p in zip(tables, prompts):
            prefill(runner, table, p, len(p) + 1)
        doc_table: list[int] = []
        runner.cache.reserve(doc_table, len(doc))
        b = SequenceBatchBuilder()
        for table, p in zip(tables, prompts):
            b.add([28], [len(p)], len(p) + 1, table, logits="last")
        b.add(doc, list(range(len(doc))), len(doc), doc_table, logits="last")
        decodes: list[int] = []
        real = runner.llama.decode

        def counted(*a, decodes=decodes, real=real):
            decodes.append(len(a[0]))
            return real(*a)

        monkeypatch.setattr(runner.llama, "decode", counted)
        logits = runner.forward(b.batch)
        monkeypatch.setattr(runner.llama, "decode", real)
        assert logits is not None and logits.shape[0] == 4
        # The KV written: the next token of the document after the chunk.
        nxt = SequenceBatchBuilder()
        nxt.add([28], [len(doc)], len(doc) + 1, doc_table, logits="last")
        runner.cache.reserve(doc_table, len(doc) + 1)
        after = runner.forward(nxt.batch)
        results[own_call] = (decodes, logits, after)
        for table in [*tables, doc_table]:
            runner.cache.release(table)
    (split_calls, split, split_after), (one_calls, one, one_after) = results.values()
    assert split_calls == [3, 70] and one_calls == [73]
    # The chunk's own call computes it exactly as the shared one did, and writes the same KV.
    assert torch.equal(split[3], one[3]) and torch.equal(split_after, one_after)
    # Decode rows run as a 3-row matmul instead of a 73-row one: llama.cpp's 8-bit
    # activations round apart (measured: up to 0.59 on logits up to 28), as batching the
    # same rows differently does in any llama.cpp server. The greedy token stays wherever the
    # two best logits are further apart than that rounding; where they are closer (on a
    # 2026-12-03 AMD EPYC, row 2: 20.899 against 20.891 in one call), either may win.
    rounding = float((split[:3] - one[:3]).abs().max())
    assert rounding < 0.05 * float(one.abs().max())
    for row in range(3):
        top = one[row].topk(2)
        if float(top.values[0] - top.values[1]) > 2 * rounding:
            assert int(split[row].argmax()) == int(top.indices[0]), row
        else:
            assert int(split[row].argmax()) in top.indices.tolist(), row


def test_the_ceiling_leaves_every_running_request_a_sequence_id():
    """Each extra leaf of a verified tree borrows a llama.cpp sequence id beside the running
    requests' own: a ceiling past what is left is lowered to it, never an error mid-serve."""
    llm = LLM(backend="ggml", policy="adaserve", budget=4, budget_ceiling=200, max_num_seqs=250)
    ids = llm.llm_engine.engine.target.cache.num_free_ids
    cfg = llm.llm_engine.scheduler.cfg
    assert cfg.budget_ceiling == ids - 250 and cfg.selection_budget == ids - 250
    out = llm.generate(["Name three colors."], SamplingParams(max_tokens=8, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 8
