"""Chunked prefill: same outputs, long prompts never stall a stream past ~2x its SLO, TTFT SLOs
pull chunks forward; the chunk-sizing rule on its own."""

from __future__ import annotations

import pytest

from adaserve import LLMEngine, SamplingParams
from adaserve.config import POLICIES, CacheConfig, ModelConfig, SchedulerConfig
from adaserve.request_manager.prefill import (
    chunk_tokens,
    largest_chunk,
    prefill_order,
    tile_or_wait,
    tiled_chunk,
    ttft_chunk,
)
from adaserve.request_manager.request import Request
from tests.conftest import make_tiny_checkpoint
from tests.request_manager.test_speculative import run
from tests.virtual_time import slow_forwards


def engine(target, policy: str, chunked: bool, num_blocks: int = 512, **sched) -> LLMEngine:
    return LLMEngine(
        ModelConfig(model=str(target)),
        CacheConfig(block_size=4, num_blocks=num_blocks, enable_prefix_caching=False),
        SchedulerConfig(policy=policy, chunked_prefill=chunked, **sched),
    )


def generate(e: LLMEngine, prompts, params) -> list[list[int]]:
    return run(e, prompts, params)[0]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("chunk"), max_position_embeddings=2048)


@pytest.mark.parametrize("policy", POLICIES)
def test_chunked_prefill_gives_the_same_greedy_output(target, policy):
    # Prompts several chunks long (max_prefill_chunk 24, min 8), mixed with short ones.
    prompts = [[(7 * i + j) % 90 + 2 for j in range(n)] for i, n in enumerate([150, 3, 97, 40])]
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, slo_tpot_ms=s)
        for s in (50.0, None, 5.0, None)
    ]
    ref = generate(engine(target, "incremental", chunked=False), prompts, params)
    e = engine(target, policy, chunked=True, max_prefill_chunk=24, min_prefill_chunk=8)
    assert generate(e, prompts, params) == ref, f"{policy}: chunked prefill changed the output"
    assert e.engine.target.cache.allocator.num_used == 0, "KV blocks leaked"


def test_preemption_in_the_middle_of_a_prefill_recomputes_it(target):
    prompts = [[(3 * i + j) % 90 + 2 for j in range(n)] for i, n in enumerate([120, 110, 100])]
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)] * 3
    ref = generate(engine(target, "incremental", chunked=False), prompts, params)
    # 100 blocks of 4 cannot hold all three prompts and their outputs at once.
    e = engine(
        target,
        "incremental",
        chunked=True,
        num_blocks=100,
        max_prefill_chunk=16,
        min_prefill_chunk=16,
    )
    assert generate(e, prompts, params) == ref, "preempted prefills changed the output"
    assert e.scheduler.num_preemptions > 0, "the test did not preempt anything"
    assert e.engine.target.cache.allocator.num_used == 0


def test_the_cost_model_learns_prompt_tokens_as_silent(target):
    # The forward's tokens without logits (prompt chunks, but a prompt's last token) go to
    # the cost model as silent, so it learns their price apart from decode tokens.
    e = engine(target, "incremental", chunked=True, max_prefill_chunk=16, min_prefill_chunk=16)
    cost, seen = e.scheduler.cost, []
    observe = cost.observe

    def spy(
        tokens: int, context: int, seconds: float, silent: int = 0, pairs: int = 0, tree: int = 0
    ) -> bool:
        assert tree == 0, "incremental decoding verifies no tree"
        seen.append((tokens, silent, pairs))
        return observe(tokens, context, seconds, silent, pairs, tree)

    cost.observe = spy
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    e.add_request([(j % 90) + 2 for j in range(10)], params)
    steps = []
    while e.has_unfinished():
        if len(steps) == 3:
            e.add_request([(j % 80) + 3 for j in range(60)], params)
        e.step()
        steps.append(e.last_stats)
    assert len(seen) == len(steps)
    mixed = deep = 0
    for (tokens, silent, pairs), st in zip(seen, steps):
        decoded = st.num_tokens if st.kind == "decode" else 0
        assert tokens == st.padded_tokens
        padding = tokens - decoded - st.prefill_tokens
        last = st.prefill_requests if st.prefill_tokens else 0  # a finished prompt's last row
        assert st.prefill_tokens - last + padding <= silent <= st.prefill_tokens + padding
        mixed += st.kind == "decode" and st.prefill_tokens > 0
        # Each silent token attends its prompt so far: a chunk after the first does more.
        assert pairs >= silent * (silent + 1) // 2
        deep += silent > 0 and pairs > silent * (silent + 1) // 2
    assert mixed >= 2, "no decode iteration carried a prompt chunk: the test shows nothing"
    assert deep >= 2, "no chunk was priced deeper into its prompt"


def slowed(e: LLMEngine, per_token_s: float, fixed_s: float) -> LLMEngine:
    """A target whose forward costs fixed_s + per_token_s x tokens more (on the engine clock)."""
    return slow_forwards(e, lambda n: fixed_s + per_token_s * n)


@pytest.mark.parametrize("chunked", [True, False])
def test_long_prompts_arriving_do_not_stall_a_stream_past_twice_its_slo(target, chunked):
    e = slowed(engine(target, "incremental", chunked=chunked, num_blocks=2048), 0.0002, 0.02)
    stream = e.add_request(
        [5, 6, 7], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, slo_tpot_ms=300)
    )
    for _ in range(5):  # the stream is decoding
        e.step()
    for i in range(3):  # three ~1,500-token prompts arrive
        e.add_request(
            [(i + j) % 90 + 2 for j in range(1500)],
            SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
        )
    while e.has_unfinished():
        e.step()
    times = stream.metrics.token_times
    worst_gap = max(b - a for a, b in zip(times, times[1:]))
    if chunked:
        assert worst_gap < 0.6, f"a {1000 * worst_gap:.0f} ms gap for a 300 ms SLO"
    else:  # without chunking the whole 1,500-token prefill (>= 0.32 s each) stalls the stream
        assert worst_gap > 0.6, f"unchunked prefill should stall, worst gap {worst_gap:.2f} s"


def test_a_ttft_slo_pulls_its_prompt_forward(target):
    """With a tight TPOT stream running, a prompt with a TTFT SLO gets bigger chunks."""
    firsts, chunks = {}, {}
    for ttft in (None, 1500.0):
        e = slowed(engine(target, "incremental", chunked=True, num_blocks=2048), 0.001, 0.02)
        e.add_request(
            [5, 6, 7],
            SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, slo_tpot_ms=40),
        )
        e.step()
        e.step()
        r = e.add_request(
            [(j % 90) + 2 for j in range(1000)],
            SamplingParams(max_tokens=2, ignore_eos=True, slo_ttft_ms=ttft),
        )
        sizes = []
        while r.metrics.first_token_time is None:
            e.step()
            sizes.append(e.last_stats.prefill_tokens)
        firsts[ttft], chunks[ttft] = r.metrics.ttft_s, sum(sizes) / len(sizes)
    # Without a TTFT SLO the 40 ms stream allows ~17-57 tokens a chunk; the 1.5 s deadline
    # needs ~47 or more from the first chunk on.
    assert chunks[1500.0] > 1.2 * chunks[None], f"mean chunk sizes {chunks}"
    assert firsts[1500.0] < firsts[None], f"the TTFT SLO did not speed the prompt up: {firsts}"


# A 2-token decode part, no context, the default chunk bounds (chunk_tokens keyword args).
CHUNK_ARGS = dict(
    tree_tokens=2, context=0, max_prefill_chunk=256, max_batched_tokens=2048, min_prefill_chunk=16
)


def linear_cost(tokens: int, context: int, silent: int, silent_pairs: int) -> float:
    return 0.02 + 0.001 * tokens  # seconds


def test_largest_chunk_and_ttft_chunk_solve_their_inequalities():
    assert largest_chunk(linear_cost, 4, 0, 0.1, 500) == 76  # 0.02 + 0.001 * 80 = 0.1
    assert largest_chunk(linear_cost, 4, 0, 0.02, 500) == 0
    assert largest_chunk(linear_cost, 4, 0, 10.0, 64) == 64, "capped"
    # 1000 tokens in 2 s: ceil(1000 / c) * (0.024 + 0.001 c) <= 2 -> c = 25 (40 x 0.049 s)
    c = ttft_chunk(linear_cost, 4, 0, 1000, 2.0, 2048)
    assert c == 25, f"chunk {c} is not the smallest that meets the deadline"
    assert ttft_chunk(linear_cost, 4, 0, 1000, 0.01, 2048) is None, "a lost deadline"


def test_prompt_tokens_are_priced_as_silent_rows_attending_their_prompt():
    # Prompt-chunk tokens return no logits (cheaper than decode tokens), and each attends
    # its prompt so far (dearer the deeper into a long prompt the chunk starts).
    def prompt_cost(tokens: int, context: int, silent: int, silent_pairs: int) -> float:
        return linear_cost(tokens, context, 0, 0) - 0.0005 * silent + 1e-7 * silent_pairs

    assert largest_chunk(prompt_cost, 4, 0, 0.1, 500) == 149  # 0.024 + 0.0005 c + 5e-8 c^2 ~
    deep = largest_chunk(prompt_cost, 4, 0, 0.1, 500, cached=2000)
    assert deep == 107, "0.024 + 0.0007 c + 5e-8 c^2 <= 0.1"
    assert ttft_chunk(prompt_cost, 4, 0, 1000, 2.0, 2048) < ttft_chunk(
        linear_cost, 4, 0, 1000, 2.0, 2048
    )


def test_chunk_tokens_follows_the_tightest_slo_and_never_starves():
    now = 100.0
    ontime = Request("a", [1, 2], SamplingParams(slo_tpot_ms=100))
    ontime.append_token(3, now - 0.91)
    for t in range(10):  # 10 tokens after the first in 0.91 s: 0.09 s ahead of its SLO
        ontime.append_token(3, now - 0.9 + 0.09 * t)
    lost = Request("b", [1, 2], SamplingParams(slo_tpot_ms=1))  # a 1 ms SLO is lost anyway
    lost.append_token(3, now - 1.0)
    waiting = Request("c", list(range(2, 402)), SamplingParams())
    args = dict(CHUNK_ARGS, now=now)
    # ontime is paced at 95 ms (slo_pace_margin 5%): bank = 0.095 x 10 - 0.91 = 0.04 s ahead,
    # allow = 0.095 x 1 + 0.04 = 0.135 s -> 0.02 + 0.001 (2 + c) <= 0.135 -> c = 113
    n = chunk_tokens(linear_cost, [ontime, lost], [1.0, 1.0], [waiting], **args)
    assert n == 113, f"chunk {n} does not follow the 100 ms stream's slack"
    tight = Request("d", [1, 2], SamplingParams(slo_tpot_ms=30))
    tight.append_token(3, now - 0.3)
    for t in range(10):
        tight.append_token(3, now - 0.3 + 0.03 * t)
    assert chunk_tokens(linear_cost, [tight], [1.0], [waiting], **args) == 16, "minimum chunk"
    assert chunk_tokens(linear_cost, [], [], [waiting], **args) == 400, "idle: whole prompt"
    # Capped at 0.2 s, idle or not: 0.02 + 0.001 (2 + c) <= 0.2 -> c = 178 idle; with the 100 ms
    # stream, the cap is above its allowance (113 stays).
    capped = dict(args, iteration_cap_s=0.2)
    assert chunk_tokens(linear_cost, [], [], [waiting], **capped) == 178, "idle, capped"
    assert chunk_tokens(linear_cost, [ontime, lost], [1.0, 1.0], [waiting], **capped) == 113
    assert chunk_tokens(linear_cost, [tight], [1.0], [waiting], **capped) == 16, "never starves"


def below_tile_cost(tokens: int, context: int, silent: int, silent_pairs: int) -> float:
    """A cost model fitted on llama.cpp forwards below the 64-token attention tile, where each
    query row runs alone: deep in a prompt it prices a 64-token chunk as dear as those."""
    return 0.02 + 0.003 * tokens + 1e-5 * silent_pairs


def test_an_idle_chunk_deep_in_a_prompt_takes_a_whole_attention_tile():
    # 600 tokens into a prompt, a 0.5 s cap fits 51 tokens (0.02 + 0.003 c + 1e-5 (600 c +
    # c (c + 1) / 2) <= 0.5); on a runner with a 64-token tile the idle forward takes 64.
    doc = Request("doc", list(range(2, 1502)), SamplingParams())
    doc.num_cached = 600
    args = dict(CHUNK_ARGS, tree_tokens=0, now=0.0, iteration_cap_s=0.5)
    assert chunk_tokens(below_tile_cost, [], [], [doc], **args) == 51, "no tile: the fit"
    assert chunk_tokens(below_tile_cost, [], [], [doc], **args, tile_tokens=64) == 64
    # A stream's SLO is not spent on a tile: with one decoding (0.38 s allowed), 38 tokens
    # fit and a tile (0.62 s) does not, so only what is forced runs (the minimum chunk: no
    # TTFT objective here); the rest of the slack, which would buy 38 tokens at the
    # row-at-a-time price, stays with the stream.
    stream = _streamed(400.0, 10, 3.8, now=0.0)
    n = chunk_tokens(below_tile_cost, [stream], [1.0], [doc], **dict(args, tree_tokens=1))
    tiled = chunk_tokens(
        below_tile_cost, [stream], [1.0], [doc], **dict(args, tree_tokens=1), tile_tokens=64
    )
    assert n == 38 and tiled == 16
    # A prompt with less than a tile left takes what fits, as without a tile.
    short = Request("short", list(range(2, 652)), SamplingParams())
    short.num_cached = 600
    near_end = dict(args, tree_tokens=1)
    assert chunk_tokens(below_tile_cost, [stream], [1.0], [short], **near_end, tile_tokens=64) == 38
    # The rule alone: tree tokens count toward the tile, the cap and a zero chunk hold.
    assert tiled_chunk(20, 4, 256, 64) == 60
    assert tiled_chunk(70, 0, 256, 64) == 70
    assert tiled_chunk(20, 0, 32, 64) == 32
    assert tiled_chunk(0, 0, 256, 64) == 0
    assert tiled_chunk(20, 0, 256, None) == 20


def tile_priced_cost(tokens: int, context: int, silent: int, silent_pairs: int) -> float:
    """llama.cpp's CPU attention as measured: a prompt chunk of a tile (64 tokens) or more
    computes its keys five times cheaper than one walked row by row."""
    per_pair = 2e-6 if silent >= 64 else 1e-5
    return 0.02 + 0.003 * tokens + per_pair * silent_pairs


def test_beside_streams_a_chunk_short_of_the_tile_waits_for_a_whole_one():
    # 600 tokens into a prompt, one decode row: 38 tokens cost 0.372 s, a 64-token tile
    # 0.297 s (its keys at the tiled price).
    assert tile_or_wait(tile_priced_cost, 1, 0, 600, 38, 0, 64, 0.38) == 64, "the tile fits"
    assert tile_or_wait(tile_priced_cost, 1, 0, 600, 20, 0, 64, 0.25) == 0, "wait: banks grow"
    assert tile_or_wait(tile_priced_cost, 1, 0, 600, 20, 5, 64, 0.25) == 5, "what is forced"
    assert tile_or_wait(tile_priced_cost, 1, 0, 600, 20, 0, 64, None) == 64, "no SLO limit"


def test_the_scheduler_takes_the_runner_s_attention_tile(target):
    """Idle prefill of a 600-token prompt with iterations capped at 60 ms: chunks of ~35
    tokens fit the cap; a runner that declares a 64-token attention tile gets 64-token
    chunks (the last one what is left)."""
    sizes = {}
    for tile in (None, 64):
        e = slowed(
            engine(target, "incremental", chunked=True, num_blocks=2048, prefill_iteration_ms=60),
            0.001,
            0.02,
        )
        e.engine.target.attention_tile_tokens = tile
        doc = e.add_request(
            [(j % 90) + 2 for j in range(600)], SamplingParams(max_tokens=2, ignore_eos=True)
        )
        chunks = []
        while e.has_unfinished():
            e.step()
            st = e.scheduler.last_stats
            if st is not None and st.prefill_tokens:
                chunks.append(st.prefill_tokens)
        assert sum(chunks) == 600 and doc.metrics.first_token_time is not None
        sizes[tile] = chunks
    assert max(sizes[None]) < 64, sizes[None]
    assert all(c == 64 for c in sizes[64][:-1]) and sizes[64][-1] <= 64, sizes[64]


def _streamed(slo_ms: float, tokens_after_first: int, seconds: float, now: float) -> Request:
    """A running request that streamed `tokens_after_first` tokens in `seconds` after its first."""
    r = Request("r", [1, 2], SamplingParams(slo_tpot_ms=slo_ms))
    r.append_token(3, now - seconds)
    for t in range(tokens_after_first):
        r.append_token(3, now - seconds + seconds * (t + 1) / tokens_after_first)
    return r


def test_a_request_behind_its_pace_catches_up_before_prompts_take_its_time():
    # A request paced exactly at its SLO misses it whenever forwards run a little over their
    # prediction (measured: 42-87% attainment on the shared trace; 100% with this rule).
    # So streams are paced slo_pace_margin under their SLO, and a stream behind that pace
    # gives prefill chunks less room until it has caught up (at most slo_repay of a pace).
    cfg = SchedulerConfig()
    assert (cfg.slo_pace_margin, cfg.slo_repay) == (0.05, 0.5)
    now = 50.0
    waiting = Request("w", list(range(2, 402)), SamplingParams())
    args = dict(CHUNK_ARGS, now=now)

    def chunk(seconds: float) -> int:
        r = _streamed(100, 10, seconds, now)
        return chunk_tokens(linear_cost, [r], [1.0], [waiting], **args)

    # 1 ms ahead of its 95 ms pace: allow 0.096 s -> 0.02 + 0.001 (2 + c) <= 0.096 -> c = 74.
    assert chunk(0.949) == 74
    # 29.5 ms behind: allow 0.095 - 0.0295 = 0.0655 s -> c = 43.
    assert chunk(0.9795) == 43
    # Exactly at its 100 ms SLO so far, i.e. 50 ms behind its pace: it repays at most half a
    # pace this iteration, allow 0.0475 s -> c = 25 (the old rule gave it 0.1 s: c = 78).
    assert chunk(1.00) == 25
    # Both are settings: with no margin and no repayment this is the old rule (0.1 s, c = 78).
    r = _streamed(100, 10, 1.00, now)
    assert chunk_tokens(linear_cost, [r], [1.0], [waiting], **args, margin=0, repay=0) == 78
    with pytest.raises(ValueError, match="slo_pace_margin"):
        SchedulerConfig(slo_pace_margin=1.0)
    # Far behind: still half a pace, and prompts still move (never below the minimum chunk).
    assert chunk(3.00) == 25
    slow = _streamed(60, 10, 3.0, now)
    assert chunk_tokens(linear_cost, [slow], [1.0], [waiting], **args) == 16
    # A request whose SLO the decode part alone cannot meet does not hold prompts back.
    lost = _streamed(10, 10, 3.0, now)
    assert chunk_tokens(linear_cost, [lost], [1.0], [waiting], **args) == 256


def test_host_time_between_iterations_is_measured_and_chunks_leave_room_for_it(target):
    # Forwards cost 10 ms + 1 ms per token; the serving loop spends 40 ms between iterations
    # (streaming, detokenizing): a stream with a 60 ms TPOT SLO has ~9 ms left per iteration
    # for prefill chunks, not the 50 ms the forward cost alone would suggest.
    e = slow_forwards(
        engine(target, "incremental", chunked=True, max_prefill_chunk=128, min_prefill_chunk=1),
        lambda n: 0.01 + 0.001 * n,
    )
    clock, sched = e.engine.clock, e.scheduler
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True, slo_tpot_ms=60)
    stream = e.add_request([5, 6, 7, 8], params)
    e.step()
    assert sched.last_stats.host_s is None, "the first iteration after idle has no host time"
    for _ in range(5):
        clock.advance(0.04)
        e.step()
    assert sched.last_stats.host_s == pytest.approx(0.04)
    assert sched.admission.host_s == pytest.approx(0.04)
    e.add_request([(3 * j) % 90 + 2 for j in range(400)], SamplingParams(max_tokens=2))
    while e.has_unfinished():
        clock.advance(0.04)
        e.step()
    times = stream.metrics.token_times
    gaps = [1000 * (b - a) for a, b in zip(times, times[1:])]
    # Counting only the forward, the chunks would be ~50 tokens and the gaps ~100 ms.
    assert max(gaps) <= 66.0, f"gaps up to {max(gaps):.0f} ms: the chunks ignored host time"


def test_a_stream_far_ahead_of_its_pace_lends_its_bank_to_a_prompt():
    now = 50.0
    waiting = Request("w", list(range(2, 402)), SamplingParams())
    ahead = _streamed(100, 40, 0.4, now)  # 40 tokens in 0.4 s: 3.4 s ahead of its 95 ms pace
    args = dict(CHUNK_ARGS, now=now)
    # One pace of bank only (the old rule): allow 0.19 s -> c = 168.
    assert chunk_tokens(linear_cost, [ahead], [1.0], [waiting], **args, spend=0.0) == 168
    # Half its bank: allow 0.095 + 1.7 s -> the whole max_prefill_chunk in one iteration.
    assert chunk_tokens(linear_cost, [ahead], [1.0], [waiting], **args) == 256


def test_a_stream_lends_the_slack_its_remaining_tokens_will_leave_when_asked():
    # --slo-future-lend: a stream exactly at its 95 ms pace (no bank) whose tokens cost 22 ms
    # each (this iteration's decode part) leaves 73 ms a token it has left; a share of that
    # goes to the prompt now instead of the stream banking it first.
    now = 50.0
    waiting = Request("w", list(range(2, 402)), SamplingParams())
    args = dict(CHUNK_ARGS, now=now)

    def at_pace(max_tokens: int) -> Request:
        r = Request("r", [1, 2], SamplingParams(slo_tpot_ms=100, max_tokens=max_tokens))
        r.append_token(3, now - 0.095)
        r.append_token(3, now)  # one token after the first, at exactly its pace
        return r

    # Past bank only: allow 0.095 s -> 0.02 + 0.001 (2 + c) <= 0.095 -> c = 73.
    assert chunk_tokens(linear_cost, [at_pace(5)], [1.0], [waiting], **args) == 73
    # Two tokens left after this one: 2 x (0.095 - 0.022) = 0.146 s lent in full, capped at one
    # pace for this gap (spend: max(pace, half of 0.146)): allow 0.19 s -> c = 168.
    assert chunk_tokens(linear_cost, [at_pace(5)], [1.0], [waiting], **args, future=1.0) == 168
    # Half of it: 0.073 s -> allow 0.168 s -> c = 146.
    assert chunk_tokens(linear_cost, [at_pace(5)], [1.0], [waiting], **args, future=0.5) == 146
    # Its last token: nothing left to lend.
    assert chunk_tokens(linear_cost, [at_pace(3)], [1.0], [waiting], **args, future=1.0) == 73
    # A prompt served best effort borrows nothing: only the time left at the pace.
    late = Request("b", list(range(2, 402)), SamplingParams())
    late.best_effort = True
    assert chunk_tokens(linear_cost, [at_pace(5)], [1.0], [late], **args, future=1.0) == 73
    with pytest.raises(ValueError, match="slo_future_lend"):
        SchedulerConfig(slo_future_lend=1.5)


def test_the_ttft_objective_not_a_minimum_chunk_moves_a_prompt_past_a_tight_stream():
    """A 30 ms stream leaves no room for 16 prompt tokens; the prompt waits while its TTFT
    objective is far, takes what the objective needs as it nears, and the minimum chunk only
    once the objective is lost."""
    now = 100.0
    tight = _streamed(30, 10, 0.285, now)  # exactly on its 28.5 ms pace
    args = dict(CHUNK_ARGS, now=now)

    def chunk(objective_ms: float | None) -> int:
        w = Request("w", list(range(2, 402)), SamplingParams(), arrival_time=now - 0.5)
        w.ttft_objective_ms = objective_ms
        return chunk_tokens(linear_cost, [tight], [1.0], [w], **args)

    room = largest_chunk(linear_cost, 2, 0, 0.0285, 256)
    assert room < 16
    assert chunk(None) == 16, "no objective: the minimum chunk keeps the prompt moving"
    assert chunk(60_000.0) == room, "a far objective does not override the stream's SLO"
    near = ttft_chunk(linear_cost, 2, 0, 400, 0.9, 256)
    assert near is not None and near > 16
    assert chunk(1400.0) == near, "0.9 s left for 400 tokens: the objective sets the chunk"
    assert chunk(400.0) == 16, "a lost objective: back to the minimum chunk"


def test_a_37_ms_stream_keeps_its_slo_while_a_1000_token_prompt_meets_its_ttft(target):
    e = slowed(engine(target, "incremental", chunked=True, num_blocks=2048), 0.0002, 0.02)
    stream = e.add_request(
        [5, 6, 7], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True, slo_tpot_ms=37)
    )
    for _ in range(20):  # the stream is decoding, ahead of its pace
        e.step()
    prompt = e.add_request(
        [(j % 90) + 2 for j in range(1000)],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    objective = prompt.ttft_objective_ms
    assert objective is not None, "a request without slo_ttft_ms gets the default objective"
    while e.has_unfinished():
        e.step()
    assert stream.metrics.tpot_ms <= 37, f"the stream's TPOT {stream.metrics.tpot_ms:.1f} ms"
    ttft_ms = 1000 * prompt.metrics.ttft_s
    assert ttft_ms <= objective, f"TTFT {ttft_ms:.0f} ms over its objective {objective:.0f} ms"


def test_prompts_are_prefilled_earliest_ttft_deadline_first(target):
    """A short question arriving just after a long document gets its first token first (its
    objective is ~1 s, the document's many seconds)."""
    e = slowed(engine(target, "incremental", chunked=True, num_blocks=2048), 0.001, 0.02)
    e.add_request(
        [5, 6, 7], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, slo_tpot_ms=40)
    )
    e.step()
    e.step()
    document = e.add_request(
        [(j % 90) + 2 for j in range(1500)],
        SamplingParams(max_tokens=2, ignore_eos=True),
    )
    e.step()
    question = e.add_request([8, 9, 10, 11], SamplingParams(max_tokens=2, ignore_eos=True))
    while question.metrics.first_token_time is None:
        e.step()
    assert document.metrics.first_token_time is None, "the question waited behind the document"
    objective = question.ttft_objective_ms
    assert 1000 * question.metrics.ttft_s <= objective, "the short prompt met its objective"
    # The order itself: a recomputing stream, then deadlines earliest first (passed ones keep
    # their place), then prompts without an objective.
    now = 100.0
    late = Request("late", [1] * 8, SamplingParams(), arrival_time=now - 10)
    late.ttft_objective_ms = 1000.0
    soon = Request("soon", [1] * 8, SamplingParams(), arrival_time=now - 0.5)
    soon.ttft_objective_ms = 1000.0
    later = Request("later", [1] * 8, SamplingParams(), arrival_time=now - 0.6)
    later.ttft_objective_ms = 5000.0
    resumed = Request("resumed", [1] * 8, SamplingParams(), arrival_time=now - 20)
    resumed.append_token(3, now - 5)
    none = Request("none", [1] * 8, SamplingParams(), arrival_time=now - 30)
    close = Request("close", [1] * 8, SamplingParams(), arrival_time=now - 0.45)
    close.ttft_objective_ms = 1000.0  # due 0.05 s after "soon": arrival order kept
    queue = prefill_order([none, later, soon, close, late, resumed])
    assert [r.request_id for r in queue] == ["resumed", "late", "soon", "close", "later", "none"]
    # A prompt served best effort goes after every prompt with a deadline, its own objective
    # (the earliest here) notwithstanding; arrival order among those without one.
    spare = Request("spare", [1] * 8, SamplingParams(), arrival_time=now - 40)
    spare.ttft_objective_ms = 100.0
    spare.best_effort = True
    queue = prefill_order([none, later, spare, soon, close, late, resumed])
    assert [r.request_id for r in queue] == [
        *("resumed", "late", "soon", "close", "later"),
        *("spare", "none"),
    ]


@pytest.mark.parametrize("cap_ms", [500.0, 0.0])
def test_a_question_arriving_during_an_idle_prefill_meets_its_ttft(target, cap_ms):
    """Nothing decodes and a 1,500-token document (1.5 s alone) is being prefilled when a short
    question arrives: iterations capped at half a second leave its ~1.1 s objective room; one
    whole-prompt iteration (cap 0) makes it wait the full 1.5 s."""
    e = slowed(
        engine(target, "incremental", chunked=True, num_blocks=2048, prefill_iteration_ms=cap_ms),
        0.001,
        0.02,
    )
    warm = e.add_request([5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    while e.has_unfinished():  # the cost model sees a forward before the document comes
        e.step()
    assert warm.metrics.first_token_time is not None
    document = e.add_request(
        [(j % 90) + 2 for j in range(1500)], SamplingParams(max_tokens=2, ignore_eos=True)
    )
    start = e.engine.clock()
    e.step()
    # The question came 0.1 s into that iteration (virtual time stands still during a step).
    question = e.add_request(
        [8, 9, 10, 11], SamplingParams(max_tokens=2, ignore_eos=True), arrival_time=start + 0.1
    )
    while e.has_unfinished():
        e.step()
    objective = question.ttft_objective_ms
    assert objective is not None and objective < 1500
    ttft_ms = 1000 * question.metrics.ttft_s
    if cap_ms:
        assert ttft_ms <= objective, f"TTFT {ttft_ms:.0f} ms over its objective {objective:.0f}"
        first = document.metrics.first_token_time
        assert first is not None and 1000 * document.metrics.ttft_s <= document.ttft_objective_ms
    else:
        assert ttft_ms > objective, f"one whole-prompt iteration, yet TTFT {ttft_ms:.0f} ms"


@pytest.mark.parametrize("prompts_yield", [True, False])
def test_a_tight_stream_is_admitted_over_a_document_whose_chunks_would_break_it(
    target, prompts_yield
):
    """A 1,000-token document is being prefilled (4 ms a prompt token, as on ggml here) with
    a 5 s TTFT objective: its forced chunks make every forward ~90 ms. A 40 ms request is
    refused for that alone without `prompts_yield`; with it, admitted over the document,
    which then rides in the stream's slack: the stream meets its SLO (38 ms; 72.6 ms had the
    document kept forcing) and the document still gets its first token, within twice its
    objective (5.7 s; it trades its 5 s objective for the stream's)."""
    e = slowed(
        engine(target, "incremental", chunked=True, num_blocks=2048, prompts_yield=prompts_yield),
        0.004,
        0.02,
    )
    warm = e.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    while e.has_unfinished():  # the cost model sees forwards before the document comes
        e.step()
    assert warm.metrics.first_token_time is not None
    document = e.add_request(
        [(j % 90) + 2 for j in range(1000)],
        SamplingParams(max_tokens=2, ignore_eos=True, slo_ttft_ms=5000),
    )
    e.step()
    assert 0 < document.num_cached < 1000, "the document is being prefilled"
    why = e.admission.refusal(40.0, 4, None, 64)
    if not prompts_yield:
        assert why is not None and "slo_tpot_ms 40 cannot be met" in why, why
        assert not document.prefill_yields
        return
    assert why is None, why
    assert document.prefill_yields, "admitted over the document, which now yields"
    stream = e.add_request(
        [8, 9, 10, 11],
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True, slo_tpot_ms=40),
    )
    while e.has_unfinished():
        e.step()
    assert stream.metrics.tpot_ms <= 40, f"the stream's TPOT {stream.metrics.tpot_ms:.1f} ms"
    ttft_ms = 1000 * document.metrics.ttft_s
    assert ttft_ms <= 2 * 5000, f"the document starved: first token after {ttft_ms:.0f} ms"
