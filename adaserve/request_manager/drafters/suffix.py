"""The suffix drafter: continuations looked up in text already seen, no model forward.

Each running request has an n-gram index over its own tokens (prompt + output), brought up to
date lazily whenever it drafts; finished requests' outputs go into one global cache, bounded
in tokens and evicted least-recently-used, so answers that recur across users are found too.
How a tree and its probabilities are built from the matches: `suffix_index.build_suffix_tree`.
"""

from __future__ import annotations

from collections.abc import Sequence

from adaserve.config import SchedulerConfig
from adaserve.request_manager.drafters.base import Drafter, KeepGoing
from adaserve.request_manager.drafters.suffix_index import (
    GlobalSuffixCache,
    TokenIndex,
    build_suffix_tree,
)
from adaserve.request_manager.policies import SpecShape
from adaserve.request_manager.request import Request
from adaserve.tree import CandidateTree


class SuffixDrafter(Drafter):
    """Trees of continuations of the longest suffix match in the request and recent traffic."""

    name = "suffix"

    def __init__(self, cfg: SchedulerConfig) -> None:
        self.cfg = cfg
        self.local: dict[str, TokenIndex] = {}
        self.global_cache = (
            GlobalSuffixCache(cfg.suffix_cache_tokens, cfg.suffix_max_ngram)
            if cfg.suffix_cache_tokens > 0
            else None
        )

    def _index(self, req: Request) -> TokenIndex:
        index = self.local.get(req.request_id)
        if index is None:
            index = self.local[req.request_id] = TokenIndex(self.cfg.suffix_max_ngram)
        if len(index) < req.num_tokens:  # committed tokens since the last draft
            index.extend(req.all_token_ids[len(index) :])
        return index

    def propose(
        self, requests: Sequence[Request], shape: SpecShape, keep_going: KeepGoing | None = None
    ) -> list[CandidateTree]:
        cfg = self.cfg
        # No draft step per level: as deep as the request's share of the tree allows.
        depth = max(shape.depth, min(cfg.suffix_max_depth, shape.max_nodes - 1))
        trees = []
        for r in requests:
            index = self._index(r)
            trees.append(
                build_suffix_tree(
                    r.last_token,
                    index.tokens,
                    index,
                    self.global_cache,
                    depth=depth,
                    max_nodes=shape.max_nodes - 1,
                    min_match=cfg.suffix_min_match,
                    max_matches=cfg.suffix_max_matches,
                    global_weight=cfg.suffix_global_weight,
                    alpha=cfg.suffix_alpha,
                    alpha_match_len=cfg.suffix_alpha_match_len,
                )
            )
        return trees

    def on_finish(self, request: Request) -> None:
        if self.global_cache is not None and request.output_token_ids:
            # The prompt's tail lets a later request's match run from its prompt into the answer.
            tail = request.prompt_token_ids[-self.cfg.suffix_max_ngram :]
            self.global_cache.add(tail + request.output_token_ids)

    def on_release(self, request: Request) -> None:
        self.local.pop(request.request_id, None)
