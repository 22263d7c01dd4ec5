"""GPU benchmarks: target latency vs the weight-bandwidth roofline, draft steps with and without
CUDA graphs, and the default model pair end to end.

    python -m adaserve.bench.gpu_latency --out DIR [--quick] [--skip-e2e]

1. Target forward latency for 1..1024 tokens (spread over up to 8 sequences with 256 cached
   tokens each, as `adaserve profile` measures) of a Llama-2-7B-shaped model with random
   weights, beside the roofline: weight bytes / measured device copy bandwidth (bytes read +
   written per second), the time one pass over the weights takes at best. Reported: the ratio
   at 1 token and at B, the largest token count within 1.5x a 1-token forward (the profile's B).
2. Draft step latency (steps 2..d: R requests x width tree nodes, masked) for a
   Llama-160M-shaped model and the default draft's shape, eager and replayed from CUDA graphs.
3. End to end on the default model pair (incremental, sequence, adaserve): tokens/s, accepted
   tokens per iteration, the iteration's time split draft / select / verify.

Writes DIR/gpu_latency.json and DIR/gpu_latency.md (tables for docs/results.md).
`--device cpu --tiny` runs every part on tiny shapes: a smoke test of this script, not a number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from adaserve.config import ModelConfig, SchedulerConfig
from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.cuda_graph import DraftGraphRunner, ForwardGraphRunner
from adaserve.exec.kv_cache import KVCache
from adaserve.exec.model.llama import LlamaArgs, LlamaForCausalLM
from adaserve.exec.timing import time_forward
from adaserve.exec.torch_runner import ModelRunner, make_attention_backend
from adaserve.request_manager.control.profile import (
    BUDGET_CONTEXT,
    DEFAULT_BUDGET_FACTOR,
    derive_budget,
)

# Fields every model below shares.
_BASE: dict[str, Any] = dict(
    architecture="LlamaForCausalLM",
    rms_norm_eps=1e-5,
    rope_scaling=None,
    qkv_bias=False,
    sliding_window=None,
)
LLAMA2_7B = LlamaArgs(
    vocab_size=32000,
    hidden_size=4096,
    intermediate_size=11008,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    max_position_embeddings=4096,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    **_BASE,
)
LLAMA_160M = replace(
    LLAMA2_7B,
    hidden_size=768,
    intermediate_size=3072,
    num_layers=12,
    num_heads=12,
    num_kv_heads=12,
    head_dim=64,
    max_position_embeddings=2048,
)
# The default draft: SmolLM2-135M's first 4 layers (default_model.make_layer_draft).
DEFAULT_DRAFT = replace(
    LLAMA2_7B,
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=4,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
TINY = replace(
    LLAMA_160M,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
)

DRAFT_REQUESTS = (1, 8, 32)
GRAPH_TOKENS = ModelConfig.cuda_graph_max_tokens  # forwards the engine replays from graphs
DRAFT_WIDTH = 4  # SchedulerConfig.max_width
E2E_POLICIES = ("incremental", "sequence", "adaserve")


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Parameters created inside are `dtype` (a 7B model never exists in float32)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def random_runner(
    args: LlamaArgs, dtype: torch.dtype, device: torch.device, kv_tokens: int, backend: str
) -> ModelRunner:
    """A randomly initialised model with a KV pool of `kv_tokens` slots (block size 16)."""
    with torch.device(device), default_dtype(dtype):
        model = LlamaForCausalLM(args).eval()
    cache = KVCache(
        args.num_layers, -(-kv_tokens // 16), 16, args.num_kv_heads, args.head_dim, dtype, device
    )
    cache.k.normal_()  # timed kernels never read zeros (METHOD.md)
    cache.v.normal_()
    return ModelRunner(model, cache, make_attention_backend(backend, cache))


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30, repeats: int = 10) -> float:
    """Device-to-device copy rate in bytes/s, counting bytes read plus bytes written."""
    src = torch.randn(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weight a forward must read: all but an untied embedding (it reads T rows)."""
    skip = "embed_tokens.weight" if model.lm_head is not None else None
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n != skip)


def draft_step_ms(
    runner: ModelRunner,
    graphs: DraftGraphRunner | None,
    num_requests: int,
    width: int,
    context: int,
    repeats: int,
) -> float:
    """Median ms of one masked draft step (R x width tree nodes over `context` cached tokens).

    graphs: a DraftGraphRunner to replay from, or None for the eager forward.
    """
    cache = runner.cache
    tables: list[list[int]] = [[] for _ in range(num_requests)]
    try:
        builder = SequenceBatchBuilder()
        for i, table in enumerate(tables):
            cache.reserve(table, context + width)
            ids = [(7 * i + j) % 97 + 1 for j in range(width)]
            # `width` sibling nodes one level below the context: a beam step's frontier.
            siblings = [-1] * width
            builder.add(ids, [context + 1] * width, context + width, table, tree=siblings)
        step = graphs.forward if graphs is not None else runner.forward
        samples = []
        for i in range(repeats + 2):  # the first two capture/warm the shape and do not count
            _sync(runner.device)
            start = time.perf_counter()
            step(builder.batch)
            _sync(runner.device)
            if i >= 2:
                samples.append(1000.0 * (time.perf_counter() - start))
        return statistics.median(samples)
    finally:
        for table in tables:
            cache.release(table)


def target_section(
    name: str,
    args: LlamaArgs,
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    max_tokens: int,
    repeats: int,
) -> dict:
    """Latency vs tokens at the budget context, copy bandwidth, roofline, B and the ratios."""
    runner = random_runner(args, dtype, device, 8 * (BUDGET_CONTEXT + max_tokens) + 1024, backend)
    counts = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    for _ in range(3):
        time_forward(runner, 1, BUDGET_CONTEXT, 1)
    ms = {t: time_forward(runner, t, BUDGET_CONTEXT, repeats) for t in counts}
    latency = {t: m for t, m in ms.items() if m is not None}
    bw = copy_bandwidth(device) if device.type == "cuda" else float("nan")
    wbytes = weight_bytes(runner.model)
    roofline_ms = 1000.0 * wbytes / bw
    graph: dict[int, float] = {}
    if runner.backend.supports_cuda_graphs():  # what the engine replays: forwards <= GRAPH_TOKENS
        runner.graphs = ForwardGraphRunner(
            runner, GRAPH_TOKENS, GRAPH_TOKENS, BUDGET_CONTEXT + GRAPH_TOKENS
        )
        for t in counts:
            m = time_forward(runner, t, BUDGET_CONTEXT, repeats) if t <= GRAPH_TOKENS else None
            if m is not None:
                graph[t] = m
        runner.graphs.close()
        runner.graphs = None
    # What the engine meets: forwards the graphs cover replay, larger ones run eagerly. B and the
    # ratios come from that curve (the eager curve alone is the host's launch time on a GPU).
    served = {t: graph.get(t, m) for t, m in latency.items()}
    budget = derive_budget(served, DEFAULT_BUDGET_FACTOR)
    at_b = _interp(served, budget)
    out = {
        "model": name,
        "backend": type(runner.backend).__name__,
        "context": BUDGET_CONTEXT,
        "weight_bytes": wbytes,
        "copy_bandwidth_bytes_per_s": bw,
        "roofline_ms": roofline_ms,
        "latency_ms": latency,
        "graph_latency_ms": graph,
        "budget": budget,
        "served_latency_ms": served,
        "ratio_at_1": served[1] / roofline_ms,
        "ratio_at_budget": at_b / roofline_ms,
    }
    return out


def draft_section(
    shapes: dict[str, LlamaArgs],
    dtype: torch.dtype,
    device: torch.device,
    backend: str,
    repeats: int,
) -> list[dict]:
    """Masked draft step latency, eager and (where the backend allows) from CUDA graphs."""
    rows = []
    for name, args in shapes.items():
        kv = max(DRAFT_REQUESTS) * (BUDGET_CONTEXT + 2 * DRAFT_WIDTH) + 1024
        runner = random_runner(args, dtype, device, kv, backend)
        graphs = None
        if runner.backend.supports_cuda_graphs():
            graphs = DraftGraphRunner(runner, max(DRAFT_REQUESTS), DRAFT_WIDTH)
        for r in DRAFT_REQUESTS:
            eager = draft_step_ms(runner, None, r, DRAFT_WIDTH, BUDGET_CONTEXT, repeats)
            graph = (
                draft_step_ms(runner, graphs, r, DRAFT_WIDTH, BUDGET_CONTEXT, repeats)
                if graphs is not None
                else None
            )
            rows.append(
                {
                    "model": name,
                    "requests": r,
                    "width": DRAFT_WIDTH,
                    "eager_ms": eager,
                    "graph_ms": graph,
                }
            )
        if graphs is not None:
            graphs.close()
    return rows


def e2e_section(dtype: str, device: str, concurrency: Sequence[int], max_tokens: int) -> list[dict]:
    """The default model pair through LLMEngine; skipped (empty) if the model is not cached."""
    from adaserve import LLMEngine
    from adaserve.bench.policies import run
    from adaserve.bench.prompts import prompts
    from adaserve.config import CacheConfig

    slos = [150.0, 400.0, None]
    rows = []
    for policy in E2E_POLICIES:
        for graphs in (False, True):
            engine = LLMEngine(
                # The draft model alone: the suffix drafter ("auto" adds it) would find the
                # warm-up's answers in its index.
                ModelConfig(dtype=dtype, device=device, cuda_graphs=graphs, drafter="model"),
                # The warm-up's prompts are the measured ones: no prefix cache to skip them.
                CacheConfig(enable_prefix_caching=False),
                SchedulerConfig(policy=policy, max_num_seqs=max(concurrency)),
            )
            for c in concurrency:
                # Warm-up at this concurrency: the batch shapes it meets get their CUDA graphs
                # captured (once per server; a capture costs a few eager forwards).
                run(engine, prompts(c), max_tokens, slos)
                result = run(engine, prompts(c), max_tokens, slos)
                target = engine.engine.target
                graph_runner = getattr(target, "graphs", None)
                rows.append(
                    {
                        "policy": policy,
                        "graphs": graphs,
                        "captured": graph_runner.num_graphs if graph_runner else 0,
                        "concurrent": c,
                        **result.summary(),
                    }
                )
            del engine
    return rows


def markdown(result: dict) -> str:
    lines = [f"device: {result['device']}, dtype {result['dtype']}\n"]
    t = result.get("target")
    if t:
        lines += [
            f"### Target forward, {t['model']} shape, random weights ({t['backend']}, context "
            f"{t['context']})\n",
            f"weights {t['weight_bytes'] / 1e9:.2f} GB, copy bandwidth "
            f"{t['copy_bandwidth_bytes_per_s'] / 1e12:.2f} TB/s (read + write), roofline "
            f"{t['roofline_ms']:.2f} ms; B = {t['budget']}; served latency (graphs where they "
            "cover the forward, else eager) / roofline: "
            f"{t['ratio_at_1']:.2f} at 1 token, {t['ratio_at_budget']:.2f} at B\n",
            "| tokens | eager ms | / roofline | CUDA graph ms | / roofline |",
            "|---:|---:|---:|---:|---:|",
        ]
        roof, graph = t["roofline_ms"], t.get("graph_latency_ms", {})
        for n, ms in t["latency_ms"].items():
            g = graph.get(n)
            gs = f"{g:.2f} | {g / roof:.2f}" if g else "- | -"
            lines.append(f"| {n} | {ms:.2f} | {ms / roof:.2f} | {gs} |")
        lines.append("")
    if result.get("draft"):
        lines += [
            f"### Draft step (masked, width {DRAFT_WIDTH}, context {BUDGET_CONTEXT})\n",
            "| model | requests | eager ms | CUDA graph ms | speed-up |",
            "|---|---:|---:|---:|---:|",
        ]
        for d in result["draft"]:
            g = d["graph_ms"]
            gs = f"{g:.3f} | {d['eager_ms'] / g:.2f}x" if g else "- | -"
            lines.append(f"| {d['model']} | {d['requests']} | {d['eager_ms']:.3f} | {gs} |")
        lines.append("")
    if result.get("e2e"):
        lines += [
            f"### End to end, default model pair (budget {SchedulerConfig().budget})\n",
            "| policy | CUDA graphs (captured) | concurrent | tok/s | accepted/iter | iter ms "
            "| draft ms | select ms | verify ms |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for e in result["e2e"]:
            g = f"yes ({e.get('captured', '?')})" if e.get("graphs", True) else "no"
            lines.append(
                f"| {e['policy']} | {g} | {e['concurrent']} | {e['tokens_per_s']:.1f} | "
                f"{e['accepted_per_iter']:.2f} | {e['iter_ms']:.1f} | {e['draft_ms']:.1f} | "
                f"{e['select_ms']:.1f} | {e['verify_ms']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.gpu_latency", description=__doc__)
    p.add_argument("--out", required=True, help="directory for gpu_latency.json / .md")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--backend", default="auto", help="attention backend: auto, flashinfer, torch")
    p.add_argument("--quick", action="store_true", help="fewer repeats, tokens up to 256")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test of the script)")
    p.add_argument("--skip-e2e", action="store_true", help="no end-to-end section")
    p.add_argument(
        "--sections",
        default="target,draft,e2e",
        help="comma-separated sections to run, in this order (default: target,draft,e2e)",
    )
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        msg = "gpu_latency: no CUDA device here; pass --device cpu --tiny for a smoke run"
        print(msg, file=sys.stderr)
        return 2
    repeats = 3 if args.quick or args.tiny else 10
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    target = ("tiny", TINY) if args.tiny else ("Llama-2-7B", LLAMA2_7B)
    drafts = {"llama-160m": LLAMA_160M, "default draft": DEFAULT_DRAFT}
    if args.tiny:
        drafts = {"tiny": TINY}
    max_tokens = 256 if args.quick or args.tiny else 1024
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = set(sections) - {"target", "draft", "e2e"}
    if unknown:
        p.error(f"--sections: unknown {sorted(unknown)}; choose from target, draft, e2e")
    if args.skip_e2e and "e2e" in sections:
        sections.remove("e2e")
    result: dict = {"device": name, "dtype": args.dtype}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for section in sections:
        if section == "target":
            result["target"] = target_section(
                *target, dtype, device, args.backend, max_tokens, repeats
            )
        elif section == "draft":
            result["draft"] = draft_section(drafts, dtype, device, args.backend, repeats)
        else:
            try:
                result["e2e"] = e2e_section(args.dtype, args.device, (1, 4, 16), 32)
            except RuntimeError as exc:  # the default model could not be fetched (no network)
                print(f"gpu_latency: end-to-end skipped: {exc}", file=sys.stderr)
        # Written after every section: a run cut off by its time limit keeps what it finished.
        (out / "gpu_latency.json").write_text(json.dumps(result, indent=2) + "\n")
        (out / "gpu_latency.md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _interp(latency: dict[int, float], tokens: int) -> float:
    """Latency at `tokens`, linear between the measured counts."""
    pts = sorted(latency.items())
    for (t0, m0), (t1, m1) in zip(pts, pts[1:]):
        if t0 <= tokens <= t1:
            return m0 + (tokens - t0) * (m1 - m0) / (t1 - t0)
    return pts[-1][1] if tokens > pts[-1][0] else pts[0][1]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


if __name__ == "__main__":
    sys.exit(main())
