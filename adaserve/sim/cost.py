"""Forward cost models for simulation: a measured profile, or a roofline of a GPU and a model.

A cost model prices one forward from what the batch holds: `tokens` new tokens (padding
included), `context` cached KV entries read (summed over sequences) and `pairs`, the
query x key pairs attention computes (sum over sequences of new x (cached + new)).

Roofline (per GPU, tensor parallel degree `tp`, one forward):

    bytes = (weight bytes + context x KV bytes per token) / tp
    flops = (2 x parameters x tokens + 4 x layers x hidden x pairs) / tp
    time  = max(bytes / bandwidth, flops / peak) / efficiency
            + layers x (kernel overhead + [tp > 1] 2 all-reduces of tokens x hidden x 2 bytes)

Half-precision weights and KV. The efficiency factor (default 0.7) stands for what real
kernels reach of the peaks; the per-layer overhead for kernel launches with CUDA graphs.

Table (`table:TOKENS:MS,...@MODEL@GPU[xTP]`, or a named preset): a measured verify latency
per token count, piecewise linear between the points, the first point's time below it and
the last segment's slope above it; the context term is the roofline's of MODEL@GPU, what
reading `context` KV entries and computing `pairs` attention pairs adds over a forward with
no context (the table's own forwards ran at little context).
"""

from __future__ import annotations

import bisect
import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

from adaserve.exec.timing import NUM_SEQS
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.control.profile import BUDGET_CONTEXT, Profile, derive_budget

BYTES_PER_PARAM = 2  # fp16 / bf16 weights and KV
DEFAULT_EFFICIENCY = 0.7
LAYER_OVERHEAD_S = 20e-6  # kernel launches and small ops per decoder layer
ALLREDUCE_LATENCY_S = 8e-6  # one NVLink all-reduce of a small message
# Memory the runtime keeps for activations, graphs and fragmentation.
KV_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bandwidth_gb_s: float  # HBM
    peak_tflops: float  # dense fp16/bf16 tensor cores
    link_gb_s: float  # NVLink per GPU, one direction


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def parameters(self) -> float:
        """Weights read by a forward: attention, gated MLP, embeddings in and out."""
        attn = self.hidden * (self.hidden + 2 * self.kv_heads * self.head_dim) + self.hidden**2
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attn + mlp) + 2 * self.vocab * self.hidden

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * BYTES_PER_PARAM


# Datasheet numbers (SXM parts, dense, no sparsity).
GPUS = {
    g.name: g
    for g in (
        GPU("a100-80g", 80, 2039, 312, 300),
        GPU("h100-sxm", 80, 3350, 989, 450),
        GPU("h200", 141, 4800, 989, 450),
    )
}
# Published configs. llama-160m is the paper's draft (Felladrin/Llama-160M-Chat-v1).
MODELS = {
    m.name: m
    for m in (
        ModelSpec("llama-2-7b", 32, 4096, 32, 32, 11008, 32000),
        ModelSpec("llama-2-13b", 40, 5120, 40, 40, 13824, 32000),
        ModelSpec("llama-2-70b", 80, 8192, 64, 8, 28672, 32000),
        ModelSpec("llama-3.1-8b", 32, 4096, 32, 8, 14336, 128256),
        ModelSpec("llama-3.1-70b", 80, 8192, 64, 8, 28672, 128256),
        ModelSpec("llama-160m", 12, 768, 12, 12, 3072, 32000),
        ModelSpec("qwen2.5-32b", 64, 5120, 40, 8, 27648, 152064),
    )
}
# The verify-latency tables of the AdaServe artifact (zikun-li/AdaServe-Artifact-Evaluation,
# exps/test.sh): tokens in the forward -> ms, on the paper's 4 x A100-80G node. The artifact
# lists 0 -> 0 as its first point; a forward of one token costs about the baseline latency
# (30 ms for Llama-3.1-70B in the artifact; for Qwen2.5-32B the 128 -> 256 slope extended
# down to one token gives 30 ms too), which is the point used instead.
TABLE_PRESETS = {
    "llama-3.1-70b-artifact": (
        "llama-3.1-70b@a100-80gx4",
        (
            (1, 30.0),
            (128, 55.0),
            (256, 85.0),
            (384, 105.0),
            (512, 125.0),
            (640, 145.0),
            (768, 165.0),
            (896, 185.0),
            (1024, 205.0),
        ),
    ),
    "qwen2.5-32b-artifact": (
        "qwen2.5-32b@a100-80gx4",
        (
            (1, 30.0),
            (128, 48.0),
            (256, 66.0),
            (384, 84.0),
            (512, 104.0),
            (640, 124.0),
            (768, 144.0),
            (896, 164.0),
            (1024, 188.0),
        ),
    ),
}


@dataclass(frozen=True)
class ForwardNoise:
    """Multiplicative noise on simulated forwards: drawn from a server's measured log errors
    (`quantiles`: (level, log(measured / predicted)) pairs, centered on their median, so a
    typical forward costs what the model says and the rare hiccup stays rare), or log-normal
    with `sigma` when no quantiles are known."""

    sigma: float = 0.0
    quantiles: tuple[tuple[float, float], ...] = ()

    def factor(self, rng: random.Random) -> float:
        if len(self.quantiles) >= 2:
            levels = [q for q, _ in self.quantiles]
            values = [e for _, e in self.quantiles]
            median = _at(levels, values, 0.5)
            return math.exp(_at(levels, values, rng.random()) - median)
        return math.exp(rng.gauss(0.0, self.sigma)) if self.sigma else 1.0

    def describe(self) -> str:
        if len(self.quantiles) >= 2:
            return f"measured (sigma {self.sigma:.3f}, {len(self.quantiles)} quantiles)"
        return f"log-normal sigma {self.sigma:.3f}" if self.sigma else "none"


def _at(levels: list[float], values: list[float], u: float) -> float:
    """Piecewise-linear inverse CDF through (level, value) points."""
    i = min(max(bisect.bisect_left(levels, u), 1), len(levels) - 1)
    lo, hi = levels[i - 1], levels[i]
    w = 0.0 if hi == lo else (u - lo) / (hi - lo)
    return values[i - 1] + min(max(w, 0.0), 1.0) * (values[i] - values[i - 1])


class CostModel(ABC):
    """Seconds of one forward; `kv_tokens` is how many tokens of KV the deployment holds."""

    name = "?"
    kv_tokens: int | None = None
    # How real forwards strayed from this model's prediction, when a running server measured
    # it (`serve --record-cost-model`); None: not known.
    noise: ForwardNoise | None = None
    # The backend whose forwards these are: "ggml" (llama.cpp) pads no forward and caches no
    # prefix, so a simulation of it does neither.
    backend = "torch"

    @abstractmethod
    def seconds(
        self,
        tokens: int,
        context: int,
        pairs: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> float:
        """One forward of `tokens` new tokens reading `context` cached entries (`pairs`
        query-key pairs in all), `silent` of the tokens returning no logits and computing
        `silent_pairs` of the pairs, tree nodes past their roots `tree_pairs`
        (`ForwardBatch.cost_terms`)."""

    def scheduler_model(self, forget: float) -> ForwardCostModel | None:
        """The cost model the simulated server's scheduler starts with, when a real server
        would start with one (None: seed it from the start-up curve, as a fresh server)."""
        return None

    def curve(self, tokens: int, context_per_seq: int, num_seqs: int) -> float:
        """A forward of `tokens` spread over `num_seqs` sequences of `context_per_seq` each."""
        seqs = max(1, min(tokens, num_seqs))
        q = tokens / seqs
        return self.seconds(tokens, seqs * context_per_seq, int(seqs * q * (context_per_seq + q)))


class RooflineCost(CostModel):
    def __init__(
        self,
        model: ModelSpec,
        gpu: GPU,
        tp: int = 1,
        efficiency: float = DEFAULT_EFFICIENCY,
    ) -> None:
        if tp < 1:
            raise ValueError(f"tensor parallel degree must be >= 1, got {tp}")
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        self.model, self.gpu, self.tp, self.efficiency = model, gpu, tp, efficiency
        self.name = f"roofline {model.name} on {tp} x {gpu.name} (efficiency {efficiency:g})"
        weights = model.parameters * BYTES_PER_PARAM
        free = tp * gpu.memory_gb * 1e9 * KV_MEMORY_FRACTION - weights
        if free <= 0:
            raise ValueError(
                f"{model.name} ({weights / 1e9:.0f} GB of weights) does not fit on {tp} x "
                f"{gpu.name}; raise the tensor parallel degree"
            )
        self.kv_tokens = int(free // model.kv_bytes_per_token)

    def seconds(
        self,
        tokens: int,
        context: int,
        pairs: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> float:
        # `pairs` has every token's attention; silent rows skip the LM head, 1-2% of these
        # models' weights per row: not modelled.
        m, g = self.model, self.gpu
        byts = (m.parameters * BYTES_PER_PARAM + context * m.kv_bytes_per_token) / self.tp
        flops = (2 * m.parameters * tokens + 4 * m.layers * m.hidden * pairs) / self.tp
        t = max(byts / (g.bandwidth_gb_s * 1e9), flops / (g.peak_tflops * 1e12)) / self.efficiency
        per_layer = LAYER_OVERHEAD_S
        if self.tp > 1:  # two all-reduces per layer (attention out, MLP out)
            msg = tokens * m.hidden * BYTES_PER_PARAM
            per_layer += 2 * (ALLREDUCE_LATENCY_S + msg / (g.link_gb_s * 1e9))
        return t + m.layers * per_layer


class TableCost(CostModel):
    """A measured tokens -> ms table, plus the roofline's context term of `context_of`."""

    def __init__(
        self, points: tuple[tuple[int, float], ...], context_of: RooflineCost, name: str
    ) -> None:
        pts = sorted(points)
        if len(pts) < 2:
            raise ValueError(f"a cost table needs at least two TOKENS:MS points, got {pts}")
        tokens = [t for t, _ in pts]
        if len(set(tokens)) != len(tokens) or tokens[0] < 1:
            raise ValueError(f"table token counts must be distinct and >= 1, got {tokens}")
        if any(ms <= 0 for _, ms in pts) or any(b[1] < a[1] for a, b in zip(pts, pts[1:])):
            raise ValueError(f"table times must be > 0 and not fall as tokens grow, got {pts}")
        self.points, self.context_of, self.name = tuple(pts), context_of, name
        self.kv_tokens = context_of.kv_tokens

    def table_ms(self, tokens: int) -> float:
        """The table at `tokens`: flat below the first point, linear between points, the last
        segment's slope beyond the last."""
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        i = min(bisect.bisect_left([t for t, _ in pts], tokens), len(pts) - 1)
        (t0, m0), (t1, m1) = pts[i - 1], pts[i]
        return m0 + (tokens - t0) * (m1 - m0) / (t1 - t0)

    def seconds(
        self,
        tokens: int,
        context: int,
        pairs: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> float:
        tokens = max(1, tokens)
        roof = self.context_of
        extra = roof.seconds(tokens, context, pairs) - roof.seconds(tokens, 0, 0)
        return self.table_ms(tokens) / 1000.0 + extra


def parse_table(spec: str, efficiency: float) -> TableCost:
    """'PRESET' or 'TOKENS:MS,TOKENS:MS,...@MODEL@GPU[xTP]' (the part after 'table:')."""
    if spec in TABLE_PRESETS:
        preset_hw, preset = TABLE_PRESETS[spec]
        roof = parse_roofline(preset_hw, efficiency)
        return TableCost(preset, roof, f"table {spec} ({preset_hw})")
    text, sep, hw = spec.partition("@")
    if not sep:
        raise ValueError(
            f"a table cost model is table:TOKENS:MS,...@MODEL@GPU[xTP] (the model and GPU "
            f"price the context) or one of {', '.join(TABLE_PRESETS)}; got {spec!r}"
        )
    points: list[tuple[int, float]] = []
    for item in text.split(","):
        t, colon, ms = item.partition(":")
        try:
            if not colon:
                raise ValueError
            points.append((int(t), float(ms)))
        except ValueError:
            raise ValueError(f"a table point is TOKENS:MS (e.g. 128:55), got {item!r}") from None
    return TableCost(tuple(points), parse_roofline(hw, efficiency), f"table {text} ({hw})")


class ProfileCost(CostModel):
    """The fitted cost model an `adaserve profile` (or a server's start-up profile) stored."""

    def __init__(self, model: ForwardCostModel, name: str, backend: str = "torch") -> None:
        self.model, self.name, self.backend = model, name, backend

    def seconds(
        self,
        tokens: int,
        context: int,
        pairs: int,
        silent: int = 0,
        silent_pairs: int = 0,
        tree_pairs: int = 0,
    ) -> float:
        tokens = max(1, tokens)
        return self.model.predict(tokens, context, min(silent, tokens), silent_pairs, tree_pairs)

    def scheduler_model(self, forget: float) -> ForwardCostModel:
        # A server started with this profile (`serve --profile`, or its cached start-up
        # profile, which the last server refreshed) starts from these coefficients.
        return ForwardCostModel.from_json(self.model.to_json(), forget=forget)


@dataclass(frozen=True)
class CostSpec:
    """What `--cost-model` (and `--draft-cost-model`) named, resolved."""

    target: CostModel
    draft: CostModel | None  # None: the profile has no draft curve / no draft config given


def parse_roofline(spec: str, efficiency: float) -> RooflineCost:
    """'MODEL@GPU' or 'MODEL@GPUxTP', e.g. 'llama-2-70b@a100-80gx4'."""
    model_name, sep, hw = spec.partition("@")
    if not sep:
        raise ValueError(f"a roofline cost model is MODEL@GPU[xTP], got {spec!r}")
    gpu_name, _, tp_text = hw.partition("x")
    if model_name not in MODELS:
        raise ValueError(f"unknown model {model_name!r}; known: {', '.join(MODELS)}")
    if gpu_name not in GPUS:
        raise ValueError(f"unknown GPU {gpu_name!r}; known: {', '.join(GPUS)}")
    try:
        tp = int(tp_text) if tp_text else 1
    except ValueError:
        raise ValueError(f"tensor parallel degree must be an integer, got {tp_text!r}") from None
    return RooflineCost(MODELS[model_name], GPUS[gpu_name], tp, efficiency)


def load_cost(
    spec: str, draft_spec: str | None = None, efficiency: float = DEFAULT_EFFICIENCY
) -> CostSpec:
    """`spec`: a profile JSON path, 'roofline:MODEL@GPU[xTP]' or 'table:...'; `draft_spec`
    likewise."""
    return CostSpec(_one(spec, efficiency, "target"), _draft(spec, draft_spec, efficiency))


def _one(spec: str, efficiency: float, which: str) -> CostModel:
    if spec.startswith("roofline:"):
        return parse_roofline(spec.removeprefix("roofline:"), efficiency)
    if spec.startswith("table:"):
        return parse_table(spec.removeprefix("table:"), efficiency)
    prof = Profile.load(spec)
    if which == "target":
        model = prof.forward_cost_model()
        where = f"{prof.model} on {prof.device}, {prof.backend}"
        cost = ProfileCost(model, f"profile {Path(spec).name} ({where})", prof.backend)
        error = (prof.cost_model or {}).get("log_error")
        if error:
            levels = tuple((float(q), float(e)) for q, e in error.get("quantiles", ()))
            cost.noise = ForwardNoise(float(error["sigma"]), levels)
        return cost
    if not prof.draft:
        raise ValueError(f"{spec} has no draft measurements (profile it with a draft model)")
    model = ForwardCostModel()
    model.seed((p.tokens, p.context * min(p.tokens, 8), p.ms / 1000.0) for p in prof.draft)
    return ProfileCost(model, f"draft of profile {Path(spec).name} ({prof.draft_model})")


def _draft(spec: str, draft_spec: str | None, efficiency: float) -> CostModel | None:
    if draft_spec is not None:
        target = _one(spec, efficiency, "target") if _is_named(spec) else None
        if draft_spec in MODELS and target is not None:
            # A bare model name: the draft runs on one GPU of the target's kind.
            roof = target.context_of if isinstance(target, TableCost) else target
            assert isinstance(roof, RooflineCost)
            return RooflineCost(MODELS[draft_spec], roof.gpu, 1, efficiency)
        return _one(draft_spec, efficiency, "draft")
    if _is_named(spec):
        return None
    try:
        return _one(spec, efficiency, "draft")
    except ValueError:
        return None


def _is_named(spec: str) -> bool:
    """A cost model from the command line itself (roofline or table), not a profile file."""
    return spec.startswith(("roofline:", "table:"))


def baseline_latency_ms(cost: CostModel, batch: int = 8, prompt: int = 32) -> float:
    """The paper's baseline latency: the cheapest iteration of batch-8 incremental decoding
    with 32-token prompts (its first decode step, with the least context)."""
    return 1000.0 * cost.seconds(batch, batch * prompt, batch * (prompt + 1))


def derive_sim_budget(cost: CostModel, factor: float) -> int:
    """B by the profile's rule, on the cost model's curve (256 context, up to 8 sequences)."""
    counts = [2**k for k in range(0, 11)]
    latency = {n: 1000.0 * cost.curve(n, BUDGET_CONTEXT, NUM_SEQS) for n in counts}
    return derive_budget(latency, factor)


def fmt_s(seconds: float) -> str:
    return f"{1000 * seconds:.2f} ms" if math.isfinite(seconds) else "inf"
