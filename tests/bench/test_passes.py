"""The benchmarks' default scenario: every pass on a fresh engine that has seen none of the
measured prompts or their answers; `repeated` keeps one engine (and what it learned)."""

from __future__ import annotations

import pytest

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.passes import EnginePool
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig

PROMPT = [5, 9, 13, 17, 21, 25, 29, 33]


def _serve(engine: LLMEngine) -> None:
    engine.add_request(PROMPT, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()


def _cached_docs(engine: LLMEngine) -> int:
    """Finished outputs the suffix drafter's global index holds (warm-up included)."""
    return engine.scheduler.drafter.global_cache.num_docs


@pytest.fixture
def factories(tiny_llama):
    def build() -> LLMEngine:
        return LLMEngine(
            ModelConfig(model=str(tiny_llama), drafter="suffix"),
            CacheConfig(block_size=4, num_blocks=256),
            SchedulerConfig(policy="adaserve", budget=8),
        )

    return {"adaserve:suffix": build}


def test_new_scenario_builds_a_fresh_engine_per_pass(factories) -> None:
    pool = EnginePool("new", factories)
    first = pool.engine("adaserve:suffix")
    assert _cached_docs(first) == 1, "a fresh engine holds only its warm-up answer"
    _serve(first)
    assert _cached_docs(first) == 2
    second = pool.engine("adaserve:suffix")
    assert second is not first and pool.built["adaserve:suffix"] == 2
    assert _cached_docs(second) == 1, "the second pass saw the first pass's answer"


def test_repeated_scenario_keeps_the_engine_and_what_it_learned(factories) -> None:
    pool = EnginePool("repeated", factories)
    first = pool.engine("adaserve:suffix")
    _serve(first)
    again = pool.engine("adaserve:suffix")
    assert again is first and pool.built["adaserve:suffix"] == 1
    assert _cached_docs(again) == 2, "repeated traffic meets the earlier answers"
    with pytest.raises(ValueError, match="scenario"):
        EnginePool("warm", factories)
