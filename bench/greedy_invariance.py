"""Does greedy output depend on the load? The default model on the torch backend, in a dtype.

    .venv/bin/python bench/greedy_invariance.py [--dtype float32|bfloat16] [--prompts 60]
        [--alone 30] [--max-tokens 64]

Takes `--prompts` prompts the engine has not seen (the shared trace `mixed_rps2.4_ol256`,
from request 200 on), 64 greedy tokens each past EOS, and counts the prompts whose tokens
differ between: incremental decoding of all of them at once and of the first `--alone` one at
a time (does a token depend on what shares its forward?), and incremental against
`adaserve` with the suffix drafter, both all at once (is speculation lossless here?).
docs/results.md ("bf16 on an AMX CPU") has a run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from adaserve import LLM, SamplingParams

TRACE = Path(__file__).resolve().parents[1].parent / "shared/workloads/mixed_rps2.4_ol256.json"


def tokens(llm: LLM, prompts: list[str], params: SamplingParams) -> list[list[int]]:
    return [list(r.outputs[0].token_ids) for r in llm.generate(prompts, params)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--alone", type=int, default=30)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--trace", default=str(TRACE))
    a = ap.parse_args()
    trace = json.loads(Path(a.trace).read_text())
    prompts = [r["prompt"] for r in trace[200 : 200 + a.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
    llm = LLM(policy="incremental", dtype=a.dtype, backend="torch")
    together = tokens(llm, prompts, params)
    alone = [tokens(llm, [p], params)[0] for p in prompts[: a.alone]]
    del llm
    spec = tokens(
        LLM(policy="adaserve", drafter="suffix", dtype=a.dtype, backend="torch"), prompts, params
    )
    moved = sum(together[i] != alone[i] for i in range(len(alone)))
    lossy = sum(together[i] != spec[i] for i in range(len(prompts)))
    print(f"{a.dtype}: incremental, all at once vs one at a time: {moved} of {len(alone)} differ")
    print(
        f"{a.dtype}: adaserve:suffix vs incremental, all at once: {lossy} of {len(prompts)} differ"
    )


if __name__ == "__main__":
    main()
