"""Prefix caching on the ggml backend: cached prompt cells shared between llama.cpp sequence
ids, kept under an id of their own after their request ends, evicted when cells are needed."""

from __future__ import annotations

import os

import pytest
import torch

from adaserve.exec.ggml import ggml_available

if not ggml_available():
    if os.environ.get("ADASERVE_REQUIRE_GGML"):  # CI: a skip here would hide a broken install
        raise ImportError("ADASERVE_REQUIRE_GGML is set and llama-cpp-python is not installed")
    pytest.skip("the ggml backend needs the `cpu` extra", allow_module_level=True)

from adaserve import LLMEngine, SamplingParams  # noqa: E402
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig  # noqa: E402
from adaserve.exec.batch import SequenceBatchBuilder  # noqa: E402
from adaserve.exec.default_model import default_gguf_file, default_model_dir  # noqa: E402
from adaserve.exec.ggml import GgmlRunner  # noqa: E402
from adaserve.exec.ggml_cache import GgmlKVCache  # noqa: E402
from adaserve.exec.prefix_cache import PrefixCache  # noqa: E402

pytestmark = pytest.mark.slow

BS = 16
PREFIX = [1] + [(7 * i + 300) % 4000 + 30 for i in range(47)]  # 48 tokens: three full blocks
SUFFIX = [504, 3458, 282, 4649, 314, 253, 2115, 30]


@pytest.fixture
def runner():
    r = GgmlRunner(default_gguf_file(), default_model_dir(), 1024, BS, 512, max_kept_cells=1024)
    yield r
    r.close()


def forward(runner: GgmlRunner, table: list[int], tokens: list[int], start: int) -> torch.Tensor:
    """Feed `tokens` at positions start.. as one causal chunk; the last row's logits."""
    runner.cache.reserve(table, start + len(tokens))
    b = SequenceBatchBuilder()
    b.add(
        tokens, list(range(start, start + len(tokens))), start + len(tokens), table, logits="last"
    )
    logits = runner.forward(b.batch)
    assert logits is not None
    return logits[0]


def held_ids(runner: GgmlRunner) -> list[int]:
    return [s for s in range(runner.llama.max_seqs) if runner.llama.seq_pos_max(s) >= 0]


def check_cells(cache: GgmlKVCache) -> None:
    """Every keeper holds exactly the positions of the blocks it keeps, each of them cached
    and free for the allocator to take back."""
    llama = cache.llama
    for seq, blocks in cache._keepers.items():
        assert blocks, f"keeper {seq} keeps no block"
        assert llama.seq_pos_min(seq) == 0
        assert llama.seq_pos_max(seq) == len(blocks) * cache.block_size - 1, f"keeper {seq}"
        for b in blocks:
            assert b in cache.allocator.cached and seq in cache._holders[b]


def test_a_shared_prefix_gives_the_kv_and_logits_of_computing_it_again(runner):
    """A request whose first 48 tokens another request computed gets those cells (no copy)
    and computes only the rest: its logits and its KV, as llama.cpp serializes it, are bit
    for bit those of a request that computes the same prefix itself in the same cells."""
    cache, prefix = runner.cache, PrefixCache(runner.cache)
    # The reference: prefix then suffix as two chunks of one sequence.
    ref: list[int] = []
    forward(runner, ref, PREFIX, 0)
    want = forward(runner, ref, SUFFIX, len(PREFIX))
    cache.release(ref)  # (no prefix registered: nothing kept)
    assert held_ids(runner) == [] and cache.num_keepers == 0

    first: list[int] = []
    hashes: list[int] = []
    forward(runner, first, PREFIX, 0)
    prefix.register(first, PREFIX, len(PREFIX), hashes)
    first_seq = cache.seq_of(first)
    cache.release(first)
    assert cache.num_keepers == 1 and held_ids(runner) == [first_seq]
    assert cache.allocator.num_used == 0 and cache.allocator.num_evictable == 3
    check_cells(cache)

    tokens = PREFIX + SUFFIX
    second: list[int] = []
    hashes = []
    second[:] = prefix.match(tokens, len(tokens) - 1, hashes)
    assert len(second) == 3 and prefix.hit_tokens == len(PREFIX)
    got = forward(runner, second, SUFFIX, len(PREFIX))
    seq = cache.seq_of(second)
    assert seq != first_seq
    # (Both suffixes sit after the same prefix cells: the freed reference's, in order.)
    assert torch.equal(got, want), "a prefix hit changed the logits"
    assert runner.llama.seq_pos_max(first_seq) == len(PREFIX) - 1  # the keeper holds on
    cache.release(second)
    check_cells(cache)


def test_the_allocator_taking_cached_blocks_back_drops_the_kept_cells(runner):
    """Cells kept for a prefix are the allocator's to take: allocating every block evicts
    them, the kept prefix leaves the prefix cache and no sequence id holds a cell."""
    cache, prefix = runner.cache, PrefixCache(runner.cache)
    for k in range(3):  # three released prompts, distinct from their first token on
        table: list[int] = []
        tokens = [1, 900 + k] + PREFIX[2:]
        forward(runner, table, tokens, 0)
        prefix.register(table, tokens, len(tokens), [])
        cache.release(table)
    assert cache.num_keepers == 3 and prefix.num_cached_blocks == 9
    check_cells(cache)
    hog: list[int] = []
    cache.reserve(hog, cache.num_blocks * BS)  # every block: each cached one is evicted
    assert cache.num_keepers == 0 and prefix.num_cached_blocks == 0
    # (The hog reserved blocks and computed nothing: no sequence may hold a cell now.)
    assert held_ids(runner) == [], f"sequence ids {held_ids(runner)} kept evicted cells"
    assert prefix.match(PREFIX, len(PREFIX), []) == []
    cache.release(hog)
    assert held_ids(runner) == [] and cache.num_free_ids == runner.llama.max_seqs


def test_evicting_a_middle_block_drops_the_rest_of_the_keepers_chain(runner):
    """A keeper's cells are a prefix: when the allocator takes one of its blocks, the later
    ones are dropped too (a match through them would miss the taken block's cells)."""
    cache, prefix = runner.cache, PrefixCache(runner.cache)
    table: list[int] = []
    forward(runner, table, PREFIX, 0)
    prefix.register(table, PREFIX, len(PREFIX), [])
    blocks = list(table)
    cache.release(table)
    middle = blocks[1]
    cache.allocator.evict(middle)  # what allocate does when it takes the block back
    assert [list(v) for v in cache._keepers.values()] == [blocks[:1]]
    check_cells(cache)
    assert blocks[2] not in cache.allocator.cached, "a block past the break stays findable"
    hashes: list[int] = []
    assert prefix.match(PREFIX, len(PREFIX), hashes) == blocks[:1]


def test_sequence_ids_held_by_kept_prefixes_are_taken_back_for_trees():
    """Kept prefixes hold sequence ids; requests and tree leaves take them back, least
    recently used first, and the prefixes they held leave the prefix cache."""
    runner = GgmlRunner(default_gguf_file(), default_model_dir(), 4352, BS, 512)
    cache, prefix = runner.cache, PrefixCache(runner.cache)
    cache.max_kept_blocks = cache.num_blocks  # (no cell budget here: ids run out first)
    n = runner.llama.max_seqs - 2
    for k in range(n):  # n kept one-block prompts: two ids left free
        table: list[int] = []
        tokens = [1, 30 + k] + PREFIX[2:BS]
        forward(runner, table, tokens, 0)
        prefix.register(table, tokens, BS, [])
        cache.release(table)
    assert cache.num_keepers == n and cache.num_free_ids == runner.llama.max_seqs
    live: list[int] = []
    forward(runner, live, PREFIX[:9], 0)
    parents = [-1, 0, 0, 0, 0]  # four leaves: three borrowed ids
    ids = cache.begin_tree(cache.seq_of(live), 9, parents)
    assert len({i[0] for i in ids[1:]}) == 4
    assert cache.num_keepers == n - 2, "the two oldest keepers gave their ids"
    first_two = [[1, 30 + k] + PREFIX[2:BS] for k in range(2)]
    for tokens in first_two:
        assert prefix.match(tokens, BS, []) == [], "an evicted keeper's prefix is still found"
    found = prefix.match([1, 32] + PREFIX[2:BS], BS, [])
    assert len(found) == 1, "the third oldest keeper's prefix is gone"
    cache.allocator.free(found)
    cache.keep_subset(live, 9, [0])
    cache.release(live)
    check_cells(cache)
    runner.close()


def test_an_engine_with_prefix_caching_answers_as_one_without():
    """Prompts that share a long head, one at a time (each finds the one before it cached)
    and then together, in a cache small enough that kept prefixes are evicted: greedy output
    is that of the engine without prefix caching, most prompt tokens come from the cache,
    and afterwards only kept prefixes hold cells."""
    head = (
        "You are a helpful assistant for a library. The library opens at nine and closes at "
        "eight on weekdays; members borrow up to twelve items for three weeks. "
    )
    prompts = [head + q for q in ("When does it open?", "How many items?", "For how long?")]
    prompts += [head + "Repeat: " + str(k) * 40 for k in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(prefix_caching: bool) -> tuple[list[list[int]], LLMEngine]:
        engine = LLMEngine(
            ModelConfig(backend="ggml", drafter="suffix"),
            CacheConfig(
                block_size=BS,
                num_blocks=20,
                enable_prefix_caching=prefix_caching,
                ggml_kept_prefix_cells=1024,
            ),
            SchedulerConfig(policy="adaserve", max_num_seqs=4, budget=8),
        )
        out = []
        for p in prompts[:3]:
            req = engine.add_request(p, params)
            while engine.has_unfinished():
                engine.step()
            out.append(list(req.output_token_ids))
        reqs = [engine.add_request(p, params) for p in prompts[3:]]
        while engine.has_unfinished():
            engine.step()
        out += [list(r.output_token_ids) for r in reqs]
        return out, engine

    want, _ = run(False)
    got, engine = run(True)
    prefix = engine.engine.target_prefix
    cache = engine.engine.target.cache
    assert prefix is not None and isinstance(cache, GgmlKVCache)
    assert prefix.hit_tokens >= 5 * 32, f"only {prefix.hit_tokens} prompt tokens were hits"
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"prompt {i}: prefix caching changed the greedy output"
    assert cache.allocator.num_used == 0
    assert set(held_ids(engine.engine.target)) == set(cache._keepers)
    check_cells(cache)


def test_kept_prefixes_stay_within_their_cell_budget_heads_first(runner):
    """Every forward pays for every cell in use, so released prefixes keep at most
    `max_kept_cells`: a long prompt keeps its head, and older prompts go first."""
    cache, prefix = runner.cache, PrefixCache(runner.cache)
    cache.max_kept_blocks = 4  # 64 cells
    long = [1] + [(11 * i + 77) % 4000 + 30 for i in range(95)]  # six blocks
    table: list[int] = []
    forward(runner, table, long, 0)
    prefix.register(table, long, len(long), [])
    cache.release(table)
    assert [len(b) for b in cache._keepers.values()] == [4], "the head, four blocks, is kept"
    check_cells(cache)
    assert prefix.cached_tokens(long, len(long)) == 64
    for k in range(2):  # two one-block prompts: the long one is trimmed away, oldest first
        table = []
        tokens = [1, 500 + k] + PREFIX[2:BS]
        forward(runner, table, tokens, 0)
        prefix.register(table, tokens, BS, [])
        cache.release(table)
    assert sum(len(b) for b in cache._keepers.values()) <= 4
    assert prefix.cached_tokens(long, len(long)) == 0, "the least recent prompt is dropped"
    assert prefix.cached_tokens([1, 501] + PREFIX[2:BS] + [5], BS) == BS
    check_cells(cache)


def test_by_default_an_ended_request_keeps_no_cells_and_a_running_one_shares_its_prefix():
    """The default keeps nothing once a request ends (kept cells cost every forward), and a
    prefix is still shared while the request that computed it runs."""
    runner = GgmlRunner(default_gguf_file(), default_model_dir(), 1024, BS, 512)
    cache, prefix = runner.cache, PrefixCache(runner.cache)
    first: list[int] = []
    forward(runner, first, PREFIX, 0)
    prefix.register(first, PREFIX, len(PREFIX), [])
    tokens = PREFIX + SUFFIX
    second = prefix.match(tokens, len(tokens) - 1, [])
    assert len(second) == 3, "a running request's prefix is found"
    forward(runner, second, SUFFIX, len(PREFIX))
    cache.release(first)
    assert cache.num_keepers == 0
    assert prefix.cached_tokens(tokens, len(tokens)) == len(PREFIX), "held by the second"
    cache.release(second)
    assert cache.num_keepers == 0 and held_ids(runner) == []
    assert prefix.cached_tokens(tokens, len(tokens)) == 0, "no cells, nothing to find"
    runner.close()
