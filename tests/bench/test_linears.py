"""`python -m adaserve.bench.linears`: one forward's matmuls of a model, timed both ways."""

from __future__ import annotations

import torch
from transformers import AutoConfig

from adaserve.bench import linears
from adaserve.exec.model.llama import LlamaArgs, LlamaForCausalLM


def test_the_shapes_are_every_matmul_of_the_model(tiny_qwen2):
    args = LlamaArgs.from_hf_config(AutoConfig.from_pretrained(tiny_qwen2))
    model = LlamaForCausalLM(args)
    want = sorted(tuple(m.weight.shape) for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert sorted(linears.shapes(args)) == want


def test_the_table_has_a_row_per_row_count(tiny_llama, capsys):
    linears.main(["--model", str(tiny_llama), "--rows", "1", "3", "--repeats", "1"])
    lines = capsys.readouterr().out.splitlines()
    rows = [
        line.split("|")[1].strip() for line in lines if line.startswith("| ") and "rows" not in line
    ]
    assert rows == ["1", "3"]
