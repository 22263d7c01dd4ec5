"""Continuous batching: requests that arrive over time give exactly what they give alone."""

from __future__ import annotations

import random

from adaserve import LLMEngine, SamplingParams
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig


def make_engine(path, num_blocks: int, max_num_seqs: int = 16) -> LLMEngine:
    return LLMEngine(
        ModelConfig(model=str(path)),
        CacheConfig(block_size=4, num_blocks=num_blocks),
        SchedulerConfig(policy="incremental", max_num_seqs=max_num_seqs, max_num_batched_tokens=64),
    )


def random_requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams, int]]:
    """(prompt ids, params, arrival step) with random lengths; a third sample with a seed."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [rng.randrange(2, 96) for _ in range(rng.randint(1, 40))]
        sampled = i % 3 == 0
        params = SamplingParams(
            max_tokens=rng.randint(1, 24),
            ignore_eos=True,
            temperature=0.8 if sampled else 0.0,
            seed=i if sampled else None,
        )
        reqs.append((prompt, params, rng.randint(0, 150)))
    return reqs


def run_over_time(engine: LLMEngine, reqs) -> dict[str, list[int]]:
    pending = sorted(range(len(reqs)), key=lambda i: reqs[i][2])
    done: dict[str, list[int]] = {}
    step = 0
    while pending or engine.has_unfinished():
        while pending and reqs[pending[0]][2] <= step:
            i = pending.pop(0)
            engine.add_request(reqs[i][0], reqs[i][1], request_id=str(i))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    return done


def test_200_requests_over_time_equal_each_request_alone(tiny_llama):
    reqs = random_requests(200, seed=0)
    # 40 blocks of 4 tokens cannot hold 16 long requests at once: preemption must happen too.
    batched_engine = make_engine(tiny_llama, num_blocks=40)
    batched = run_over_time(batched_engine, reqs)
    assert batched_engine.scheduler.num_preemptions > 0, "test meant to exercise preemption did not"
    alone_engine = make_engine(tiny_llama, num_blocks=40, max_num_seqs=1)
    for i, (prompt, params, _) in enumerate(reqs):
        alone_engine.add_request(prompt, params, request_id=str(i))
        alone = None
        while alone_engine.has_unfinished():
            for out in alone_engine.step():
                if out.finished:
                    alone = out.outputs[0].token_ids
        assert batched[str(i)] == alone, f"request {i} batched {batched[str(i)]} != alone {alone}"
        assert len(alone) == params.max_tokens, f"request {i} stopped early with ignore_eos"
    for eng in (batched_engine, alone_engine):
        alloc = eng.engine.target.cache.allocator
        assert alloc.num_free == alloc.num_blocks, f"{alloc.num_used} KV blocks leaked"
