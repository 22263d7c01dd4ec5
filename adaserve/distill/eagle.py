"""Train an EAGLE head (`exec/model/eagle.py`) on the target's own text and features.

1. Features: the target's final hidden states f_t of every generated sequence, computed once
   (one causal forward per sequence batch) and cached as float16 in WORK/eagle-features-*.pt.
2. Training, per sequence and row t (reads f_t and x_{t+1}, predicts f_{t+1} and x_{t+2}):

       loss = sum over steps s of  decay^(s-1) * mean over rows [ reg * SmoothL1(f'_s, f_{t+1})
                                                                + cls * CE(p_t+1, q'_s) ]

   p_{t+1} = softmax of the target's logits at t+1 over the K-token draft vocabulary (the
   target's own distribution, not the sampled token), q'_s the head's. Step 1 reads the
   target's features; step s >= 2 ("training-time test", as EAGLE-3) reads the head's own
   step s-1 output at the row before, as drafting does at depth s, and attends exactly what a
   depth-s draft row attends: the real rows up to t-s+1 and its own earlier steps' rows
   t-s+2 .. t. Input features get uniform noise (`noise` x their RMS), as EAGLE does.
3. Evaluation: on held-out sequences (topics never trained on), the top-1 agreement of the
   head with the target's greedy token at depth 1..4 (teacher-forced earlier tokens, the
   head's own features), at rows that predict completion tokens.

Resumable like `train.py`: checkpoints with AdamW and schedule state, the data order a
function of (seed, epoch), refused on resume with other trajectory settings.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from adaserve.distill.checkpoint import TrainingRun
from adaserve.distill.data import Sequences
from adaserve.distill.train import EpochOrder, lr_factor
from adaserve.exec.model.eagle import EagleHead, head_from_target, save_eagle_head
from adaserve.exec.model.llama import LlamaForCausalLM

_RESUMABLE_CHANGES = ("save_every", "eval_every", "device")
EVAL_DEPTHS = 4


@dataclass(frozen=True)
class EagleConfig:
    epochs: float = 4.0
    max_steps: int | None = None
    batch_size: int = 8
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    max_len: int = 384
    reg_weight: float = 1.0
    cls_weight: float = 0.5
    ttt_steps: int = 2  # training-time-test unroll depth (1: EAGLE-1, step 1 only)
    step_decay: float = 0.8
    noise: float = 0.05  # uniform noise half-width, as a fraction of the features' RMS
    vocab_size: int = 16384  # draft vocabulary K (the target's most frequent tokens)
    init_layer: int | None = None  # target layer the head's layer starts from (None: last)
    seed: int = 0
    save_every: int = 50
    eval_every: int = 0
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("batch_size", "max_len", "save_every", "ttt_steps", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")


@dataclass
class EagleResult:
    step: int
    total_steps: int
    finished: bool
    history: list[dict] = field(default_factory=list)
    agreement: list[float] | None = None  # held-out, depth 1..EVAL_DEPTHS


# ---------------------------------------------------------------------------- features


@torch.no_grad()
def target_features(
    target: LlamaForCausalLM, seqs: Sequences, max_len: int, batch_tokens: int = 4096
) -> list[torch.Tensor]:
    """Final hidden states [L, H] (float16) of every sequence (truncated to max_len)."""
    from adaserve.distill.evaluate import pad_batch

    out: list[torch.Tensor] = []
    order = sorted(range(len(seqs)), key=lambda i: len(seqs.tokens[i]))
    feats: dict[int, torch.Tensor] = {}
    i = 0
    while i < len(order):
        width = min(len(seqs.tokens[order[i]]), max_len)
        n = max(1, batch_tokens // max(width, 1))
        group = order[i : i + n]
        ids, mask = pad_batch([seqs.tokens[j] for j in group], "cpu", max_len)
        hidden = causal_hidden(target, ids)  # [B, T, H]
        for row, j in enumerate(group):
            feats[j] = hidden[row, : int(mask[row].sum())].to(torch.float16)
        i += n
    out = [feats[j] for j in range(len(seqs))]
    return out


def causal_hidden(model: LlamaForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Our model's final hidden states over right-padded sequences [B, T] -> [B, T, H]."""
    b, t = ids.shape
    attn = _DenseAttention(b, t)
    pos = torch.arange(t).repeat(b)
    return model(ids.reshape(-1), pos, attn).view(b, t, -1)


def load_or_compute_features(
    target: LlamaForCausalLM, seqs: Sequences, path: Path, max_len: int
) -> list[torch.Tensor]:
    key = {"sequences": len(seqs), "tokens": seqs.num_tokens, "max_len": max_len}
    if path.exists():
        state = torch.load(path, weights_only=False)
        if state["key"] == key:
            return state["features"]
    feats = target_features(target, seqs, max_len)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({"key": key, "features": feats}, tmp)
    tmp.rename(path)
    return feats


# ---------------------------------------------------------------------------- attention


class _DenseAttention:
    """Causal attention over B right-padded sequences of T tokens (flat [B*T] rows)."""

    def __init__(self, b: int, t: int) -> None:
        self.b, self.t = b, t

    def forward(self, q, k, v, layer):  # [B*T, H, D]
        b, t = self.b, self.t
        q, k, v = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * t, -1, out.shape[-1])


class UnrollAttention:
    """Attention for training-time test: step s's rows see the keys of steps 1..s as a
    depth-s draft row does (module doc). Call `next_step()` before each step's forward."""

    def __init__(self, b: int, t: int) -> None:
        self.b, self.t, self.step = b, t, 0
        self.keys: list[tuple[torch.Tensor, torch.Tensor]] = []

    def next_step(self) -> None:
        self.step += 1

    def mask(self, s: int) -> torch.Tensor:
        """[T, s*T] bool: row t of step s sees step-1 rows <= t-s+1, step-s' row t-s+s'."""
        t = torch.arange(self.t)
        parts = [t[None, :] <= (t[:, None] - s + 1)]
        for s2 in range(2, s + 1):
            parts.append(t[None, :] == (t[:, None] - s + s2))
        return torch.cat(parts, dim=1)

    def forward(self, q, k, v, layer):  # [B*T, H, D]
        b, t = self.b, self.t
        q, k, v = (x.view(b, t, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        self.keys.append((k, v))
        ks = torch.cat([kk for kk, _ in self.keys], dim=2)
        vs = torch.cat([vv for _, vv in self.keys], dim=2)
        out = F.scaled_dot_product_attention(
            q, ks, vs, attn_mask=self.mask(self.step).to(q.device), enable_gqa=True
        )
        return out.transpose(1, 2).reshape(b * t, -1, out.shape[-1])


# ---------------------------------------------------------------------------- loss


def _batch(seqs: Sequences, feats: list[torch.Tensor], idx: list[int], max_len: int):
    """ids [B, T] int64, features [B, T, H] float32, mask [B, T] bool (right padded)."""
    lens = [min(len(seqs.tokens[j]), max_len) for j in idx]
    t, h = max(lens), feats[idx[0]].shape[-1]
    ids = torch.zeros(len(idx), t, dtype=torch.long)
    f = torch.zeros(len(idx), t, h)
    mask = torch.zeros(len(idx), t, dtype=torch.bool)
    for row, (j, n) in enumerate(zip(idx, lens)):
        ids[row, :n] = seqs.tokens[j][:n]
        f[row, :n] = feats[j][:n].float()
        mask[row, :n] = True
    return ids, f, mask


def unrolled_outputs(
    head: EagleHead, ids: torch.Tensor, f: torch.Tensor, steps: int, noise: float = 0.0
) -> list[torch.Tensor]:
    """Head outputs [B, T-1, H] of steps 1..`steps` over rows t = 0..T-2 (module doc)."""
    b, t = ids.shape
    rows = t - 1
    tokens = ids[:, 1:].reshape(-1)
    pos = torch.arange(rows).repeat(b)
    feat_in = f[:, :-1]
    if noise > 0:
        rms = feat_in.pow(2).mean().sqrt()
        feat_in = feat_in + (torch.rand_like(feat_in) * 2 - 1) * noise * rms
    attn = UnrollAttention(b, rows)
    outs = []
    for _ in range(steps):
        attn.next_step()
        o = head(tokens, pos, attn, feat_in.reshape(b * rows, -1)).view(b, rows, -1)
        outs.append(o)
        # Step s+1's row t reads step s's output at row t-1 (its predicted f_t).
        feat_in = torch.cat([torch.zeros_like(o[:, :1]), o[:, :-1]], dim=1)
    return outs


def eagle_loss(
    head: EagleHead, ids: torch.Tensor, f: torch.Tensor, mask: torch.Tensor, cfg: EagleConfig
) -> tuple[torch.Tensor, dict]:
    outs = unrolled_outputs(head, ids, f, cfg.ttt_steps, cfg.noise)
    want_f = f[:, 1:]  # f_{t+1}
    with torch.no_grad():
        p = torch.softmax(head.compute_logits(want_f), dim=-1)  # target's q(x_{t+2}) over K
    total = torch.zeros(())
    info: dict = {}
    rows = torch.arange(want_f.shape[1])
    for s, o in enumerate(outs, start=1):
        valid = mask[:, 1:] & (rows >= s - 1)[None, :]
        if not valid.any():
            continue
        reg = F.smooth_l1_loss(o[valid], want_f[valid])
        logq = torch.log_softmax(head.compute_logits(o[valid]), dim=-1)
        cls = -(p[valid] * logq).sum(-1).mean()
        total = total + cfg.step_decay ** (s - 1) * (cfg.reg_weight * reg + cfg.cls_weight * cls)
        agree = (logq.argmax(-1) == p[valid].argmax(-1)).float().mean()
        info[f"agree{s}"] = float(agree)
        if s == 1:
            info["reg"], info["cls"] = float(reg.detach()), float(cls.detach())
    return total, info


@torch.no_grad()
def held_out_agreement(
    head: EagleHead,
    seqs: Sequences,
    feats: list[torch.Tensor],
    max_len: int,
    depths: int = EVAL_DEPTHS,
    batch_size: int = 8,
) -> list[float]:
    """Top-1 agreement with the target's greedy token at depth 1..`depths`, at rows whose
    predicted token is a completion token (held-out completions are greedy)."""
    was = head.training
    head.eval()
    hits, totals = [0] * depths, [0] * depths
    for i in range(0, len(seqs), batch_size):
        idx = list(range(i, min(i + batch_size, len(seqs))))
        ids, f, mask = _batch(seqs, feats, idx, max_len)
        outs = unrolled_outputs(head, ids, f, depths)
        rows = torch.arange(ids.shape[1] - 1)
        for s, o in enumerate(outs, start=1):
            for row, j in enumerate(idx):
                n = int(mask[row].sum())
                # row t predicts x_{t+2}: a completion token, existing, reachable at depth s
                first = max(seqs.prompt_lens[j] - 2, s - 1)
                sel = (rows >= first) & (rows + 2 < n)
                if not sel.any():
                    continue
                logits = head.compute_logits(o[row][sel])
                guess = logits.argmax(-1)
                if head.head_token_ids is not None:
                    guess = head.head_token_ids[guess]
                want = ids[row, rows[sel] + 2]
                hits[s - 1] += int((guess == want).sum())
                totals[s - 1] += int(sel.sum())
    head.train(was)
    return [h / t if t else 0.0 for h, t in zip(hits, totals)]


# ---------------------------------------------------------------------------- training


def train_eagle(
    target: LlamaForCausalLM,
    vocab_ids: torch.Tensor | None,
    data: Sequences,
    feats: list[torch.Tensor],
    work_dir: Path,
    out_dir: Path,
    cfg: EagleConfig,
    held_out: tuple[Sequences, list[torch.Tensor]] | None = None,
    stop_after: int | None = None,
    time_limit_s: float | None = None,
    progress: bool = True,
) -> EagleResult:
    """Train (or resume) a head; writes it to `out_dir` once all steps are done."""
    if len(data) == 0:
        raise ValueError("no training sequences: run `adaserve distill --phase generate` first")
    torch.manual_seed(cfg.seed)
    head = head_from_target(target, cfg.init_layer)
    head.restrict_head(vocab_ids)
    head.train()
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    per_epoch = math.ceil(len(data) / cfg.batch_size)
    total = cfg.max_steps or max(1, math.ceil(cfg.epochs * per_epoch))
    run_config = {**asdict(cfg), "data_sequences": len(data), "data_tokens": data.num_tokens}
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, total, cfg.warmup_steps, cfg.min_lr_ratio)
    )
    run = TrainingRun(
        work_dir,
        work_dir / "eagle-checkpoints",
        "eagle_log.jsonl",
        "eagle",
        head,
        opt,
        sched,
        run_config,
        _RESUMABLE_CHANGES,
        total,
        cfg.save_every,
        stop_after,
        time_limit_s,
        progress,
    )
    result = EagleResult(step=run.step, total_steps=total, finished=False, history=run.history)
    order = EpochOrder(data, cfg)
    while not run.finished:
        t0 = time.monotonic()
        # The noise draw of step k is a function of (seed, k): a resumed run repeats it.
        torch.manual_seed(cfg.seed * 1_000_003 + run.step)
        ids, f, mask = _batch(data, feats, order[run.step], cfg.max_len)
        loss, info = eagle_loss(head, ids, f, mask, cfg)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        entry = {
            "step": run.step + 1,
            "loss": float(loss.detach()),
            **info,
            "lr": sched.get_last_lr()[0],
            "tokens_per_s": int(mask.sum()) / (time.monotonic() - t0),
            "minutes": (time.monotonic() - run.started) / 60,
        }
        if held_out is not None and cfg.eval_every and entry["step"] % cfg.eval_every == 0:
            entry["eval_agreement"] = held_out_agreement(head, *held_out, cfg.max_len)
        if run.record(entry, loss=f"{entry['loss']:.3f}", agree=f"{info.get('agree1', 0):.2f}"):
            break
    run.close()
    result.step = run.step
    result.finished = result.step >= total
    if result.finished:
        if held_out is not None:
            result.agreement = held_out_agreement(head, *held_out, cfg.max_len)
        meta = {
            "adaserve_eagle_training": {
                "steps": result.step,
                "config": asdict(cfg),
                "data_tokens": data.num_tokens,
                "held_out_agreement": result.agreement,
            }
        }
        save_eagle_head(head, out_dir, meta)
    return result
