"""Reduced draft vocabularies: rankings of the target's output tokens, and loading them.

`adaserve draft-vocab` (adaserve/distill/vocab.py) measures a ranking; the one for the default
target ships next to this file. A draft model's LM head restricted to the top K of the ranking
proposes only those tokens, at a fraction of the full head's cost.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

DEFAULT_RANKINGS = {
    "SmolLM2-135M-Instruct": Path(__file__).with_name("smollm2_135m_instruct_vocab.json"),
}


def rank_tokens(counts: Counter[int], vocab_size: int) -> list[int]:
    """Every token id, most frequent first; unseen ids follow in id order (BPE merge order)."""
    return complete_ranking(sorted(counts, key=lambda t: (-counts[t], t)), vocab_size)


def complete_ranking(ranked: Sequence[int], vocab_size: int) -> list[int]:
    """`ranked` (ids < vocab_size kept, in order), then every other id in id order."""
    head = [t for t in ranked if 0 <= t < vocab_size]
    seen = set(head)
    return head + [t for t in range(vocab_size) if t not in seen]


def coverage(ranking: Sequence[int], k: int, counts: Counter[int]) -> float:
    """Share of the counted tokens that fall inside the top k of `ranking`."""
    top = set(ranking[:k])
    total = sum(counts.values())
    return sum(c for t, c in counts.items() if t in top) / total if total else 0.0


def save_ranking(
    path: str | Path, ranking: Sequence[int], meta: dict, keep: int | None = None
) -> Path:
    """Write the first `keep` ids of the ranking (the rest is id order: complete_ranking)."""
    path = Path(path)
    path.write_text(json.dumps({**meta, "ranking": list(ranking[:keep])}) + "\n")
    return path


def load_ranking(path: str | Path) -> list[int]:
    try:
        return [int(t) for t in json.loads(Path(path).read_text())["ranking"]]
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a draft-vocabulary file ({exc}); make one with `adaserve draft-vocab`"
        ) from None


def draft_vocab_ids(
    target_name: str, vocab_size: int, k: int, ranking_file: str | Path | None = None
) -> list[int]:
    """The k token ids a reduced draft head keeps, sorted.

    From `ranking_file`, else the ranking shipped for this target, else the first k ids (BPE
    tokenizers number tokens roughly by merge order, i.e. by frequency in their corpus).
    """
    if not 0 < k <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {k}")
    path = ranking_file or DEFAULT_RANKINGS.get(target_name)
    if path is None or not Path(path).exists():
        return list(range(k))
    return sorted(complete_ranking(load_ranking(path), vocab_size)[:k])
