"""Which engine a benchmark pass runs on: a fresh one (default) or one kept across passes.

`new` (the default): every measured pass builds its engine anew and warms it up on text
unrelated to the measured prompts, so nothing the engine learns from traffic (the suffix
drafter's global index of finished outputs, speculation control's calibration and cost
model, the prefix cache) has seen the prompts or their answers: what a user's new traffic
meets. `repeated`: one engine per configuration for the whole run, prompts served again pass
after pass, as for traffic that repeats (the suffix index then holds the answers).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from adaserve import LLMEngine, SamplingParams

SCENARIOS = ("new", "repeated")
# Warm-up text: first forwards allocate and pick kernels; it shares nothing with the prompts.
WARMUP_PROMPT = "Hello."


def add_totals(total: Any, part: Any) -> None:
    """Add every field of the dataclass `part` into `total` (of the same class): a
    benchmark's per-pass figures summed over its passes."""
    for name in total.__dataclass_fields__:
        setattr(total, name, getattr(total, name) + getattr(part, name))


def turns(labels: list[str], round_index: int) -> list[str]:
    """The order the configurations run in, round `round_index`: rotated by one each round.

    In one process the configuration that runs first in a round is measured faster: two
    identical incremental engines taking turns on the default model (ggml), one request of 48
    tokens, 3 rounds, had forwards 2-5% faster in the one that went first in 3 of 4 runs,
    whichever it was; adaserve with nothing drafted read 0.90x and 0.94x of incremental going
    second, 1.08x going first. A fixed order hands the baseline that slot in every round;
    rotating gives each configuration each slot equally often when the rounds are a multiple
    of the configurations."""
    if not labels:
        return []
    k = round_index % len(labels)
    return labels[k:] + labels[:k]


def warm_up(engine: LLMEngine) -> None:
    """Two greedy tokens on the warm-up prompt (outside the measured time)."""
    engine.add_request(WARMUP_PROMPT, SamplingParams(max_tokens=2, temperature=0.0))
    while engine.has_unfinished():
        engine.step()


class EnginePool:
    """Engines per configuration label, built by `factories`, handed out per pass."""

    def __init__(self, scenario: str, factories: dict[str, Callable[[], LLMEngine]]) -> None:
        if scenario not in SCENARIOS:
            raise ValueError(f"scenario must be one of {SCENARIOS}, got {scenario!r}")
        self.scenario, self.factories = scenario, factories
        self.built = {label: 0 for label in factories}
        self._kept: dict[str, LLMEngine] = {}

    @property
    def labels(self) -> list[str]:
        return list(self.factories)

    def engine(self, label: str) -> LLMEngine:
        """The engine of the next pass of `label`: fresh (`new`) or the kept one."""
        if self.scenario == "repeated" and label in self._kept:
            return self._kept[label]
        engine = self.factories[label]()
        warm_up(engine)
        self.built[label] += 1
        if self.scenario == "repeated":
            self._kept[label] = engine
        return engine


class OwnClock:
    """A clock that runs only while its engine steps (`running()`): time.monotonic() less
    the time spent outside its steps.

    Engines served side by side each read their own (`LLMEngine.use_clock`), so what their
    schedulers see (arrivals, token times, SLO paces and deadlines, TTFT objectives) and the
    SLO attainment they report are what they would be alone. On the wall clock, seven
    engines taking turns saw every token ~7 times late: each request's pace looked lost and
    no SLO was met."""

    def __init__(self) -> None:
        self._paused_at: float | None = time.monotonic()
        self._offset = 0.0  # seconds spent outside the engine's steps

    def __call__(self) -> float:
        now = time.monotonic() if self._paused_at is None else self._paused_at
        return now - self._offset

    @contextmanager
    def running(self) -> Iterator[None]:
        assert self._paused_at is not None, "running() does not nest"
        self._offset += time.monotonic() - self._paused_at
        self._paused_at = None
        try:
            yield
        finally:
            self._paused_at = time.monotonic()


def own_clock(engine: LLMEngine) -> OwnClock:
    """Give an idle engine a fresh OwnClock; step it inside `clock.running()`."""
    clock = OwnClock()
    engine.use_clock(clock)
    return clock
