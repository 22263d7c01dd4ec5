"""The benchmarks' default scenario: every pass on a fresh engine that has seen none of the
measured prompts or their answers; `repeated` keeps one engine (and what it learned)."""

from __future__ import annotations

import pytest

from adaserve import LLMEngine, SamplingParams
from adaserve.bench.passes import EnginePool, turns
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


def test_side_by_side_passes_serve_alike_and_time_only_their_own_steps(tiny_llama) -> None:
    """The interleaved benchmark: every engine serves every prompt, with the same greedy
    output as serving alone, and is charged only the time of its own steps."""
    import time

    from adaserve.bench.drafters import serve, serve_side_by_side

    def build(policy: str) -> LLMEngine:
        return LLMEngine(
            ModelConfig(model=str(tiny_llama), drafter="suffix"),
            CacheConfig(block_size=4, num_blocks=256),
            SchedulerConfig(policy=policy, budget=8, max_num_seqs=2),
        )

    prompts = [PROMPT, PROMPT[::-1], [7, 7, 7, 7, 7, 7]]
    alone = [serve(build(p), prompts, 2, 8, staggered=True) for p in ("incremental", "adaserve")]
    start = time.perf_counter()
    paired = serve_side_by_side(
        [build("incremental"), build("adaserve")], prompts, 2, 8, staggered=True
    )
    wall = time.perf_counter() - start
    assert [r.tokens for r in paired] == [r.tokens for r in alone]
    assert all(r.tokens > len(prompts) for r in paired)
    assert all(r.seconds > 0 for r in paired)
    assert sum(r.seconds for r in paired) <= wall, "an engine was charged the other's steps"


def test_a_pass_never_has_more_requests_in_flight_than_its_concurrency(tiny_llama) -> None:
    """A prompt being prefilled counts: `--concurrency 1` once served two requests at a time
    (the second admitted while the first was prefilled) whenever max_num_seqs allowed it."""
    from adaserve.bench.drafters import Pass

    for concurrency in (1, 2):
        engine = LLMEngine(
            ModelConfig(model=str(tiny_llama), drafter="suffix"),
            CacheConfig(block_size=4, num_blocks=256),
            # Prompts prefilled 8 tokens a step: each is in flight for steps before it decodes.
            SchedulerConfig(
                policy="incremental",
                budget=8,
                max_num_seqs=4,
                max_num_batched_tokens=8,
                max_prefill_chunk=8,
            ),
        )
        prompts = [PROMPT * 4, PROMPT[::-1] * 4, [7] * 30, PROMPT[:5] * 6]
        run = Pass(engine, prompts, concurrency, 6)
        most = 0
        while not run.done:
            run.step()
            sched = engine.scheduler
            busy = len(sched.waiting) + len(sched.prefilling) + len(sched.running)
            assert busy == run.in_flight
            most = max(most, busy)
        assert most == concurrency, f"{most} requests in flight at concurrency {concurrency}"
        assert not run.pending and run.result.tokens >= len(prompts), "a prompt was not served"


def test_ignore_eos_runs_every_request_to_its_max_tokens(tiny_llama) -> None:
    """#35's measurement (`--ignore-eos`): requests started together end together under
    incremental decoding, whatever token the model emits; without it a request ends at EOS."""
    from adaserve.bench.drafters import Pass

    prompts = [PROMPT, PROMPT[::-1], [7, 7, 7, 7, 7, 7]]
    served = {}
    for ignore_eos in (False, True):
        engine = LLMEngine(
            ModelConfig(model=str(tiny_llama), drafter="suffix"),
            CacheConfig(block_size=4, num_blocks=256),
            SchedulerConfig(policy="adaserve", budget=8, max_num_seqs=4),
        )
        # Every token ends a request here, so EOS comes at each request's first token.
        engine.scheduler.output.eos_ids = set(range(engine.tokenizer.vocab_size + 512))
        run = Pass(engine, prompts, 4, 6, ignore_eos=ignore_eos)
        while not run.done:
            run.step()
        served[ignore_eos] = run.result.tokens
    assert served[False] == len(prompts), f"EOS did not end the requests: {served[False]} tokens"
    assert served[True] == 6 * len(prompts), f"--ignore-eos served {served[True]} tokens"


def test_request_latency_runs_from_submission_to_the_last_token(tiny_llama) -> None:
    """The mean latency column: one at a time, the requests' latencies add up to the pass's
    time; all at once with equal lengths (incremental decoding), each took the whole pass."""
    from adaserve.bench.drafters import Pass

    prompts = [PROMPT, PROMPT[::-1], [7, 7, 7, 7, 7, 7]]
    for concurrency in (1, len(prompts)):
        engine = LLMEngine(
            ModelConfig(model=str(tiny_llama)),
            CacheConfig(block_size=4, num_blocks=256),
            SchedulerConfig(policy="incremental", budget=8, max_num_seqs=4),
        )
        run = Pass(engine, prompts, concurrency, 6, ignore_eos=True)
        while not run.done:
            run.step()
        r = run.result
        assert r.requests == len(prompts)
        total = r.latency_s if concurrency == 1 else r.mean_latency_s
        # Both are read on the engine's own clock, the pass's seconds on perf_counter around
        # the same steps: they differ by the few microseconds between the two readings.
        assert total == pytest.approx(r.seconds, rel=0.05), (concurrency, total, r.seconds)


def test_staggered_lengths_keep_the_mean_and_spread_the_finishes() -> None:
    from adaserve.bench.drafters import output_limit

    limits = [output_limit(64, i, staggered=True) for i in range(8)]
    assert limits[:4] == [40, 56, 72, 88] and limits[4:] == limits[:4]
    assert sum(limits) == 8 * 64
    assert {output_limit(64, i, staggered=False) for i in range(8)} == {64}


def test_each_configuration_takes_each_slot_equally_often() -> None:
    # The configuration that runs first in a round is measured faster in one process: over a
    # multiple of the configurations' count of rounds, none may hold that slot more often.
    labels = ["incremental", "adaserve", "sequence"]
    rounds = [turns(labels, i) for i in range(2 * len(labels))]
    for order in rounds:
        assert sorted(order) == sorted(labels), f"round order {order} lost or doubled one"
    for slot in range(len(labels)):
        held = [order[slot] for order in rounds]
        assert all(held.count(label) == 2 for label in labels), f"slot {slot}: {held}"
    assert rounds[0] == labels, "the first round keeps the given order"
    assert turns([], 3) == []


def test_the_policies_bench_serves_side_by_side_and_charges_each_its_own_steps(tiny_llama) -> None:
    """`bench.policies --schedule interleaved` (its default): both engines serve the whole
    batch (every token, every SLO judged) and each is charged only its own steps."""
    import time

    from adaserve.bench.policies import Result, run, serve_side_by_side

    def build(policy: str) -> LLMEngine:
        return LLMEngine(
            ModelConfig(model=str(tiny_llama), drafter="suffix"),
            CacheConfig(block_size=4, num_blocks=256),
            SchedulerConfig(policy=policy, budget=8, max_num_seqs=4),
        )

    batch, slos = ["a b c d", "e f g", "h i j k l"], [150.0, None]
    alone = run(build("adaserve"), batch, 6, slos)
    start = time.perf_counter()
    paired = serve_side_by_side([build("incremental"), build("adaserve")], batch, 6, slos)
    wall = time.perf_counter() - start
    assert [r.tokens for r in paired] == [alone.tokens] * 2 == [3 * 6] * 2
    assert [r.with_slo for r in paired] == [2, 2], "the two requests with an SLO are judged"
    assert all(r.decode_iterations >= 5 and r.seconds > 0 for r in paired)
    assert sum(r.seconds for r in paired) <= wall, "an engine was charged the other's steps"
    total = Result()
    total.add(paired[0])
    total.add(paired[1])
    assert total.tokens == 36 and total.seconds == paired[0].seconds + paired[1].seconds


def test_an_own_clock_runs_only_inside_its_steps(monkeypatch) -> None:
    from adaserve.bench import passes

    now = [100.0]
    monkeypatch.setattr(passes.time, "monotonic", lambda: now[0])
    clock = passes.OwnClock()
    start = clock()
    now[0] += 5.0  # another engine's steps
    assert clock() == start
    with clock.running():
        now[0] += 0.25
        assert clock() == start + 0.25
    now[0] += 7.0
    with clock.running():
        now[0] += 0.5
    assert clock() == start + 0.75


def test_side_by_side_engines_keep_their_own_slo_pace_and_attainment(tiny_llama, monkeypatch):
    """Beside an engine whose every step takes 0.2 s, an engine serving 100 ms SLOs still
    meets them, as it would alone: its scheduler and its metrics read its own time, not the
    other's steps (on the wall clock every one of its tokens came 0.2 s apart). The 0.2 s is
    added to the clock every engine reads, not slept."""
    from adaserve.bench import passes
    from adaserve.bench.policies import serve_side_by_side
    from adaserve.exec.engine import ExecutionEngine

    real_monotonic, offset = passes.time.monotonic, [0.0]

    def wall() -> float:  # the wall clock, with the slow engine's extra time in it
        return real_monotonic() + offset[0]

    monkeypatch.setattr(passes.time, "monotonic", wall)  # what an OwnClock reads
    monkeypatch.setattr(ExecutionEngine, "clock", staticmethod(wall))  # an engine's default

    def build() -> LLMEngine:
        return LLMEngine(
            ModelConfig(model=str(tiny_llama), drafter="suffix"),
            CacheConfig(block_size=4, num_blocks=256),
            SchedulerConfig(policy="adaserve", budget=8, max_num_seqs=4),
        )

    slow, fast = build(), build()
    real_step = slow.step

    def slow_step():
        offset[0] += 0.2
        return real_step()

    slow.step = slow_step  # type: ignore[method-assign]
    got = serve_side_by_side([slow, fast], ["a b c d", "e f g"], 5, [100.0])
    assert got[1].with_slo == 2 and got[1].slo_met == 2, "the fast engine's SLOs were lost"
    assert got[0].with_slo == 2 and got[0].slo_met == 0, "0.2 s steps cannot meet 100 ms"
