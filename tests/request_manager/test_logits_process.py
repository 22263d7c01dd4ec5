"""Penalties, min_p and min_tokens: each tree node is processed with its own path's context, so
speculation keeps greedy output equal to plain decoding's, and plain decoding equals
transformers' generate() with the same penalty."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaserve import SamplingParams
from adaserve.request_manager.logits_process import path_tokens, process_tree_logits
from tests.conftest import make_tiny_checkpoint
from tests.request_manager.test_speculative import PROMPTS, assert_no_blocks_held, make_engine, run
from tests.stats import chi_square

# A tree over a vocabulary of 8: root 0; 1, 2 under it; 3 under 1; 4 under 3.
TOKENS = [3, 5, 1, 5, 2]
PARENTS = [-1, 0, 0, 1, 3]


def reference_row(
    row: torch.Tensor, prompt: list[int], output: list[int], p: SamplingParams, stop: set[int]
) -> torch.Tensor:
    """One node's processing written out token by token, from its full context."""
    out = row.clone()
    for t, bias in p.logit_bias:
        out[t] += bias
    for t in range(out.numel()):
        c = output.count(t)
        if p.repetition_penalty != 1.0 and (c or t in prompt):
            r = p.repetition_penalty
            out[t] = out[t] / r if out[t] > 0 else out[t] * r
        out[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
        if len(output) < p.min_tokens and t in stop:
            out[t] = -math.inf
    if p.min_p > 0:
        probs = torch.softmax(out / p.temperature, -1)
        out[probs < p.min_p * probs.max()] = -math.inf
    return out


def test_path_tokens_follow_parents() -> None:
    assert path_tokens(TOKENS, PARENTS) == [[], [5], [1], [5, 5], [5, 5, 2]]


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.7),
        SamplingParams(repetition_penalty=0.6, frequency_penalty=0.5, presence_penalty=-0.4),
        SamplingParams(min_tokens=4, max_tokens=8),
        SamplingParams(min_p=0.2, temperature=0.7, presence_penalty=1.0),
        SamplingParams(logit_bias={2: 5.0, 6: -3.0}, repetition_penalty=1.4),
    ],
)
def test_each_node_is_processed_with_its_own_paths_context(params: SamplingParams) -> None:
    torch.manual_seed(0)
    logits = torch.randn(len(TOKENS), 8) * 3
    prompt, output, stop = [6, 7, 3], [2, 3], {1, 2}
    got = process_tree_logits(logits, TOKENS, PARENTS, prompt, output, params, stop)
    for node, path in enumerate(path_tokens(TOKENS, PARENTS)):
        want = reference_row(logits[node], prompt, output + path, params, stop)
        assert torch.allclose(got[node], want), f"node {node} (path {path}) processed wrongly"


PROCESSED = [
    dict(repetition_penalty=1.5),
    dict(frequency_penalty=0.8, presence_penalty=0.5),
    dict(repetition_penalty=1.3, min_tokens=12, min_p=0.1),
    dict(logit_bias={9: 4.0, 5: -2.0}),
]


@pytest.mark.parametrize("extra", PROCESSED)
@pytest.mark.parametrize(
    "policy,draft_kind", [("sequence", "copy"), ("specinfer", "copy"), ("specinfer", "random")]
)
def test_greedy_with_processing_equals_incremental(pair, policy, draft_kind, extra) -> None:
    # EOS (t1) and a frequent token end generation; min_tokens must hold both back.
    params = [
        SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(7,), **extra)
        for _ in PROMPTS
    ]
    ref, _ = run(make_engine(pair["target"], None, "incremental"), PROMPTS, params)
    engine = make_engine(pair["target"], pair[draft_kind], policy)
    got, stats = run(engine, PROMPTS, params)
    assert got == ref, f"{policy}/{draft_kind} with {extra} differs from incremental greedy"
    if draft_kind == "copy":  # the raw target as draft: some of its tokens survive penalties
        assert sum(s.accepted_tokens for s in stats) > 0, "speculation was not exercised"
    assert all(len(g) >= extra.get("min_tokens", 0) for g in got), "min_tokens not respected"
    assert_no_blocks_held(engine)


@pytest.mark.parametrize("policy", ["incremental", "specinfer"])
def test_a_batch_mixing_raw_and_processed_greedy_requests_gives_each_its_own_output(
    pair, policy
) -> None:
    """Raw greedy requests walk their trees on every logit row's argmax, read back once per
    iteration; a processed request in the same batch must still walk its processed logits:
    each request's output is the one it gets served alone."""
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    penalized = SamplingParams(
        max_tokens=20, temperature=0.0, ignore_eos=True, repetition_penalty=1.8
    )
    params = [plain, penalized, plain]
    draft = pair["copy"] if policy != "incremental" else None
    alone = [
        run(make_engine(pair["target"], draft, policy), [prompt], [sp])[0][0]
        for prompt, sp in zip(PROMPTS, params)
    ]
    together, _ = run(make_engine(pair["target"], draft, policy), PROMPTS[:3], params)
    assert together == alone
    assert (
        alone[1] != run(make_engine(pair["target"], draft, policy), [PROMPTS[1]], [plain])[0][0]
    ), "the penalty must change this request's output, or the test shows nothing"


def test_min_tokens_holds_back_eos_and_stop_ids(pair) -> None:
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    (first,), _ = run(make_engine(pair["target"], None, "incremental"), [[5, 6, 7]], [plain])
    stop = (first[0], first[1])  # the first two greedy tokens would end it at once
    held = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=stop, min_tokens=5)
    (out,), _ = run(make_engine(pair["target"], pair["copy"], "sequence"), [[5, 6, 7]], [held])
    assert len(out) >= 5 and not set(out[:5]) & set(stop), f"stopped early: {out}"


def test_repetition_penalty_equals_transformers_generate(pair) -> None:
    prompt, penalty, n = [5, 6, 7, 8, 5, 6], 1.8, 20
    params = SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True, repetition_penalty=penalty
    )
    (got,), _ = run(make_engine(pair["target"], pair["copy"], "sequence"), [prompt], [params])
    hf = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()
    with torch.no_grad():
        ids = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            repetition_penalty=penalty,
            pad_token_id=0,
        )
    assert got == ids[0, len(prompt) :].tolist(), "repetition_penalty differs from transformers"


def test_sampling_with_penalties_under_speculation_has_the_processed_distribution(
    tmp_path,
) -> None:
    vocab, n, prompt = 6, 8000, [2, 3, 4]
    target = make_tiny_checkpoint(tmp_path / "t", vocab_size=vocab, seed=3)
    draft = make_tiny_checkpoint(tmp_path / "d", vocab_size=vocab, seed=4, num_layers=1)
    engine = make_engine(
        target, draft, "adaserve_paper", num_blocks=2048, max_num_seqs=256, budget=512
    )
    extra = dict(repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3, min_p=0.05)
    params = [
        SamplingParams(max_tokens=3, temperature=0.8, ignore_eos=True, seed=i, **extra)
        for i in range(n)
    ]
    outs, stats = run(engine, [prompt] * n, params)
    assert sum(s.accepted_tokens for s in stats) > n // 4, "speculation barely exercised"
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    p = params[0]

    def q(output: list[int]) -> torch.Tensor:
        with torch.no_grad():
            row = hf(torch.tensor([prompt + output])).logits[0, -1]
        return torch.softmax(reference_row(row, prompt, output, p, set()) / p.temperature, -1)

    probs = {}
    for a, pa in enumerate(q([]).tolist()):
        for b, pb in enumerate(q([a]).tolist() if pa > 0 else [0.0] * vocab):
            for c, pc in enumerate(q([a, b]).tolist() if pb > 0 else [0.0] * vocab):
                probs[(a, b, c)] = pa * pb * pc
    counts = Counter(tuple(o) for o in outs)
    impossible = [o for o in counts if probs[o] == 0]
    assert not impossible, f"sampled outputs min_p forbids: {impossible}"
    stat, critical, df = chi_square(counts, probs, n)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f} (df {df}, p = 0.001)"
    assert_no_blocks_held(engine)
