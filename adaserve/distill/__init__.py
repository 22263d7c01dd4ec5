"""Draft-model distillation: the target writes the training text, a small draft learns it.

`adaserve distill` (see `cli.py` and docs/draft.md) runs three resumable phases:
`data.generate_shards` (chat prompts from `prompts.PromptGrid`, completions by the target),
`train.train` (KL(target || draft) on every position) and `evaluate` (top-1 agreement on
held-out prompts, accepted tokens per iteration under adaserve).

Import from the submodules; this package init stays empty so that `adaserve --help` does not
pay for importing torch and transformers.
"""
