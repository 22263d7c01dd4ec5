"""Time a model's linears at a few rows: `F.linear` (MKL's `x W^T`), `W x^T`, packed weights.

    python -m adaserve.bench.linears [--model DIR|hub id] [--rows 1 2 4 8 16 64] [--repeats 9]

Every linear of the model (q/k/v, o, gate/up, down per layer, and the LM head) with weights
of its shape, each its own tensor so they stream from memory as in a forward; prints the
median over repeats of all of them at each row count. Decode rows, token trees and prompt
chunks are these row counts; what a forward of the model pays for them is mostly this. The
model's `linear` runs whichever of the three `choose_cpu_linears` timed fastest at load
("packed": each weight laid out once for oneDNN, `pack_cpu_weight`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from adaserve.exec.model.llama import LlamaArgs, _packed_linear, pack_cpu_weight, w_xt


def shapes(args: LlamaArgs) -> list[tuple[int, int]]:
    """(out, in) of every matmul of one forward, in order."""
    qkv = (args.num_heads + 2 * args.num_kv_heads) * args.head_dim
    layer = [
        (qkv, args.hidden_size),
        (args.hidden_size, args.num_heads * args.head_dim),
        (2 * args.intermediate_size, args.hidden_size),
        (args.hidden_size, args.intermediate_size),
    ]
    return layer * args.num_layers + [(args.vocab_size, args.hidden_size)]


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: the default model)")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 8, 16, 32, 64, 128])
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    from transformers import AutoConfig

    from adaserve.exec.loader import locate_model

    config = AutoConfig.from_pretrained(locate_model(a.model))
    weights = [torch.randn(o, i) for o, i in shapes(LlamaArgs.from_hf_config(config))]
    inputs = {i: torch.randn(max(a.rows), i) for i in {w.shape[1] for w in weights}}
    print(
        f"{len(weights)} matmuls, {sum(w.numel() for w in weights) * 4 / 2**20:.0f} MiB of "
        f"float32 weights, {torch.get_num_threads()} threads; median ms of all of them"
    )
    packed = [pack_cpu_weight(w) for w in weights]
    if any(p is None for p in packed):
        print("(this torch cannot pack weights for oneDNN: no packed column)")
    print("| rows | F.linear | W x^T | packed | ratio W x^T | ratio packed |")
    print("|---:|---:|---:|---:|---:|---:|")
    for rows in a.rows:

        def forward(fn, rows=rows) -> None:
            for w in weights:
                fn(inputs[w.shape[1]][:rows].contiguous(), w, None)

        def forward_packed(rows=rows) -> None:
            for w, p in zip(weights, packed):
                assert p is not None
                _packed_linear(inputs[w.shape[1]][:rows].contiguous(), p, None)

        plain = median_ms(lambda: forward(F.linear), a.repeats)
        ours = median_ms(lambda: forward(w_xt), a.repeats)
        cells = [f"{plain:.1f}", f"{ours:.1f}", "-", f"{ours / plain:.2f}", "-"]
        if all(p is not None for p in packed):
            pk = median_ms(forward_packed, a.repeats)
            cells[2], cells[4] = f"{pk:.1f}", f"{pk / plain:.2f}"
        print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
