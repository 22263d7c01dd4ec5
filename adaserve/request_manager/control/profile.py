"""Latency profile of the target and draft forwards -> budget B, t_spec and the baseline latency.

Measured on the machine that serves, never taken from a spec sheet:
- target: forward latency T(tokens, context) with the tokens spread over up to `NUM_SEQS`
  sequences, each attending to `context` cached tokens (a verification batch's shape);
- draft: step latency over the same shapes at the budget context;
- B: the largest token count whose forward stays within `budget_factor` x a 1-token forward
  (at `BUDGET_CONTEXT`), interpolated between the measured powers of two; the controlled
  policy's ceiling by the same rule at `CEILING_FACTOR`;
- baseline latency: minimal per-iteration latency of incremental decoding, batch 8, input 32,
  output 128 (AdaServe's definition), the unit of relative SLOs (`slo_ratio` in traces).

    adaserve profile [MODEL] --out profile.json [--quick]   (adaserve/bench/profile.py)
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from tqdm import tqdm

from adaserve.config import SchedulerConfig
from adaserve.exec.checkpoint_files import cache_root
from adaserve.exec.engine import ExecutionEngine
from adaserve.exec.timing import (
    BASELINE_BATCH,
    BASELINE_INPUT,
    NUM_SEQS,
    ShapeTimer,
    baseline_latency_ms,
    powers_of_two,
    split_tokens,
    time_forward,
)
from adaserve.exec.torch_runner import ModelRunner
from adaserve.request_manager.control.cost_model import ForwardCostModel

log = logging.getLogger("adaserve.profile")

DEFAULT_BUDGET_FACTOR = 1.5
# The controlled policy's ceiling (`SchedulerConfig.budget_ceiling`): the token count whose
# forward stays within this many 1-token forwards, by B's rule. Speculation control decides how
# much of it a forward takes, and past B only within every running stream's pace; a wide
# ceiling met more SLOs in simulation at every paper-scale cost model (docs/results.md, "The
# budget ceiling").
CEILING_FACTOR = 6.0
BUDGET_CONTEXT = 256


@dataclass(frozen=True)
class _Plan:
    max_tokens: int  # target token counts: powers of two up to this
    contexts: tuple[int, ...]
    repeats: int  # timed runs per shape (the median counts)
    baseline_steps: int  # decode iterations of the baseline (the paper: 128 output tokens)


FULL = _Plan(max_tokens=256, contexts=(64, BUDGET_CONTEXT, 1024), repeats=5, baseline_steps=128)
# Server start-up without a profile file: seconds, not minutes.
QUICK = _Plan(max_tokens=64, contexts=(BUDGET_CONTEXT,), repeats=3, baseline_steps=16)
DRAFT_MAX_TOKENS = 64
# A profile is noise, not a measurement, when repeats of one shape spread more than this
# (max - min over the median), or a 1-token forward takes this much longer than the cheapest
# 2..16-token forward (one token cannot cost more than several; a busy machine makes it so).
NOISE_SPREAD = 0.5
NOISE_ONE_TOKEN = 1.5
# A fitted cost model that a server stores in its start-up profile at shutdown is used by
# the next start only while it predicts the profile's measured points within this factor,
# either way. A server overloaded by long prompts once stored a fit that priced an 8-row
# forward at 2.4x its measurement; the next servers started from it, predicted every stream
# too slow, and refused 41 of 48 requests (8% of SLOs met, against 33-42% from the points).
FIT_TOLERANCE = 2.0
# A cached start-up profile measured (or last confirmed) longer ago than this is checked
# against the machine as it is now before a server uses it: its 1- and 2-token forwards are
# timed again (a second), and off the cached points by more than STALE_TOLERANCE either way
# the profile is measured again. One cached a day earlier on a busy machine priced 2 decode
# rows at 38 ms where they took 23-24 ms; the servers that started from it (and the fits they
# stored back, within FIT_TOLERANCE of those points) refused streams at 53-62 ms per token
# predicted that `--policy incremental`, from a fresh cost curve, served at 33-43 ms.
STALE_CHECK_AGE_S = 3600.0
STALE_TOLERANCE = 1.3
STALE_CHECK_TOKENS = (1, 2)
# t_spec assumes D_max draft steps per iteration: the deepest tree the scheduler grows.
T_SPEC_DRAFT_STEPS = SchedulerConfig().max_depth


@dataclass(frozen=True)
class LatencyPoint:
    tokens: int
    context: int
    ms: float


@dataclass(frozen=True)
class Profile:
    """A measured latency profile and what is derived from it."""

    device: str
    model: str
    draft_model: str | None
    target: tuple[LatencyPoint, ...]
    draft: tuple[LatencyPoint, ...]
    budget: int
    budget_factor: float
    budget_context: int
    baseline_latency_ms: float
    quick: bool = False
    draft_steps: int = T_SPEC_DRAFT_STEPS
    # Largest (max - min) / median over the repeats of one target shape.
    max_spread: float = 0.0
    # Online cost model's fitted coefficients (ForwardCostModel.to_json): written by
    # `adaserve profile`, refreshed in the start-up cache by a server that ran.
    cost_model: dict | None = None
    # Who ran the target ("torch" or "ggml"): a simulation of this machine follows what the
    # backend does (ggml: no padded forwards, no prefix caching).
    backend: str = "torch"
    # Seconds per tree pair beyond the curve (`timing.tree_pair_cost`): the cost model's h
    # before any tree is verified. None: measured by a version that did not measure it.
    tree_pair_s: float | None = None
    created_at: str = field(default_factory=lambda: _now())

    def target_ms(self, tokens: float, context: int | None = None) -> float:
        """Target forward latency at `tokens`, interpolated over the profile at one context."""
        return _interp(self.target, tokens, self.budget_context if context is None else context)

    @property
    def budget_ceiling(self) -> int:
        """The controlled policy's ceiling: B's rule at CEILING_FACTOR (never below B)."""
        at = {p.tokens: p.ms for p in self.target if p.context == self.budget_context}
        return max(self.budget, derive_budget(at, CEILING_FACTOR))

    def draft_ms(self, tokens: float) -> float:
        return _interp(self.draft, tokens, self.budget_context) if self.draft else 0.0

    def t_spec_s(self, tokens: float, draft_steps: int | None = None) -> float:
        """Predicted speculative-iteration latency: draft_steps draft steps + one verify."""
        steps = self.draft_steps if draft_steps is None else draft_steps
        return (self.target_ms(tokens) + steps * self.draft_ms(tokens)) / 1000.0

    def noise_reason(self) -> str | None:
        """Why this profile is noise (None: it is a usable measurement)."""
        if self.max_spread > NOISE_SPREAD:
            return f"repeats of one shape spread {100 * self.max_spread:.0f}%"
        at = {p.tokens: p.ms for p in self.target if p.context == self.budget_context}
        several = [ms for t, ms in at.items() if 2 <= t <= 16]
        if 1 in at and several and at[1] > NOISE_ONE_TOKEN * min(several):
            return (
                f"a 1-token forward ({at[1]:.1f} ms) took over {NOISE_ONE_TOKEN}x the cheapest "
                f"2-16-token one ({min(several):.1f} ms)"
            )
        return None

    def age_s(self) -> float:
        """Seconds since it was measured or last confirmed (`stale_reason`); infinite when
        `created_at` does not parse."""
        try:
            then = datetime.datetime.fromisoformat(self.created_at)
        except ValueError:
            return math.inf
        if then.tzinfo is None:
            then = then.replace(tzinfo=datetime.timezone.utc)
        now = datetime.datetime.now(datetime.timezone.utc)
        return (now - then).total_seconds()

    def cost_points(self) -> list[tuple[int, int, float]]:
        """Target points as (tokens, total context tokens, seconds) for the online cost model."""
        return [
            (p.tokens, p.context * len(split_tokens(p.tokens, NUM_SEQS)), p.ms / 1000.0)
            for p in self.target
        ]

    def fit_disagreement(self, model: ForwardCostModel) -> float:
        """How far `model` strays from this profile's measured points: the largest ratio,
        either way, of a prediction to its measurement (1.0: it predicts every point)."""
        worst = 1.0
        for tokens, context, seconds in self.cost_points():
            predicted = model.predict(tokens, context)
            if predicted <= 0 or seconds <= 0:
                return math.inf
            worst = max(worst, predicted / seconds, seconds / predicted)
        return worst

    def forward_cost_model(self, forget: float = 0.98) -> ForwardCostModel:
        """The target's cost model: fitted coefficients if stored and they agree with the
        measured points (within FIT_TOLERANCE), else fitted to the points."""
        if self.cost_model is not None:
            stored = ForwardCostModel.from_json(json.dumps(self.cost_model), forget=forget)
            off = self.fit_disagreement(stored)
            if off <= FIT_TOLERANCE:
                return stored
            log.warning(
                "the profile's stored cost model is %.1fx off its measured points; "
                "starting from the points instead",
                off,
            )
        model = ForwardCostModel(forget=forget)
        model.seed(self.cost_points())
        if self.tree_pair_s is not None:
            model.set_tree_pair_prior(self.tree_pair_s)
        return model

    def to_json(self) -> dict:
        d = asdict(self)
        d["target"] = [asdict(p) for p in self.target]
        d["draft"] = [asdict(p) for p in self.draft]
        # Derived, for readers of the file; `load` recomputes it from the points.
        d["t_spec_ms"] = [
            {"tokens": p.tokens, "ms": 1000.0 * self.t_spec_s(p.tokens)}
            for p in self.target
            if p.context == self.budget_context
        ]
        return d

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            d = json.loads(Path(path).read_text())
            d.pop("t_spec_ms", None)
            d["target"] = tuple(LatencyPoint(**p) for p in d["target"])
            d["draft"] = tuple(LatencyPoint(**p) for p in d["draft"])
            return cls(**d)
        except (KeyError, TypeError, json.JSONDecodeError) as exc:
            raise ValueError(
                f"{path} is not a profile written by `adaserve profile` ({exc}); make one with "
                "`adaserve profile --out FILE`"
            ) from None


def load_profile(path: str | Path) -> tuple[int, Callable[[float], float]]:
    """(budget B, t_spec_s(tokens)) of a saved profile."""
    p = Profile.load(path)
    return p.budget, p.t_spec_s


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _interp(points: Sequence[LatencyPoint], tokens: float, context: int) -> float:
    """Piecewise-linear in tokens at the measured context nearest `context`; linear beyond."""
    ctx = min({p.context for p in points}, key=lambda c: (abs(c - context), c))
    pts = sorted((p.tokens, p.ms) for p in points if p.context == ctx)
    if len(pts) == 1 or tokens <= pts[0][0]:
        return pts[0][1]
    for (t0, m0), (t1, m1) in zip(pts, pts[1:]):
        if tokens <= t1 or (t1, m1) == pts[-1]:
            return m0 + (tokens - t0) * (m1 - m0) / (t1 - t0)
    raise AssertionError("unreachable")


def derive_budget(latency_ms: dict[int, float], factor: float) -> int:
    """Largest token count whose latency stays within `factor` x the 1-token latency.

    Each count costs its cheapest padded size (the cheapest measured count >= it); walks up
    the counts and stops at the first one over the limit, interpolating inside that step.
    A CPU cliff (even the cheapest multi-token forward over the limit: a 1-token forward is a
    matrix-vector product no larger forward gets) measures the flat region from that cheapest
    multi-token forward instead; whether its tokens pay is then speculation control's call.
    """
    counts = sorted(latency_ms)
    if not counts or counts[0] != 1:
        raise ValueError("the profile needs a 1-token measurement to derive the budget")
    # A forward of n tokens can be padded to any larger measured count (the scheduler does
    # so when that is faster: on a CPU 2-3 tokens can cost more than 8), so n costs the
    # cheapest measured count >= n.
    latency_ms = {n: min(latency_ms[m] for m in counts if m >= n) for n in counts}
    limit = factor * latency_ms[1]
    if len(counts) > 2 and latency_ms[counts[1]] > limit:
        limit = factor * latency_ms[counts[1]]
    budget = 1
    for lo, hi in zip(counts, counts[1:]):
        if latency_ms[hi] <= limit:
            budget = hi
            continue
        rise = latency_ms[hi] - latency_ms[lo]
        if rise > 0:
            budget = max(budget, int(lo + (limit - latency_ms[lo]) * (hi - lo) / rise))
        break
    return budget


def _spread(samples: Sequence[float]) -> float:
    """(max - min) / median of one shape's timed repeats."""
    return (max(samples) - min(samples)) / statistics.median(samples)


def profile_engine(
    engine: ExecutionEngine,
    quick: bool = False,
    progress: bool = True,
    budget_factor: float = DEFAULT_BUDGET_FACTOR,
    max_tokens: int | None = None,
    contexts: Sequence[int] | None = None,
) -> Profile:
    """Measure the engine's target (and draft) and derive B, t_spec and the baseline latency.

    `quick` (server start-up): one context, tokens up to 64, 1 timed run per shape, 16
    baseline steps. `max_tokens` and `contexts` override the plan's grid.
    """
    plan = QUICK if quick else FULL
    max_tokens = max_tokens or plan.max_tokens
    ctxs = sorted({*(contexts or plan.contexts), BUDGET_CONTEXT})
    # A sequence holds context + its share of the tokens; longer ones the model cannot run.
    longest = split_tokens(max_tokens, NUM_SEQS)[0]
    ctxs = [c for c in ctxs if c + longest <= engine.max_model_len] or [0]
    counts = powers_of_two(max_tokens)
    budget_ctx = min(ctxs, key=lambda c: (abs(c - BUDGET_CONTEXT), c))
    jobs = [("target", engine.target, t, c) for c in ctxs for t in counts]
    if engine.draft is not None:
        jobs += [("draft", engine.draft, t, budget_ctx) for t in powers_of_two(DRAFT_MAX_TOKENS)]
    bar = tqdm(total=len(jobs) + 1, desc="profiling", unit="shape", disable=not progress)
    points: dict[str, list[LatencyPoint]] = {"target": [], "draft": []}
    spread = 0.0
    try:
        for _ in range(3):  # first forwards allocate and pick kernels: keep them out of the numbers
            time_forward(engine.target, 1, 0, 1)
        # One ShapeTimer per runner and context: each context is computed once, not per shape.
        for (which, runner, ctx), group in itertools.groupby(jobs, lambda j: (j[0], j[1], j[3])):
            with ShapeTimer(runner, ctx) as timer:
                for _, _, tokens, _ in group:
                    samples = timer.samples(tokens, plan.repeats)
                    if (
                        samples is not None
                        and which == "target"
                        and _spread(samples) > NOISE_SPREAD
                    ):
                        # One outlier among a few repeats (a page fault, another process's
                        # burst) is not a busy machine: that shape alone is timed once more
                        # and its steadier repeats count. On a busy machine they spread again.
                        again = timer.samples(tokens, plan.repeats)
                        if again is not None and _spread(again) < _spread(samples):
                            samples = again
                    if samples is not None:  # shapes the KV pool cannot hold are left out
                        ms = statistics.median(samples)
                        points[which].append(LatencyPoint(tokens, ctx, ms))
                        if which == "target":
                            spread = max(spread, _spread(samples))
                    bar.update()
        baseline = baseline_latency_ms(engine.target, plan.baseline_steps)
        tree_pair_s = engine.target.tree_pair_cost()
        bar.update()
    finally:
        bar.close()
    at_budget_ctx = {p.tokens: p.ms for p in points["target"] if p.context == budget_ctx}
    cost = ForwardCostModel()
    cost.seed(
        (p.tokens, p.context * len(split_tokens(p.tokens, NUM_SEQS)), p.ms / 1000.0)
        for p in points["target"]
    )
    if tree_pair_s is not None:
        cost.set_tree_pair_prior(tree_pair_s)
    cost_json = json.loads(cost.to_json())
    device = engine.target.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Profile(
        device=f"{device} ({name})" if device.type == "cuda" else "cpu",
        model=engine.target_path.name,
        draft_model=engine.draft_path.name if engine.draft_path is not None else None,
        target=tuple(points["target"]),
        draft=tuple(points["draft"]),
        budget=derive_budget(at_budget_ctx, budget_factor),
        budget_factor=budget_factor,
        budget_context=budget_ctx,
        baseline_latency_ms=baseline,
        quick=quick,
        max_spread=spread,
        cost_model=cost_json,
        backend=getattr(engine, "backend", "torch"),
        tree_pair_s=tree_pair_s,
    )


def startup_profile_path(engine: ExecutionEngine) -> Path:
    """Where the start-up profile of this (target, draft, device, dtype, threads, CUDA graphs)
    is cached (a thread count only when one was set that differs from the backend's default:
    replicas sharing a machine run slower than one process on all its cores, and must not
    inherit its profile, while `--threads` naming the default measures nothing new)."""
    if engine.backend == "ggml":
        dtype = "gguf"
    else:
        target = engine.target
        assert isinstance(target, ModelRunner)  # the torch backend's target
        dtype = str(next(target.model.parameters()).dtype).removeprefix("torch.")
    draft = _model_key(engine.draft_path) if engine.draft_path is not None else "none"
    key = f"{_model_key(engine.target_path)}__{draft}__{engine.target.device}__{dtype}"
    key = key.replace(":", "-")
    if engine.threads is not None and engine.threads != engine.default_threads:
        key += f"__{engine.threads}threads"
    if getattr(engine.target, "graphs", None) is not None:
        # Replayed forwards cost a fraction of eager ones on a GPU (docs/gpu.md): a profile
        # measured eagerly would give a graph-replaying server a budget past its graphs.
        key += "__cudagraphs"
    return cache_root() / "profiles" / f"{key}.json"


def _model_key(path: Path) -> str:
    """A model dir's name in a profile's file name; a hub snapshot dir is named by its commit
    alone, so it gets its repo's name too (models--owner--name@commit)."""
    if path.parent.name == "snapshots":
        return f"{path.parent.parent.name}@{path.name[:12]}"
    return path.name


def startup_profile(engine: ExecutionEngine, progress: bool = True) -> Profile | None:
    """The quick profile the server runs at start-up, cached per (models, device, dtype).

    A noisy measurement (a busy machine) is taken twice at most, then neither used nor cached:
    None, and the server starts from the configured defaults and its online cost model.
    """
    path = startup_profile_path(engine)
    if path.exists():
        try:
            cached = Profile.load(path)
            # One cached before the tree pairs were measured is measured again.
            if cached.noise_reason() is None and cached.tree_pair_s is not None:
                stale = None
                if cached.age_s() > STALE_CHECK_AGE_S:
                    stale = stale_reason(engine, cached)
                    if stale is None:  # confirmed now: no check for another hour
                        cached = replace(cached, created_at=_now())
                        cached.save(path)
                if stale is None:
                    # The points are the measurement; B is derived, by this version's rule.
                    ctx = cached.budget_context
                    at_ctx = {p.tokens: p.ms for p in cached.target if p.context == ctx}
                    return replace(cached, budget=derive_budget(at_ctx, cached.budget_factor))
                log.warning(
                    "the cached start-up profile %s no longer describes this machine (%s); "
                    "measuring it again",
                    path,
                    stale,
                )
        except ValueError:
            pass  # written by another version: measure again
    for attempt in range(2):
        prof = profile_engine(engine, quick=True, progress=progress)
        reason = prof.noise_reason()
        if reason is None:
            prof.save(path)
            return prof
        log.warning("start-up profile %d is noise (%s); not using it", attempt + 1, reason)
    return None


def stale_reason(engine: ExecutionEngine, prof: Profile) -> str | None:
    """Why a cached profile no longer describes this machine (None: it still does): its
    STALE_CHECK_TOKENS forwards at its budget context, timed again (median of 3), are off its
    points by more than STALE_TOLERANCE either way."""
    cached = {
        p.tokens: p.ms
        for p in prof.target
        if p.context == prof.budget_context and p.tokens in STALE_CHECK_TOKENS
    }
    with ShapeTimer(engine.target, prof.budget_context) as timer:
        for tokens, ms in sorted(cached.items()):
            samples = timer.samples(tokens, 3)
            if samples is None:  # the KV pool cannot hold the shape: nothing to compare
                continue
            now = statistics.median(samples)
            if max(now / ms, ms / now) > STALE_TOLERANCE:
                return (
                    f"a {tokens}-token forward takes {now:.1f} ms now, {ms:.1f} ms in the "
                    f"profile of {prof.created_at}"
                )
    return None


def refresh_startup_profile(engine: ExecutionEngine, cost_model: ForwardCostModel) -> Path | None:
    """Store a running server's fitted cost model in its cached start-up profile, unless it
    contradicts the profile's measured points (more than FIT_TOLERANCE off): then the next
    start would inherit one run's distortion (None, nothing stored)."""
    path = startup_profile_path(engine)
    try:
        prof = Profile.load(path)
    except (OSError, ValueError):
        return None
    off = prof.fit_disagreement(cost_model)
    if off > FIT_TOLERANCE:
        log.warning(
            "not storing the fitted cost model in %s: %.1fx off the measured points", path, off
        )
        return None
    return replace(prof, cost_model=json.loads(cost_model.to_json())).save(path)


def record_cost_model(
    engine: ExecutionEngine, cost_model: ForwardCostModel, budget: int, path: str | Path
) -> Path:
    """A profile of what a running server measured: its online cost model (forwards as they
    cost while serving: other threads, the clients, the host's own load) and points read off
    it, for `adaserve simulate --cost-model` (or `serve --profile`)."""
    counts = sorted({*range(1, 9), 12, 16, 32, 64, budget})
    points = tuple(
        LatencyPoint(n, ctx, 1000.0 * cost_model.predict(n, ctx * len(split_tokens(n, NUM_SEQS))))
        for ctx in (64, BUDGET_CONTEXT, 1024)
        for n in counts
    )
    baseline = 1000.0 * cost_model.predict(BASELINE_BATCH, BASELINE_BATCH * BASELINE_INPUT)
    prof = Profile(
        device=str(engine.target.device),
        model=engine.target_path.name,
        draft_model=engine.draft_path.name if engine.draft_path is not None else None,
        target=points,
        draft=(),
        budget=budget,
        budget_factor=DEFAULT_BUDGET_FACTOR,
        budget_context=BUDGET_CONTEXT,
        baseline_latency_ms=baseline,
        cost_model=json.loads(cost_model.to_json()),
        backend=getattr(engine, "backend", "torch"),
    )
    return prof.save(path)
