"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM) written for serving.

The model takes a flat batch of tokens with an explicit position per token and calls an
attention backend in every layer; it knows nothing of paging, masks or which request a
token belongs to. Weight names follow Hugging Face so checkpoints load as they are; q/k/v
and gate/up are stacked into one matmul each at load time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.exec.attention.base import AttentionBackend

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


# Most rows for which `linear` computes W x^T: past ~64 rows MKL's `x W^T` kernel is as fast
# or faster (python -m adaserve.bench.linears: 0.8-1.0x at 64-128 rows, 1.2-1.7x at 256-512).
SKINNY_MAX_ROWS = 64


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [T, in]; on CPU in float32 with 1 <= T <= 64, as W x^T.

    Both are one BLAS call over the same products; what differs is the kernel. MKL's kernel for
    `x W^T` with a few rows costs, on an AVX2 CPU, about twice a single row (the default model's
    linears: 106-149 ms at 2-16 rows against 51 at 1), where `W x^T` streams the weights once
    (48-95 ms; docs/results.md "Skinny matmuls on CPU"). Tree verification and batched decoding
    are exactly those few rows. Prompt chunks past 64 rows keep `F.linear`. One row runs as
    two, the row twice: inside a forward the 1-row product (a matrix-vector kernel, `F.linear`
    or `torch.mv` alike) made a decode step 81 ms where the same step with the row doubled
    took 68 (medians of 24, 300 cached tokens), though the linears alone time the same.
    """
    rows = x.shape[0] if x.dim() == 2 else 0
    if x.device.type != "cpu" or x.dtype != torch.float32 or not 1 <= rows <= SKINNY_MAX_ROWS:
        return F.linear(x, weight, bias)
    if rows == 1:
        out = torch.mm(weight, torch.cat([x, x]).t())[:, :1].t().contiguous()  # [1, out]
    else:
        out = torch.mm(weight, x.t()).t().contiguous()  # [T, out]
    return out if bias is None else out.add_(bias)


class Linear(nn.Linear):
    """`nn.Linear` (same parameters, same checkpoint names) computed by `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden_size] -> float32 logits [N, vocab] (or [N, K], see restrict_head)."""
        if self.head_weight is not None:
            return linear(hidden, self.head_weight).float()
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return linear(hidden, weight).float()

    def restrict_head(self, token_ids: torch.Tensor | None) -> None:
        """Compute logits only for `token_ids` [K] (a draft's reduced vocabulary); None: all.

        Logit column j then stands for token `token_ids[j]`; callers map it back.
        """
        if token_ids is None:
            self.head_token_ids = self.head_weight = None
            return
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        self.head_token_ids = token_ids.to(weight.device)  # [K] int64
        self.head_weight = weight[self.head_token_ids].contiguous()  # [K, hidden]

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
