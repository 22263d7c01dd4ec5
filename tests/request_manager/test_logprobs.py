"""Logprobs of emitted tokens: the target's raw log-softmax at each token's position, the same
with or without speculation, and equal to transformers' on the same text."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from adaserve import SamplingParams
from tests.request_manager.test_speculative import PROMPTS, make_engine

TOP = 3


def generate(engine, prompts, params) -> list:
    """Finished CompletionOutputs, in prompt order."""
    ids = [engine.add_request(p, params).request_id for p in prompts]
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
    return [done[i] for i in ids]


GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=TOP)


@pytest.fixture(scope="module")
def reference(pair) -> list:
    return generate(make_engine(pair["target"], None, "incremental"), PROMPTS, GREEDY)


@pytest.mark.parametrize("policy,draft_kind", [("sequence", "copy"), ("specinfer", "random")])
def test_logprobs_under_speculation_equal_plain_decodings(pair, reference, policy, draft_kind):
    engine = make_engine(pair["target"], pair[draft_kind], policy)
    got = generate(engine, PROMPTS, GREEDY)
    assert engine.last_stats is not None
    for i, (g, r) in enumerate(zip(got, reference)):
        assert g.token_ids == r.token_ids, f"prompt {i}: tokens differ"
        assert len(g.logprobs) == len(g.token_ids), "one logprob entry per token"
        glp = torch.tensor([e.logprob for e in g.logprobs])
        rlp = torch.tensor([e.logprob for e in r.logprobs])
        assert torch.allclose(glp, rlp, atol=1e-4), f"{policy} prompt {i}: logprobs differ"
        assert [[t[0] for t in e.top] for e in g.logprobs] == [
            [t[0] for t in e.top] for e in r.logprobs
        ], f"{policy} prompt {i}: top alternatives differ"


def test_logprobs_equal_transformers_log_softmax(pair, reference) -> None:
    hf = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float32).eval()
    for prompt, out in zip(PROMPTS, reference):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out.token_ids])).logits[0]
        want = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)  # [T, V]: row i -> token i
        got = torch.tensor([e.logprob for e in out.logprobs])
        chosen = want.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
        assert torch.allclose(got, chosen, atol=1e-4), "logprobs differ from transformers'"
        top = want.topk(TOP, -1)
        got_top = torch.tensor([[t[2] for t in e.top] for e in out.logprobs])
        assert torch.allclose(got_top, top.values, atol=1e-4), "top logprobs differ"
        assert out.logprobs[0].top[0][0] == out.token_ids[0], "greedy picks the top token"


def test_sampled_tokens_get_their_own_logprob(pair) -> None:
    """Sampling: the entry is the emitted token's, not the top one's."""
    params = SamplingParams(max_tokens=30, temperature=1.5, seed=1, ignore_eos=True, logprobs=1)
    (out,) = generate(make_engine(pair["target"], pair["copy"], "sequence"), [[5, 6]], params)
    assert [e.token_id for e in out.logprobs] == out.token_ids
    assert any(e.top[0][0] != e.token_id for e in out.logprobs), "never left the argmax"
    assert all(e.logprob <= e.top[0][2] + 1e-6 for e in out.logprobs)
