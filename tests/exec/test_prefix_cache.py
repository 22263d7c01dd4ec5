"""Automatic prefix caching: shared prefixes are computed once, outputs do not change, block
reference counts and eviction stay consistent under any mix of requests."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from adaserve import LLMEngine, SamplingParams
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from adaserve.exec.kv_cache import KVCache
from adaserve.exec.prefix_cache import PrefixCache


def make_engine(target, prefix: bool, policy: str = "incremental", blocks: int = 256):
    return LLMEngine(
        ModelConfig(model=str(target)),
        CacheConfig(block_size=4, num_blocks=blocks, enable_prefix_caching=prefix),
        SchedulerConfig(policy=policy),
    )


def run(e: LLMEngine, prompts, max_tokens: int = 12) -> tuple[list[list[int]], int]:
    """Greedy outputs, and prompt tokens the target computed."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    computed = 0
    outs = []
    for p in prompts:  # one after another: the second can reuse the first's blocks
        rid = e.add_request(p, params).request_id
        while e.has_unfinished():
            for out in e.step():
                if out.finished and out.request_id == rid:
                    outs.append(out.outputs[0].token_ids)
            computed += e.last_stats.prefill_tokens if e.last_stats else 0
    return outs, computed


def test_a_shared_prefix_is_computed_once_and_outputs_do_not_change(tiny_llama):
    system = [(5 * j) % 90 + 2 for j in range(64)]  # a 64-token "system prompt"
    prompts = [system + [7, 8, 9], system + [10, 11], system + [7, 8, 9]]
    ref, computed_without = run(make_engine(tiny_llama, prefix=False), prompts)
    e = make_engine(tiny_llama, prefix=True)
    got, computed_with = run(e, prompts)
    assert got == ref, "prefix caching changed the output"
    assert computed_without == 67 + 66 + 67
    # The 2nd and 3rd prompts reuse the 64 cached tokens (16 full blocks); the 3rd's tail
    # (3 tokens) lies in a partial block, and at least one token is always computed.
    assert computed_with == 67 + 2 + 3, f"computed {computed_with} prompt tokens"
    pc = e.engine.target_prefix
    assert pc.hit_tokens == 128 and pc.queried_tokens == 66 + 65 + 66
    assert e.engine.target.cache.allocator.num_used == 0, "blocks still held after finishing"


def test_a_peek_at_the_cache_finds_what_a_match_would_and_holds_nothing():
    """Admission asks how much of a prompt is cached before it is queued: the same count a
    match takes at admission, with no block held and no hit counted."""
    cache = KVCache(1, 8, 4, 1, 2, dtype=__import__("torch").float32, device="cpu")
    pc = PrefixCache(cache)
    tokens = list(range(2, 14))  # three full blocks
    table: list[int] = []
    cache.reserve(table, len(tokens))
    pc.register(table, tokens, len(tokens), [])
    cache.release(table)
    assert pc.cached_tokens(tokens + [99], 12) == 12
    assert pc.cached_tokens(tokens, len(tokens) - 1) == 8, "at least one token is computed"
    assert pc.cached_tokens(tokens[:5] + [0] + tokens[6:], 12) == 4, "a changed token cuts it"
    assert cache.allocator.num_used == 0 and pc.queried_tokens == pc.hit_tokens == 0
    assert len(pc.match(tokens + [99], 12, [])) * 4 == pc.cached_tokens(tokens + [99], 12)


def test_speculation_never_pollutes_the_cache(tiny_llama):
    """Only committed tokens are registered: a later request sees exactly the same output."""
    prompts = [[(3 * j) % 90 + 2 for j in range(40)]] * 3
    ref, _ = run(make_engine(tiny_llama, prefix=False), prompts, 40)
    for policy in ("adaserve_paper", "specinfer"):
        got, _ = run(make_engine(tiny_llama, prefix=True, policy=policy), prompts, 40)
        assert got == ref, f"{policy}: output differs with the prefix cache"


def test_aborts_and_preemption_leak_no_blocks(tiny_llama):
    rng = random.Random(3)
    e = make_engine(tiny_llama, prefix=True, policy="adaserve_paper", blocks=60)
    base = [(7 * j) % 90 + 2 for j in range(32)]
    for _ in range(120):
        prompt = base[: rng.randint(4, 32)] + [
            rng.randrange(2, 90) for _ in range(rng.randint(1, 8))
        ]
        e.add_request(prompt, SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True))
        for _ in range(rng.randint(0, 3)):
            e.step()
        if rng.random() < 0.2 and e.scheduler.running:
            e.abort(rng.choice(e.scheduler.running).request_id)
    while e.has_unfinished():
        e.step()
    alloc = e.engine.target.cache.allocator
    assert alloc.num_used == 0, f"{alloc.num_used} blocks held after every request ended"
    assert alloc.num_free == alloc.num_blocks
    assert e.engine.target_prefix.hit_tokens > 0, "the mix never hit the cache"


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_reference_counts_and_eviction_under_random_request_mixes(data):
    """Model check: every block is free, evictable or held, with the right holder count."""
    cache = KVCache(1, 12, 2, 1, 2, dtype=__import__("torch").float32, device="cpu")
    pc = PrefixCache(cache)
    alloc = cache.allocator
    seqs: list[tuple[list[int], list[int], list[int]]] = []  # (tokens, table, hashes)
    for _ in range(data.draw(st.integers(1, 40))):
        op = data.draw(st.sampled_from(["add", "grow", "release"]))
        if op == "add":
            tokens = data.draw(st.lists(st.integers(0, 2), min_size=1, max_size=8))
            hashes: list[int] = []
            table = pc.match(tokens, len(tokens) - 1, hashes)
            if cache.blocks_needed(table, len(tokens)) > alloc.num_free:
                cache.release(table)
                continue
            cache.reserve(table, len(tokens))
            pc.register(table, tokens, len(tokens), hashes)
            seqs.append((tokens, table, hashes))
        elif op == "grow" and seqs:
            tokens, table, hashes = seqs[data.draw(st.integers(0, len(seqs) - 1))]
            if cache.blocks_needed(table, len(tokens) + 1) <= alloc.num_free:
                tokens.append(data.draw(st.integers(0, 2)))
                cache.reserve(table, len(tokens))
                pc.register(table, tokens, len(tokens), hashes)
        elif op == "release" and seqs:
            _, table, _ = seqs.pop(data.draw(st.integers(0, len(seqs) - 1)))
            cache.release(table)
        holders = {}
        for _, table, _ in seqs:
            for b in table:
                holders[b] = holders.get(b, 0) + 1
        for b in range(alloc.num_blocks):
            assert alloc.ref_count(b) == holders.get(b, 0), f"block {b}: wrong reference count"
        assert alloc.num_used == len(holders), "used blocks != blocks some sequence holds"
        # A block two sequences share is a cached block holding the same tokens in both.
        seen: dict[int, tuple[int, ...]] = {}
        for tokens, table, _ in seqs:
            for i, b in enumerate(table):
                content = tuple(tokens[2 * i : 2 * i + 2])
                if b in seen:
                    assert b in alloc.cached, f"block {b} shared but not a cached block"
                    assert seen[b] == content, f"block {b} shared by different tokens"
                seen[b] = content
    for _, table, _ in seqs:
        cache.release(table)
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_blocks


def test_prefix_caching_is_on_by_default_and_can_be_turned_off(tiny_llama):
    assert make_engine(tiny_llama, prefix=True).engine.target_prefix is not None
    assert make_engine(tiny_llama, prefix=False).engine.target_prefix is None
