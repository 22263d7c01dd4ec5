"""`adaserve distill`: generate text with the target, train a draft on it, measure the draft.

    adaserve distill [TARGET] [--phase all|generate|train|eval|export|assemble] [options]

`all` runs generate, train and eval. `--method eagle` trains an EAGLE head on the target's
hidden states instead of a standalone draft (docs/eagle.md). `export` writes the draft's own
tensors (not the embedding it shares with the target) to `--ship-file`, small enough for a
repository; `assemble` rebuilds the draft dir `--out` from that file and the target.

Every phase resumes: finished data shards are not regenerated, training continues from its
last checkpoint, so the same command can simply be run again after an interruption.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

PHASES = ("all", "generate", "train", "eval", "export", "assemble")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _layers(text: str) -> tuple[int, ...]:
    """'0,29' -> (0, 29); 'none' -> () (random initialisation)."""
    return () if text.strip().lower() == "none" else tuple(int(x) for x in text.split(","))


def add_arguments(p: argparse.ArgumentParser) -> None:
    from adaserve.distill.data import GenerateConfig
    from adaserve.distill.train import TrainConfig

    g, t = GenerateConfig(), TrainConfig()
    p.add_argument(
        "target",
        nargs="?",
        default=None,
        help="target checkpoint dir or .gguf (default: SmolLM2-135M-Instruct)",
    )
    p.add_argument("--phase", choices=PHASES, default="all", help="which step to run")
    p.add_argument(
        "--method",
        choices=("draft", "eagle"),
        default="draft",
        help="draft: a standalone draft model; eagle: a head on the target's hidden states "
        "(default out: CACHE/models/TARGET_NAME-eagle)",
    )
    p.add_argument(
        "--work-dir",
        default=None,
        help="data shards, checkpoints, logs (default: CACHE/distill/TARGET_NAME)",
    )
    p.add_argument(
        "--data-dir",
        default=None,
        help="generated shards (default: WORK_DIR/data); lets several drafts share one data set",
    )
    p.add_argument(
        "--out",
        default=None,
        help="the draft checkpoint dir written (default: CACHE/models/TARGET_NAME-draft-distilled)",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu or cuda[:N]; CUDA trains under bf16 autocast"
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars (for logs)")
    p.add_argument(
        "--time-limit-min",
        type=float,
        default=None,
        help="end this call after about N minutes: generation stops between shards, training "
        "with a checkpoint; run the same command again to resume",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice; 1 on a busy shared machine, "
        "where spinning OpenMP threads slow everything down)",
    )

    gen = p.add_argument_group("generate")
    gen.add_argument(
        "--num-prompts",
        type=int,
        default=g.num_prompts,
        help="training prompts from the grid (default: all 3240)",
    )
    gen.add_argument(
        "--eval-prompts",
        type=int,
        default=g.eval_prompts,
        help="held-out prompts (decoded greedily)",
    )
    gen.add_argument(
        "--temperatures",
        type=_floats,
        default=g.temperatures,
        help="comma-separated; 0 is greedy (default: 0,0.7,0.85,1.0)",
    )
    gen.add_argument(
        "--samples-per-temperature",
        type=int,
        default=g.samples_per_temperature,
        help="samples per prompt at each temperature > 0",
    )
    gen.add_argument(
        "--max-new-tokens", type=int, default=g.max_new_tokens, help="completion length cap"
    )
    gen.add_argument(
        "--shard-size", type=int, default=g.shard_size, help="sequences per shard file"
    )
    gen.add_argument(
        "--gen-batch-size",
        type=int,
        default=g.batch_size,
        help="concurrent requests while generating",
    )
    gen.add_argument(
        "--gen-dtype",
        default=None,
        help="engine dtype for generation (default: float32 on CPU, bfloat16 on CUDA)",
    )

    tr = p.add_argument_group("train")
    tr.add_argument(
        "--draft-layers", type=int, default=t.num_layers, help="decoder layers of the draft"
    )
    tr.add_argument(
        "--init-layers",
        type=_layers,
        default=None,
        help="target layers copied into the draft, e.g. 0,29; 'none': random init "
        "(default: the first k layers)",
    )
    tr.add_argument(
        "--train-embeddings",
        action="store_true",
        help="also train the (tied) embedding / LM head (default: frozen, shared with the target)",
    )
    tr.add_argument(
        "--epochs", type=float, default=None, help=f"data passes (draft {t.epochs}, eagle 4)"
    )
    tr.add_argument(
        "--max-steps", type=int, default=t.max_steps, help="optimizer steps (overrides --epochs)"
    )
    tr.add_argument(
        "--batch-size", type=int, default=t.batch_size, help="sequences per micro-batch"
    )
    tr.add_argument(
        "--grad-accum", type=int, default=t.grad_accum, help="micro-batches per optimizer step"
    )
    tr.add_argument(
        "--lr", type=float, default=None, help=f"peak AdamW LR (draft {t.lr}, eagle 1e-3)"
    )
    tr.add_argument(
        "--min-lr-ratio",
        type=float,
        default=t.min_lr_ratio,
        help="cosine floor as a fraction of --lr",
    )
    tr.add_argument("--warmup-steps", type=int, default=t.warmup_steps, help="linear warm-up steps")
    tr.add_argument("--weight-decay", type=float, default=t.weight_decay, help="AdamW weight decay")
    tr.add_argument(
        "--max-len", type=int, default=t.max_len, help="truncate sequences to this many tokens"
    )
    tr.add_argument("--save-every", type=int, default=t.save_every, help="checkpoint every N steps")
    tr.add_argument(
        "--eval-every",
        type=int,
        default=t.eval_every,
        help="held-out agreement every N steps (0: at the end only)",
    )
    tr.add_argument("--seed", type=int, default=t.seed, help="data order, sampling seeds, init")

    ev = p.add_argument_group("eval")
    eg = p.add_argument_group("eagle (--method eagle)")
    eg.add_argument(
        "--ttt-steps", type=int, default=2, help="training-time-test unroll depth (1: EAGLE-1)"
    )
    eg.add_argument(
        "--noise", type=float, default=0.05, help="feature noise, a fraction of the features' RMS"
    )
    eg.add_argument("--cls-weight", type=float, default=0.5, help="weight of the token loss")
    eg.add_argument(
        "--eagle-vocab", type=int, default=16384, help="draft vocabulary K of the head's LM head"
    )
    ev.add_argument("--draft", default=None, help="evaluate this draft dir instead of --out")
    ev.add_argument(
        "--budget", type=int, default=8, help="adaserve token budget B for the speed check"
    )
    ev.add_argument(
        "--speed-prompts", type=int, default=8, help="held-out prompts run one at a time"
    )
    ev.add_argument("--speed-max-tokens", type=int, default=64, help="tokens generated per prompt")
    ev.add_argument(
        "--speed-repeats",
        type=int,
        default=2,
        help="alternating runs of both policies; the best of each counts",
    )

    sh = p.add_argument_group("export / assemble")
    sh.add_argument(
        "--ship-file",
        default=None,
        help="layers-only safetensors file (default: OUT.layers.safetensors beside --out)",
    )


def run(a: argparse.Namespace) -> int:
    from adaserve.distill.data import GenerateConfig, generate_shards, load_sequences
    from adaserve.distill.evaluate import speculation_stats, top1_agreement
    from adaserve.distill.train import TrainConfig, train
    from adaserve.exec.checkpoint_files import cache_root
    from adaserve.exec.loader import resolve_model_path

    target = resolve_model_path(a.target)
    work = Path(a.work_dir) if a.work_dir else cache_root() / "distill" / target.name
    suffix = "eagle" if a.method == "eagle" else "draft-distilled"
    out = Path(a.out) if a.out else cache_root() / "models" / f"{target.name}-{suffix}"
    data_dir = Path(a.data_dir) if a.data_dir else work / "data"
    cuda = a.device.startswith("cuda")
    progress = not a.no_progress
    started = time.monotonic()

    def left() -> float | None:
        """Seconds this call may still run under --time-limit-min (None: no limit)."""
        if a.time_limit_min is None:
            return None
        return 60 * a.time_limit_min - (time.monotonic() - started)

    if a.threads is not None:
        import torch

        torch.set_num_threads(a.threads)
    ship = Path(a.ship_file) if a.ship_file else out.with_name(out.name + ".layers.safetensors")
    if a.phase in ("export", "assemble"):
        from adaserve.distill.ship import assemble_draft, export_layers

        if a.phase == "export":
            export_layers(Path(a.draft) if a.draft else out, target, ship)
            print(f"distill: wrote {ship} ({ship.stat().st_size / 2**20:.1f} MiB)")
        else:
            print(f"distill: wrote {assemble_draft(ship, target, out)}")
        return 0
    if a.phase in ("all", "generate"):
        gcfg = GenerateConfig(
            num_prompts=a.num_prompts,
            eval_prompts=a.eval_prompts,
            temperatures=a.temperatures,
            samples_per_temperature=a.samples_per_temperature,
            max_new_tokens=a.max_new_tokens,
            shard_size=a.shard_size,
            batch_size=a.gen_batch_size,
            seed=a.seed,
            device=a.device,
            dtype=a.gen_dtype or ("bfloat16" if cuda else "float32"),
        )
        if not generate_shards(target, data_dir, gcfg, progress=progress, time_limit_s=left()):
            print("distill: time limit reached while generating; run again to resume")
            return 0
    if a.phase in ("all", "train") and a.method == "eagle":
        if not _train_eagle(a, target, data_dir, work, out, left(), progress):
            return 0
    elif a.phase in ("all", "train"):
        tcfg = TrainConfig(
            num_layers=a.draft_layers,
            init_layers=a.init_layers,
            freeze_embeddings=not a.train_embeddings,
            epochs=TrainConfig.epochs if a.epochs is None else a.epochs,
            max_steps=a.max_steps,
            batch_size=a.batch_size,
            grad_accum=a.grad_accum,
            lr=TrainConfig.lr if a.lr is None else a.lr,
            min_lr_ratio=a.min_lr_ratio,
            warmup_steps=a.warmup_steps,
            weight_decay=a.weight_decay,
            max_len=a.max_len,
            seed=a.seed,
            save_every=a.save_every,
            eval_every=a.eval_every,
            device=a.device,
        )
        data, held = load_sequences(data_dir, "train"), load_sequences(data_dir, "eval")
        print(f"distill: {len(data)} training sequences, {data.num_tokens} tokens", file=sys.stderr)
        res = train(target, data, work, out, tcfg, held, time_limit_s=left(), progress=progress)
        if not res.finished:
            print(f"distill: stopped at step {res.step}/{res.total_steps}; run again to resume")
            return 0
        print(f"distill: wrote {out} (held-out top-1 agreement {res.eval_agreement:.3f})")
    if a.phase in ("all", "eval") and a.method == "eagle":
        _eval_eagle(a, target, data_dir, work, Path(a.draft) if a.draft else out)
    elif a.phase in ("all", "eval"):
        draft = Path(a.draft) if a.draft else out
        held = load_sequences(data_dir, "eval")
        report = {
            "draft": str(draft),
            "top1_agreement": top1_agreement(target, draft, held, a.device),
        }
        prompts = [t[:p].tolist() for t, p in zip(held.tokens, held.prompt_lens)][: a.speed_prompts]
        report.update(
            speculation_stats(
                target,
                draft,
                prompts,
                a.budget,
                a.speed_max_tokens,
                a.device,
                repeats=a.speed_repeats,
            )
        )
        report["budget"] = a.budget
        print(json.dumps(report, indent=2))
        (work / "eval.json").write_text(json.dumps(report, indent=2))
    return 0


def _train_eagle(a, target: Path, data_dir: Path, work: Path, out: Path, left, progress) -> bool:
    """`--method eagle --phase train`; False when stopped early (run again to resume)."""
    import torch

    from adaserve.distill.data import load_sequences
    from adaserve.distill.eagle import EagleConfig, load_or_compute_features, train_eagle
    from adaserve.exec.draft_vocab import draft_vocab_ids
    from adaserve.exec.loader import load_model

    cfg = EagleConfig(
        epochs=EagleConfig.epochs if a.epochs is None else a.epochs,
        max_steps=a.max_steps,
        batch_size=a.batch_size,
        lr=EagleConfig.lr if a.lr is None else a.lr,
        min_lr_ratio=a.min_lr_ratio,
        warmup_steps=a.warmup_steps,
        weight_decay=a.weight_decay,
        max_len=a.max_len,
        ttt_steps=a.ttt_steps,
        noise=a.noise,
        cls_weight=a.cls_weight,
        vocab_size=a.eagle_vocab,
        seed=a.seed,
        save_every=a.save_every,
        eval_every=a.eval_every,
        device=a.device,
    )
    model = load_model(target)
    vocab = None
    if cfg.vocab_size < model.args.vocab_size:
        ids = draft_vocab_ids(target.name, model.args.vocab_size, cfg.vocab_size, None)
        vocab = torch.tensor(ids, dtype=torch.long)
    data, held = load_sequences(data_dir, "train"), load_sequences(data_dir, "eval")
    print(f"distill: {len(data)} training sequences, {data.num_tokens} tokens", file=sys.stderr)
    with torch.no_grad():
        feats = load_or_compute_features(model, data, work / "eagle-features-train.pt", a.max_len)
        held_feats = load_or_compute_features(
            model, held, work / "eagle-features-eval.pt", a.max_len
        )
    res = train_eagle(
        model, vocab, data, feats, work, out, cfg, (held, held_feats), None, left, progress
    )
    if not res.finished:
        print(f"distill: stopped at step {res.step}/{res.total_steps}; run again to resume")
        return False
    agree = ", ".join(f"{x:.3f}" for x in res.agreement or [])
    print(f"distill: wrote {out} (held-out top-1 agreement at depth 1..4: {agree})")
    return True


def _eval_eagle(a, target: Path, data_dir: Path, work: Path, head_dir: Path) -> None:
    """Held-out agreement by depth, then the head serving one request at a time: accepted
    tokens per iteration under adaserve_paper (always speculates) at budget 8 and --budget,
    and tokens/s of adaserve (speculation control on) against incremental."""
    import torch

    from adaserve.distill.data import load_sequences
    from adaserve.distill.eagle import held_out_agreement, load_or_compute_features
    from adaserve.distill.evaluate import speculation_stats
    from adaserve.exec.draft_vocab import draft_vocab_ids
    from adaserve.exec.loader import load_model
    from adaserve.exec.model.eagle import load_eagle_head

    model = load_model(target)
    head = load_eagle_head(head_dir, model)
    if a.eagle_vocab < model.args.vocab_size:
        ids = draft_vocab_ids(target.name, model.args.vocab_size, a.eagle_vocab, None)
        head.restrict_head(torch.tensor(ids, dtype=torch.long))
    held = load_sequences(data_dir, "eval")
    with torch.no_grad():
        feats = load_or_compute_features(model, held, work / "eagle-features-eval.pt", a.max_len)
        agreement = held_out_agreement(head, held, feats, a.max_len)
    prompts = [t[:p].tolist() for t, p in zip(held.tokens, held.prompt_lens)][: a.speed_prompts]
    report: dict = {"head": str(head_dir), "top1_agreement_by_depth": agreement}
    for budget in sorted({8, a.budget}):
        stats = speculation_stats(
            target, head_dir, prompts, budget, a.speed_max_tokens, a.device, policy="adaserve_paper"
        )
        report[f"accepted_per_iteration_b{budget}"] = stats["accepted_per_iteration"]
    report.update(
        speculation_stats(
            target, head_dir, prompts, a.budget, a.speed_max_tokens, a.device, a.speed_repeats
        )
    )
    print(json.dumps(report, indent=2))
    (work / "eagle_eval.json").write_text(json.dumps(report, indent=2))


def main(argv: list[str] | None = None) -> int:
    from adaserve.entry import standalone_main

    doc = __doc__.splitlines()[0]
    return standalone_main("adaserve distill", doc, add_arguments, run, argv)
