"""LLM.generate with n samples per prompt: each a request of its own, seeded seed + j."""

from __future__ import annotations

import pytest

from adaserve import LLM, SamplingParams


def test_n_samples_are_indexed_and_seeded_seed_plus_j(tiny_llama) -> None:
    llm = LLM(str(tiny_llama))
    params = SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    (out,) = llm.generate("t5 t6", params)
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for j, o in enumerate(out.outputs):
        (alone,) = llm.generate("t5 t6", params.for_choice(j))
        assert o.token_ids == alone.outputs[0].token_ids, f"sample {j} is not seed {5 + j}'s"
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1, "three samples all equal"


def test_the_engine_itself_takes_one_sample_per_request(tiny_llama) -> None:
    with pytest.raises(ValueError, match="n = 2"):
        LLM(str(tiny_llama)).llm_engine.add_request("t5", SamplingParams(n=2))
