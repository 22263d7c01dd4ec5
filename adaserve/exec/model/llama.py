"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) written for serving.

The model takes a flat batch of tokens with an explicit position per token and calls an
attention backend in every layer; it knows nothing of paging, masks or which request a
token belongs to. Weight names follow Hugging Face so checkpoints load as they are; q/k/v
and gate/up are stacked into one matmul each at load time.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.exec.attention.base import AttentionBackend

logger = logging.getLogger("adaserve.model")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class LlamaArgs:
    """The few numbers the model needs, read from a Hugging Face config."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    qkv_bias: bool
    tie_word_embeddings: bool
    sliding_window: int | None

    @classmethod
    def from_hf_config(cls, config: Any) -> LlamaArgs:
        archs = list(getattr(config, "architectures", None) or [])
        arch = archs[0] if archs else _arch_from_model_type(getattr(config, "model_type", ""))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; adaserve runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        # transformers >= 5 keeps rope in `rope_parameters`; older: rope_theta/rope_scaling.
        rope = dict(getattr(config, "rope_parameters", None) or {})
        scaling = getattr(config, "rope_scaling", None) or rope or None
        theta = rope.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
        if scaling is not None and scaling.get("rope_type", scaling.get("type")) in (
            None,
            "default",
        ):
            scaling = None
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        qkv_bias = arch == "Qwen2ForCausalLM" or bool(getattr(config, "attention_bias", False))
        window = getattr(config, "sliding_window", None)
        if arch == "Qwen2ForCausalLM" and not getattr(config, "use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=config.max_position_embeddings,
            rope_theta=float(theta),
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=window,
        )


def _arch_from_model_type(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
    }.get(model_type, model_type or "<none>")


def rope_inv_freq(args: LlamaArgs) -> torch.Tensor:
    """Inverse frequencies theta^(-2i/d), adjusted for `rope_scaling` (linear or llama3)."""
    dim = args.head_dim
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = args.rope_scaling
    if scaling is None:
        return inv_freq.float()
    kind = scaling.get("rope_type", scaling.get("type"))
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv_freq / factor).float()
    if kind != "llama3":
        raise ValueError(
            f"unsupported rope_scaling type {kind!r}; adaserve handles linear and llama3"
        )
    # llama3: long wavelengths (> old_ctx/low) are slowed by `factor`, short ones (< old_ctx/high)
    # kept, and the band between interpolates smoothly in 1/wavelength.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    smooth = ((old_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, scaled)
    scaled = torch.where(wavelen < old_ctx / high, inv_freq, scaled)
    return scaled.float()


# Most rows for which `linear` may compute W x^T: past ~64 rows MKL's `x W^T` kernel is as fast
# or faster (python -m adaserve.bench.linears: 0.8-1.0x at 64-128 rows, 1.2-1.7x at 256-512).
SKINNY_MAX_ROWS = 64
# The row counts `choose_cpu_linears` times; a row count between two is decided by the next one
# up (5-8 rows by 8, 9-16 by 16). 3 is its own point: MKL's F.linear streams the weights at 1-3
# rows and changes kernel at 4 (the default model's linears on a 2-vCPU AMD EPYC: 24.1 ms at 3
# rows, 37.5 at 4, packed weights 28.1 and 26.1), so 3 rows decided by 4 ran packed, 4 ms
# slower, in every forward of three decode rows or one row and a two-node tree.
SKINNY_POINTS = (1, 2, 3, 4, 8, 16, 32, 64)
# Weights smaller than this stay in the CPU's caches, where the two kernels' difference is
# noise: models that small keep the default (W x^T) without timing anything.
SKINNY_MIN_BYTES = 64 << 20
# F.linear is chosen for a row count only when it is this much faster than W x^T: the default
# stands on a near tie (inside a forward the AVX2 EPYC ran one row 16% faster doubled than
# F.linear, which the linears timed alone did not show).
SKINNY_MARGIN = 0.9

# oneDNN's blocked weight layout (`pack_cpu_weight`) is laid out for about this many rows; it
# serves any row count (on the Xeon here 8 and 64 timed alike from 1 to 256 rows, 1 slower).
PACK_ROWS_HINT = 8
# The row count that decides packed weights for prompt chunks (more than SKINNY_MAX_ROWS rows).
PACK_LARGE_ROWS = 128

# Per row count (index), whether `linear` runs F.linear: all False until `choose_cpu_linears`
# times the model's own weights. One table per process, set by the largest model timed.
_F_LINEAR_ROWS: list[bool] = [False] * (SKINNY_MAX_ROWS + 1)
# Per row count, whether a weight packed by `pack_cpu_weight` runs (index SKINNY_MAX_ROWS + 1:
# any count past SKINNY_MAX_ROWS); all False until `choose_cpu_linears` timed it faster.
_PACKED_ROWS: list[bool] = [False] * (SKINNY_MAX_ROWS + 2)
_CHOSEN: dict[tuple, tuple[list[bool], list[bool]]] = {}
_APPLIED_BYTES = [0]  # the weights' size behind the table `linear` follows


def pack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] re-laid out once in oneDNN's blocked format for `linear`'s `packed`,
    or None where that cannot be done (not float32 on CPU, a torch without oneDNN). The result
    is a copy (as many floats) that only `_packed_linear` can read."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)
    except (AttributeError, RuntimeError):  # an op this build of torch does not have
        return None


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    packed: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [T, in]; on CPU in float32 with 1 <= T <= 64, as W x^T
    unless `choose_cpu_linears` found F.linear faster for T rows on this machine; with
    `packed` (`pack_cpu_weight(weight)`), by oneDNN over it for the row counts where
    `choose_cpu_linears` timed that faster than both.

    Packed: on the AVX-512 Xeon here F.linear took 61-84 ms over the default model's linears
    at 1-8 rows and 339 at 128, the packed weights 22-29 and 190 (docs/results.md, "Weights
    packed once"): F.linear goes through oneDNN too and lays the weight out again in every
    call. Not for a product whose gradient is wanted (oneDNN's op has none).

    Both are one BLAS call over the same products; what differs is the kernel, and which is
    faster depends on the CPU and the BLAS. On an AVX2 EPYC, MKL's kernel for `x W^T` with a
    few rows cost about twice a single row (the default model's linears: 106-149 ms at 2-16
    rows against 51 at 1), where `W x^T` streams the weights once (48-95 ms; docs/results.md
    "Skinny matmuls on CPU"), and one row ran faster doubled as two (a decode step 68 ms
    against 81). On an AVX-512 Xeon it is the other way round: F.linear streams the weights at
    memory speed at 1-3 rows (20.5 ms) and `W x^T` takes 55 ("Skinny kernels chosen by
    measuring"). Tree verification and batched decoding are exactly those few rows. Prompt
    chunks past 64 rows keep `F.linear`.
    """
    rows = x.shape[0] if x.dim() == 2 else 0
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    if (
        packed is not None
        and _PACKED_ROWS[min(rows, SKINNY_MAX_ROWS + 1)]
        and not (x.requires_grad and torch.is_grad_enabled())
    ):
        return _packed_linear(x, packed, bias)
    if not 1 <= rows <= SKINNY_MAX_ROWS:
        return F.linear(x, weight, bias)
    if _F_LINEAR_ROWS[rows]:
        return F.linear(x, weight, bias)
    return w_xt(x, weight, bias)


def w_xt(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.shape[0] == 1:
        out = torch.mm(weight, torch.cat([x, x]).t())[:, :1].t().contiguous()  # [1, out]
    else:
        out = torch.mm(weight, x.t()).t().contiguous()  # [T, out]
    return out if bias is None else out.add_(bias)


def choose_cpu_linears(weights: list[torch.Tensor], repeats: int = 3) -> list[bool] | None:
    """Time F.linear against W x^T over `weights` (a model's linears, in forward order, so they
    stream from memory as in a forward) at `SKINNY_POINTS` rows and make `linear` use the
    faster one per row count (F.linear only when it takes under `SKINNY_MARGIN` of W x^T).

    Float32 CPU weights of `SKINNY_MIN_BYTES` or more only (else None and nothing changes);
    once per process per set of weight shapes (a second model of the same shapes reuses the
    choice). `linear` follows the largest model's choice (a draft timed after its target does
    not replace it). Returns the table `linear` now follows (index: rows)."""
    if not weights or any(w.device.type != "cpu" or w.dtype != torch.float32 for w in weights):
        return None
    size = sum(w.numel() * w.element_size() for w in weights)
    if size < SKINNY_MIN_BYTES:
        return None
    key = tuple(tuple(w.shape) for w in weights)
    if key not in _CHOSEN:
        _CHOSEN[key] = _measure(weights, repeats)
    if size >= _APPLIED_BYTES[0]:  # a draft timed after its target leaves the target's choice
        _F_LINEAR_ROWS[:], _PACKED_ROWS[:] = _CHOSEN[key]
        _APPLIED_BYTES[0] = size
    return list(_F_LINEAR_ROWS)


def packed_linears_pay() -> bool:
    """Whether `choose_cpu_linears` timed packed weights faster at some row count (a model
    loaded now should pack its linears: `LlamaForCausalLM.pack_cpu_linears`)."""
    return any(_PACKED_ROWS)


def _measure(weights: list[torch.Tensor], repeats: int) -> tuple[list[bool], list[bool]]:
    packed = [pack_cpu_weight(w) for w in weights]
    can_pack = all(p is not None for p in packed)

    def run(fn, xs: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for w in weights:
            fn(xs[w.shape[1]], w, None)
        return time.perf_counter() - start

    def run_packed(xs: dict[int, torch.Tensor]) -> float:
        start = time.perf_counter()
        for w, p in zip(weights, packed):
            assert p is not None
            _packed_linear(xs[w.shape[1]], p, None)
        return time.perf_counter() - start

    times: dict[int, tuple[float, float]] = {}
    packed_times: dict[int, tuple[float, float]] = {}  # rows: (packed s, best other s)
    with torch.inference_mode():
        for point in (*SKINNY_POINTS, PACK_LARGE_ROWS):
            large = point > SKINNY_MAX_ROWS
            if large and not can_pack:
                break
            xs = {w.shape[1]: torch.randn(point, w.shape[1]) for w in weights}
            kernels: dict[str, Callable[[dict[int, torch.Tensor]], float]] = {
                "f": lambda xs: run(F.linear, xs)
            }
            if not large:
                kernels["w"] = lambda xs: run(w_xt, xs)
            if can_pack:
                kernels["p"] = run_packed
            for fn in kernels.values():
                fn(xs)  # warm each up
            taken: dict[str, list[float]] = {k: [] for k in kernels}
            for _ in range(repeats):  # interleaved, so a drift in the machine's speed hits all
                for k, fn in kernels.items():
                    taken[k].append(fn(xs))
            med = {k: statistics.median(v) for k, v in taken.items()}
            if not large:
                times[point] = (med["f"], med["w"])
            if can_pack:
                packed_times[point] = (med["p"], min(med["f"], med.get("w", math.inf)))
    table = pick_linears(times)
    packs = pick_packed(packed_times) if can_pack else [False] * (SKINNY_MAX_ROWS + 2)
    logger.info(
        "CPU linears: F.linear at %s rows, W x^T at %s, packed weights at %s%s (timed on "
        "this machine)",
        _spans([r for r in range(1, SKINNY_MAX_ROWS + 1) if table[r] and not packs[r]]),
        _spans([r for r in range(1, SKINNY_MAX_ROWS + 1) if not table[r] and not packs[r]]),
        _spans([r for r in range(1, SKINNY_MAX_ROWS + 1) if packs[r]]),
        f" and past {SKINNY_MAX_ROWS}" if packs[-1] else "",
    )
    return table, packs


def pick_packed(times: dict[int, tuple[float, float]]) -> list[bool]:
    """{rows: (packed s, the faster of F.linear and W x^T s)} at `SKINNY_POINTS` and
    PACK_LARGE_ROWS -> per row count 0..SKINNY_MAX_ROWS + 1 (the last: any count past
    SKINNY_MAX_ROWS, decided by PACK_LARGE_ROWS) whether packed weights run: where they took
    under `SKINNY_MARGIN` of the other at the next point up (`pick_linears`' rule)."""
    large = times.get(PACK_LARGE_ROWS)
    table = pick_linears({point: times[point] for point in SKINNY_POINTS})
    return table + [large is not None and large[0] < SKINNY_MARGIN * large[1]]


def pick_linears(times: dict[int, tuple[float, float]]) -> list[bool]:
    """{rows: (F.linear s, W x^T s)} at `SKINNY_POINTS` -> per row count 0..SKINNY_MAX_ROWS
    whether to run F.linear: where it took under `SKINNY_MARGIN` of W x^T at the next point
    up (a row count between two points is decided by the larger)."""
    table = [False] * (SKINNY_MAX_ROWS + 1)
    lower = 0
    for point in SKINNY_POINTS:
        f_time, w_time = times[point]
        for rows in range(lower + 1, point + 1):
            table[rows] = f_time < SKINNY_MARGIN * w_time
        lower = point
    return table


def _spans(rows: list[int]) -> str:
    """[1, 2, 3, 8] -> '1-3, 8'; [] -> 'no'."""
    out: list[str] = []
    for r in rows:
        if out and int(out[-1].split("-")[-1]) == r - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out) or "no"


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed by `linear`."""

    # The weight laid out for oneDNN (`pack_cpu_weight`), set by
    # `LlamaForCausalLM.pack_cpu_linears` where that pays; None: `linear` never uses it.
    packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 whatever the weights' dtype, as the reference implementations do.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; cos/sin [T, D/2]. Rotates the two halves of each head (HF layout)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = (
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
        )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.qkv_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(t, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(t, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = attn.forward(q, k, v, self.layer)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.intermediate = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, 2 * args.intermediate_size, bias=False)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.self_attn = Attention(args, layer)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = MLP(args)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Decoder + LM head. `forward` returns final hidden states; `compute_logits` the logits."""

    inv_freq: torch.Tensor  # a registered buffer (register_buffer), declared for type checkers

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(args, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = (
            None
            if args.tie_word_embeddings
            else Linear(args.hidden_size, args.vocab_size, bias=False)
        )
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        # A draft's reduced-vocabulary head (restrict_head): token ids and their weight rows.
        self.head_token_ids: torch.Tensor | None = None
        self.head_weight: torch.Tensor | None = None
        # The LM head's weight (or head_weight) packed for `linear` (pack_cpu_linears).
        self.head_packed: torch.Tensor | None = None
        self.linears_packed = False

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBackend
    ) -> torch.Tensor:
        """input_ids, positions: [T] int64 -> hidden [T, hidden_size]."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return self.norm(x)

    def linear_weights(self) -> list[torch.Tensor]:
        """Every weight a forward multiplies by, in forward order: the layers' linears, then the
        LM head (what `choose_cpu_linears` times)."""
        weights = [m.weight for m in self.layers.modules() if isinstance(m, Linear)]
        head = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return weights + [head]

    def pack_cpu_linears(self) -> int:
        """Give every linear (and the LM head) a copy of its weight packed for oneDNN
        (`pack_cpu_weight`), which `linear` runs at the row counts `choose_cpu_linears` timed
        it faster; returns the bytes the copies take (0 where nothing was packed).

        The copies are kept beside the weights (other code reads `weight`), so they double
        the linears' memory: a model whose copies would take more than a quarter of the
        memory free now is not packed (logged)."""
        need = sum(w.numel() * w.element_size() for w in self.linear_weights())
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
        if need > free / 4:
            logger.warning(
                "not packing the model's linears for oneDNN: the copies would take %.0f MiB "
                "of %.0f MiB free (the slower kernels run)",
                need / 2**20,
                free / 2**20,
            )
            return 0
        self.linears_packed = True
        size = 0
        for m in self.layers.modules():
            if isinstance(m, Linear):
                m.packed = pack_cpu_weight(m.weight)
                size += 0 if m.packed is None else m.packed.numel() * 4
        self.head_packed = pack_cpu_weight(self._head())
        size += 0 if self.head_packed is None else self.head_packed.numel() * 4
        logger.info("packed the model's linears for oneDNN: %.0f MiB more memory", size / 2**20)
        return size

    def _head(self) -> torch.Tensor:
        if self.head_weight is not None:
            return self.head_weight
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab] (or [N, K], see restrict_head)."""
        return linear(hidden, self._head(), packed=self.head_packed).float()

    def restrict_head(self, token_ids: torch.Tensor | None) -> None:
        """Compute logits only for `token_ids` [K] (a draft's reduced vocabulary); None: all.

        Logit column j then stands for token `token_ids[j]`; callers map it back.
        """
        if token_ids is None:
            self.head_token_ids = self.head_weight = None
            if self.linears_packed:
                self.head_packed = pack_cpu_weight(self._head())
            return
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.head_token_ids = token_ids.to(weight.device)  # [K] int64
        self.head_weight = weight[self.head_token_ids].contiguous()  # [K, hidden]
        if self.linears_packed:
            self.head_packed = pack_cpu_weight(self.head_weight)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors, stacking q/k/v and gate/up; raise if anything is missing."""
        tied = self.lm_head is None
        # Tied: some checkpoints store the lm_head copy anyway.
        load_hf_weights(self, self.args, weights, lambda n: tied and n == "lm_head.weight")


_STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_weights(
    module: nn.Module,
    args: LlamaArgs,
    weights: Iterable[tuple[str, torch.Tensor]],
    skip: Callable[[str], bool] = lambda name: False,
) -> None:
    """Load HF-named tensors into `module` (names without "model."), stacking q/k/v and
    gate/up as our layers do; tensors `skip` names are ignored; raise if anything is missing."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        name = name.removeprefix("model.")
        if "rotary_emb" in name or skip(name):
            continue
        for hf_part, (ours, shard) in _STACKED.items():
            if f".{hf_part}." in name:
                target = name.replace(hf_part, ours)
                if target not in params:
                    raise ValueError(f"checkpoint has unexpected tensor {name!r}")
                _load_shard(args, params[target], tensor, ours, shard)
                loaded.add(f"{target}#{shard}")
                break
        else:
            if name not in params:
                raise ValueError(f"checkpoint has unexpected tensor {name!r}")
            _copy_checked(params[name], tensor, name)
            loaded.add(name)
    missing = [n for n in _expected_keys(module) if n not in loaded]
    if missing:
        raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")


def _load_shard(
    args: LlamaArgs, param: nn.Parameter, tensor: torch.Tensor, kind: str, shard: int
) -> None:
    a = args
    if kind == "qkv_proj":
        sizes = [a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.num_kv_heads * a.head_dim]
    else:
        sizes = [a.intermediate_size, a.intermediate_size]
    start = sum(sizes[:shard])
    _copy_checked(param.data[start : start + sizes[shard]], tensor, f"{kind}[{shard}]")


def _expected_keys(module: nn.Module) -> list[str]:
    keys = []
    for name, _ in module.named_parameters():
        if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
            keys += [f"{name}#{i}" for i in range(3)]
        elif name.endswith("gate_up_proj.weight"):
            keys += [f"{name}#{i}" for i in range(2)]
        else:
            keys.append(name)
    return keys


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(src.shape)}, model expects {tuple(dst.shape)}"
        )
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))
