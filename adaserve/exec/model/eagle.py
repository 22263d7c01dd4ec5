"""An EAGLE-style draft head: drafts from the target's own hidden states (Li et al., 2024).

Row t of the head reads the target's final hidden state f_t (after the final norm: what the
target's LM head reads) and the embedding of the token after it, x_{t+1}:

    h_t   = fc([embed(x_{t+1}), f_t])                 fc: 2H -> H, with bias
    f'_{t+1} = DecoderLayer(h_t)   at RoPE position t  (one layer; its input norm is skipped)
    logits for x_{t+2} = lm_head(f'_{t+1})            (the target's LM head, no norm: f' is
                                                       regressed onto the normed f_{t+1})

While drafting, a node's row reads the head's own output f' of its parent's row instead of a
target feature, so one decoder layer per tree level replaces a draft model's whole stack.
The embedding and LM head are the target's (shared, not stored with the head); a head may
restrict its LM head to the target's K most frequent tokens (`restrict_head`).

Checkpoint layout (the published EAGLE-1 one, so public heads load by path): `config.json`
(a Llama config with `num_hidden_layers: 1`) and `model.safetensors` or `pytorch_model.bin`
with `fc.weight` [H, 2H], `fc.bias` [H] and `layers.0.*` in Hugging Face names; an
`embed_tokens.weight` copy, if present, is ignored (the target's is used).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from adaserve.exec.attention.base import AttentionBackend
from adaserve.exec.model.llama import (
    DecoderLayer,
    Linear,
    LlamaArgs,
    LlamaForCausalLM,
    linear,
    load_hf_weights,
    rope_inv_freq,
)

HEAD_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class EagleHead(nn.Module):
    """fc + one decoder layer over [token embedding, target feature]; see the module doc."""

    # The runner feeds `features` with every forward (ForwardBatch.features).
    needs_features = True
    inv_freq: torch.Tensor  # a registered buffer (register_buffer), declared for type checkers

    def __init__(self, args: LlamaArgs) -> None:
        super().__init__()
        self.args = args
        h = args.hidden_size
        self.fc = Linear(2 * h, h, bias=True)
        self.layers = nn.ModuleList([DecoderLayer(args, 0)])
        # EAGLE's first layer reads fc's output as it is (fc already mixes two normed inputs).
        self.layers[0].input_layernorm = nn.Identity()
        self.register_buffer("inv_freq", rope_inv_freq(args), persistent=False)
        # Shared with the target (attach): not parameters of the head, never saved with it.
        self.embed_weight: torch.Tensor | None = None
        self.lm_weight: torch.Tensor | None = None
        self.head_token_ids: torch.Tensor | None = None  # reduced vocabulary, see restrict_head
        self.head_weight: torch.Tensor | None = None

    def attach(self, target: LlamaForCausalLM) -> None:
        """Use the target's embedding and LM head (same hidden size and vocabulary)."""
        t = target.args
        if t.hidden_size != self.args.hidden_size or t.vocab_size != self.args.vocab_size:
            raise ValueError(
                f"EAGLE head is for hidden size {self.args.hidden_size} and vocabulary "
                f"{self.args.vocab_size}; the target has {t.hidden_size} and {t.vocab_size}"
            )
        # Plain tensors (detached views): not registered, not saved, never trained here.
        self.embed_weight = target.embed_tokens.weight.detach()
        lm = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
        self.lm_weight = lm.detach()
        self.restrict_head(self.head_token_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        features: torch.Tensor,
    ) -> torch.Tensor:
        """input_ids, positions [T]; features [T, H] (f_t of the row) -> f'_{t+1} [T, H]."""
        assert self.embed_weight is not None, "attach() the target first"
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        emb = F.embedding(input_ids, self.embed_weight)
        x = self.fc(torch.cat([emb, features.to(emb.dtype)], dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> float32 logits [N, vocab] (or [N, K] with a reduced vocabulary)."""
        weight = self.lm_weight if self.head_weight is None else self.head_weight
        assert weight is not None, "attach() the target first"
        return linear(hidden, weight).float()

    def restrict_head(self, token_ids: torch.Tensor | None) -> None:
        """Logits only for `token_ids` [K]; column j then stands for token token_ids[j]."""
        self.head_token_ids = token_ids
        if token_ids is None or self.lm_weight is None:
            self.head_weight = None
            return
        self.head_token_ids = token_ids.to(self.lm_weight.device)
        self.head_weight = self.lm_weight[self.head_token_ids].contiguous()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        load_hf_weights(self, self.args, weights, lambda n: n in ("embed_tokens.weight",))

    def state_to_save(self) -> dict[str, torch.Tensor]:
        """The head's own tensors in the EAGLE-1 checkpoint names (q/k/v, gate/up split)."""
        a, out = self.args, {}
        for name, t in self.state_dict().items():
            if "qkv_proj" in name:
                q = a.num_heads * a.head_dim
                kv = a.num_kv_heads * a.head_dim
                for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                    out[name.replace("qkv_proj", part)] = piece.contiguous()
            elif "gate_up_proj" in name:
                for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                    out[name.replace("gate_up_proj", part)] = piece.contiguous()
            else:
                out[name] = t.contiguous()
        return out


def is_eagle_head(path: Path) -> bool:
    """A checkpoint dir holding an EAGLE head (an `fc` over [embedding, feature])."""
    path = Path(path)
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if raw.get("adaserve_eagle") or "EagleHead" in (raw.get("architectures") or []):
        return True
    names = _tensor_names(path)
    # A head has an fc and no decoder stack of its own beyond layer 0.
    return "fc.weight" in names and not any(n.startswith("model.layers.1.") for n in names)


def _tensor_names(path: Path) -> set[str]:
    st = path / "model.safetensors"
    if st.exists():
        from safetensors import safe_open

        with safe_open(str(st), framework="pt") as f:
            return set(f.keys())
    pt = path / "pytorch_model.bin"
    if pt.exists():
        return set(torch.load(pt, map_location="meta", weights_only=True))
    return set()


def head_args(path: Path) -> LlamaArgs:
    """The head's config (a Llama config with one layer), whatever architecture name it gives."""
    from transformers import LlamaConfig

    raw = json.loads((Path(path) / "config.json").read_text())
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    cfg = LlamaConfig(**raw)
    cfg.architectures = ["LlamaForCausalLM"]
    return LlamaArgs.from_hf_config(cfg)


def load_eagle_head(path: Path, target: LlamaForCausalLM) -> EagleHead:
    """Load a head from its checkpoint dir and attach it to `target` (its dtype and device)."""
    path = Path(path)
    args = head_args(path)
    if args.num_layers != 1:
        raise ValueError(f"EAGLE head at {path} has {args.num_layers} layers; adaserve runs one")
    ref = target.embed_tokens.weight
    head = EagleHead(args)
    head.inv_freq = rope_inv_freq(args)
    st, pt = (path / n for n in HEAD_WEIGHT_FILES)
    if st.exists():
        from safetensors.torch import load_file

        weights = load_file(str(st))
    elif pt.exists():
        weights = torch.load(pt, map_location="cpu", weights_only=True)
    else:
        raise FileNotFoundError(f"{path} has no {' or '.join(HEAD_WEIGHT_FILES)}")
    head.load_weights(weights.items())
    head = head.to(device=ref.device, dtype=ref.dtype)
    head.inv_freq = rope_inv_freq(args).to(ref.device)  # RoPE frequencies stay float32
    head.attach(target)
    return head.eval()


def save_eagle_head(head: EagleHead, out_dir: Path, extra: dict | None = None) -> Path:
    """Write `head` in the EAGLE-1 layout (config.json + model.safetensors, bf16)."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    a = head.args
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "adaserve_eagle": True,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": a.num_heads,
        "num_key_value_heads": a.num_kv_heads,
        "head_dim": a.head_dim,
        "rms_norm_eps": a.rms_norm_eps,
        "max_position_embeddings": a.max_position_embeddings,
        "rope_theta": a.rope_theta,
        "vocab_size": a.vocab_size,
        "tie_word_embeddings": a.tie_word_embeddings,
        **(extra or {}),
    }
    if a.rope_scaling is not None:
        config["rope_scaling"] = a.rope_scaling
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tensors = {k: v.detach().to(torch.bfloat16).cpu() for k, v in head.state_to_save().items()}
    save_file(tensors, str(out_dir / "model.safetensors"))
    return out_dir


def head_from_target(target: LlamaForCausalLM, init_layer: int | None = None) -> EagleHead:
    """A fresh head for `target`: its layer copied from target layer `init_layer` (None: the
    last) with its two output projections zeroed and fc passing the feature through, so it
    starts as f'_{t+1} = f_t and every update moves it from there (a residual-identity start:
    a copied layer alone adds outputs sized for the target's residual stream, not for f)."""
    a = target.args
    args = LlamaArgs(**{**a.__dict__, "num_layers": 1})
    head = EagleHead(args).to(target.embed_tokens.weight.dtype)
    src = target.layers[a.num_layers - 1 if init_layer is None else init_layer]
    state = {k: v for k, v in src.state_dict().items() if not k.startswith("input_layernorm")}
    head.layers[0].load_state_dict(state, strict=False)
    h = a.hidden_size
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, h:].copy_(torch.eye(h))
        head.fc.bias.zero_()
        layer = head.layers[0]
        assert isinstance(layer, DecoderLayer)  # built as one in EagleHead.__init__
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    head.attach(target)
    return head
