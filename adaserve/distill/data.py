"""Training text written by the target itself: chat prompts -> completions -> shard files.

Each shard holds the token ids (prompt + completion) of `shard_size` generations. Shards are
written atomically and never redone, so a killed run resumes where it stopped. The job list
is a pure function of the config and the grid, and `meta.json` refuses a resume with
different settings (it would mix two data sets under one name).
"""

from __future__ import annotations

import json
import math
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from adaserve.distill.prompts import ChatPrompt, PromptGrid

SPLITS = ("eval", "train")
# Settings that only change speed, not the data: a resume may change them.
_SPEED_ONLY = ("batch_size", "device", "dtype")


@dataclass(frozen=True)
class GenerateConfig:
    """What to generate. Held-out (eval) prompts are always decoded greedily, once."""

    num_prompts: int | None = None  # train prompts (a prefix of the shuffled split); None: all
    eval_prompts: int = 32
    temperatures: tuple[float, ...] = (0.0, 0.7, 0.85, 1.0)
    samples_per_temperature: int = 1  # samples at each temperature > 0; greedy runs once
    max_new_tokens: int = 256
    shard_size: int = 256  # sequences per shard file
    batch_size: int = 64  # concurrent requests in the engine
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("eval_prompts", "samples_per_temperature", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.shard_size < 1 or self.batch_size < 1:
            raise ValueError("shard_size and batch_size must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1 (or None: all), got {self.num_prompts}")
        if not self.temperatures or any(not 0.0 <= t <= 2.0 for t in self.temperatures):
            raise ValueError(f"temperatures must be in [0, 2], got {self.temperatures}")


@dataclass(frozen=True)
class Job:
    prompt: ChatPrompt
    temperature: float
    seed: int


@dataclass
class Sequences:
    """Token-id sequences (prompt + completion) and where each completion starts."""

    tokens: list[torch.Tensor]  # each [L] int64, cpu
    prompt_lens: list[int]

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)


def make_jobs(cfg: GenerateConfig, grid: PromptGrid, split: str) -> list[Job]:
    prompts = grid.split(split, cfg.seed)
    if split == "eval":
        return [Job(p, 0.0, 0) for p in prompts[: cfg.eval_prompts]]
    if cfg.num_prompts is not None:
        prompts = prompts[: cfg.num_prompts]
    jobs = []
    for p in prompts:
        for t in cfg.temperatures:
            for s in range(1 if t == 0.0 else cfg.samples_per_temperature):
                # A stable per-job seed: a resumed shard draws exactly what it would have drawn.
                seed = zlib.crc32(f"{cfg.seed}:{p.index}:{t}:{s}".encode())
                jobs.append(Job(p, t, seed))
    return jobs


def shard_path(data_dir: Path, split: str, i: int) -> Path:
    return data_dir / f"{split}-{i:05d}.pt"


def check_meta(data_dir: Path, meta: dict) -> None:
    """Write meta.json, or check that an existing one describes the same data."""
    path = data_dir / "meta.json"
    meta = json.loads(json.dumps(meta))  # tuples become lists, as they read back
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
        if diff:
            raise ValueError(
                f"{data_dir} holds data generated with other settings ({', '.join(diff)}); "
                "use another --work-dir or delete it"
            )
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2))


def generate_shards(
    target_dir: Path,
    data_dir: Path,
    cfg: GenerateConfig,
    grid: PromptGrid | None = None,
    progress: bool = True,
    time_limit_s: float | None = None,
) -> bool:
    """Generate every missing shard of both splits; False if `time_limit_s` cut it short.

    The limit is checked between shards, so a call may overrun it by one shard's time.
    """
    started = time.monotonic()
    grid = grid or PromptGrid()
    settings = {k: v for k, v in asdict(cfg).items() if k not in _SPEED_ONLY}
    check_meta(data_dir, {"target": Path(target_dir).name, "grid": asdict(grid), **settings})
    jobs = {s: make_jobs(cfg, grid, s) for s in SPLITS}
    size = cfg.shard_size
    chunks = {s: [j[i : i + size] for i in range(0, len(j), size)] for s, j in jobs.items()}
    paths = {s: [shard_path(data_dir, s, i) for i in range(len(c))] for s, c in chunks.items()}
    todo = [(p, c) for s in SPLITS for p, c in zip(paths[s], chunks[s]) if not p.exists()]
    total = sum(len(j) for j in jobs.values())
    if not todo:
        return True
    llm = _make_llm(target_dir, cfg, [c for _, c in todo])
    bar = tqdm(
        total=total,
        initial=total - sum(len(c) for _, c in todo),
        unit="seq",
        desc="generate",
        disable=not progress,
    )
    for path, chunk in todo:
        if time_limit_s is not None and time.monotonic() - started > time_limit_s:
            bar.close()
            return False
        tokens, prompt_lens = [], []
        for prompt_ids, completion in _run_chunk(llm, chunk, cfg.max_new_tokens):
            tokens.append(torch.tensor(prompt_ids + completion, dtype=torch.int32))
            prompt_lens.append(len(prompt_ids))
            bar.update(1)
        save_shard(path, tokens, prompt_lens, [j.temperature for j in chunk])
    bar.close()
    return True


def _make_llm(target_dir: Path, cfg: GenerateConfig, chunks: list[list[Job]]):
    from adaserve.llm import LLM

    longest_prompt = 64 + max(len(j.prompt.text) for c in chunks for j in c)  # chars >= tokens
    # Enough KV blocks that a full batch never waits or is preempted.
    block_size = 16
    per_seq = math.ceil((longest_prompt + cfg.max_new_tokens) / block_size) + 1
    return LLM(
        model=str(target_dir),
        policy="incremental",
        device=cfg.device,
        dtype=cfg.dtype,
        max_num_seqs=cfg.batch_size,
        block_size=block_size,
        num_blocks=per_seq * cfg.batch_size,
        seed=cfg.seed,
    )


def _run_chunk(llm, chunk: list[Job], max_new_tokens: int) -> Iterator[tuple[list[int], list[int]]]:
    """(prompt ids, completion ids) for each job, in job order, yielded as requests finish."""
    from adaserve.request_manager.request import SamplingParams

    eng = llm.llm_engine
    reqs = [
        eng.add_request(
            eng.apply_chat_template(job.prompt.messages),
            SamplingParams(max_tokens=max_new_tokens, temperature=job.temperature, seed=job.seed),
        )
        for job in chunk
    ]
    done: dict[str, list[int]] = {}
    emitted = 0
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
        # Yield in job order as soon as the next one is finished, so progress moves.
        while emitted < len(reqs) and reqs[emitted].request_id in done:
            req = reqs[emitted]
            yield list(req.prompt_token_ids), done.pop(req.request_id)
            emitted += 1


def save_shard(
    path: Path, tokens: list[torch.Tensor], prompt_lens: list[int], temperatures: list[float]
) -> None:
    lengths = torch.tensor([len(t) for t in tokens], dtype=torch.int64)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    data = {
        "tokens": torch.cat(tokens).to(torch.int32),  # [sum L] int32
        "offsets": offsets,  # [N + 1] int64: sequence i is tokens[offsets[i]:offsets[i + 1]]
        "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int32),  # [N]
        "temperatures": torch.tensor(temperatures, dtype=torch.float32),  # [N]
    }
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(data, tmp)
    tmp.rename(path)  # atomic: a shard file is either complete or absent


def load_sequences(data_dir: Path, split: str) -> Sequences:
    """Every sequence of `split` from the shards in `data_dir`."""
    files = sorted(Path(data_dir).glob(f"{split}-*.pt"))
    if not files:
        raise FileNotFoundError(
            f"no {split} shards in {data_dir}; run `adaserve distill --phase generate` first"
        )
    seqs = Sequences([], [])
    for f in files:
        d = torch.load(f, weights_only=True)
        off = d["offsets"].tolist()
        seqs.tokens += [d["tokens"][a:b].long() for a, b in zip(off[:-1], off[1:])]
        seqs.prompt_lens += d["prompt_lens"].tolist()
    return seqs
