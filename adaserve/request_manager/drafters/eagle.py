"""The EAGLE drafter: a one-layer head on the target's hidden states grows each tree by beam
search (the head: `exec/model/eagle.py`).

The target hands every feature it computes to `observe_features` (prompt chunks, the
verified root and accepted nodes), so drafting needs no extra target pass. Head KV layout of
a request whose committed tokens are x_0..x_{L-1} (x_{L-1} the root):

  head row p (p = pos0 .. L-2)   reads (f_p, x_{p+1}); kept across iterations, KV index p - pos0
  scratch rows                   one per frontier node fed in steps 2..d (freed after)

pos0 is the first position the target computed a feature for (0, or later after a prefix
cache hit: the head then starts its history there). Step 1 feeds every committed row the
head has not seen, the last of which (row L-2, reading the root) predicts the root's
children; a node's row reads the head's own output at its parent's row as its feature.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.torch_runner import EagleRunner
from adaserve.request_manager.drafters.base import Drafter, KeepGoing
from adaserve.request_manager.drafters.model import _grow, draft_scratch_tokens, scratch_tree
from adaserve.request_manager.policies import SpecShape
from adaserve.request_manager.request import Request
from adaserve.tree import CandidateTree


@dataclass
class _Features:
    """Target features of one request not yet fed to the head, and where its rows start."""

    pos0: int | None = None  # position of head KV index 0 (None: the head has no rows yet)
    start: int = 0  # position of the first pending feature
    pending: list[torch.Tensor] = field(default_factory=list)  # [n_i, H] each, contiguous

    @property
    def end(self) -> int:
        return self.start + sum(len(t) for t in self.pending)


class EagleDrafter(Drafter):
    """Beam search over an EAGLE head that reads the target's features."""

    name = "eagle"
    costly = True
    wants_features = True

    def __init__(self, head: EagleRunner) -> None:
        self.head = head
        self._state: dict[str, _Features] = {}

    def scratch_tokens(self, shape: SpecShape) -> int:
        return draft_scratch_tokens(shape)

    def observe_features(self, request: Request, position: int, hidden: torch.Tensor) -> None:
        st = self._state.setdefault(request.request_id, _Features())
        if not st.pending or position != st.end:
            # A gap (features the target never computed, e.g. prefix-cache hits) or a restart:
            # what was pending before cannot be fed in order any more.
            st.start, st.pending = position, []
        st.pending.append(hidden.detach())

    def on_release(self, request: Request) -> None:
        self._state.pop(request.request_id, None)

    def propose(
        self, requests: Sequence[Request], shape: SpecShape, keep_going: KeepGoing | None = None
    ) -> list[CandidateTree]:
        head = self.head
        trees = [CandidateTree.root(r.last_token) for r in requests]
        live = [i for i, r in enumerate(requests) if self._catch_up_rows(r) is not None]
        if not live:
            return trees
        # Step 1: every committed row the head has not seen; the last one reads the root.
        builder, feats = SequenceBatchBuilder(), []
        for i in live:
            r = requests[i]
            st, catch_up = self._state[r.request_id], self._catch_up_rows(r)
            assert catch_up is not None  # `live` holds only requests with rows to catch up
            first, rows = catch_up
            assert st.pos0 is not None
            tokens = r.all_token_ids[first + 1 : r.num_tokens]
            builder.add(
                tokens,
                list(range(first, r.num_tokens - 1)),
                r.num_tokens - 1 - st.pos0,
                r.draft_block_table,
                logits="last",
            )
            feats.append(rows)
            r.draft_num_cached = r.num_tokens - 1 - st.pos0
            st.start, st.pending = r.num_tokens - 1, []
        builder.batch.features = torch.cat(feats).to(head.device)
        logits = head.forward(builder.batch)  # [R', V or K]
        assert logits is not None and head.last_hidden is not None
        last = torch.tensor(builder.batch.logits_indices, device=head.device)
        out = head.last_hidden[last]  # [R', H]: each root row's predicted feature
        vocab = head.head_token_ids
        sub = [trees[i] for i in live]
        logprobs = torch.log_softmax(logits, dim=-1)
        frontier = _grow(sub, [[0] for _ in live], logprobs[:, None, :], shape, 0, vocab)
        hid = [{0: out[k]} for k in range(len(live))]  # node -> head output at its row
        scratch: list[dict[int, int]] = [{} for _ in live]  # node -> head KV index
        for step in range(1, shape.depth):
            if keep_going is not None and not keep_going(sub, frontier):
                break
            builder, feats = SequenceBatchBuilder(), []
            for k, i in enumerate(live):
                r, tree = requests[i], sub[k]
                committed = r.draft_num_cached
                base = committed + len(scratch[k])
                for j, node in enumerate(frontier[k]):
                    scratch[k][node] = base + j
                kv_len = base + len(frontier[k])
                builder.add(
                    [tree.tokens[v] for v in frontier[k]],
                    [r.num_tokens - 2 + tree.depths[v] for v in frontier[k]],
                    kv_len,
                    r.draft_block_table,
                    tree=scratch_tree(tree, scratch[k], committed),
                )
                feats += [hid[k][tree.parents[v]] for v in frontier[k]]
            builder.batch.features = torch.stack(feats)
            width = len(frontier[0])
            logits = head.forward(builder.batch)  # [R' * width, V]
            assert logits is not None and head.last_hidden is not None
            outs = head.last_hidden.view(len(live), width, -1)
            for k in range(len(live)):
                for j, node in enumerate(frontier[k]):
                    hid[k][node] = outs[k, j]
            logprobs = torch.log_softmax(logits, dim=-1).view(len(live), width, -1)
            frontier = _grow(sub, frontier, logprobs, shape, step, vocab)
        for i in live:
            r = requests[i]
            head.cache.truncate(r.draft_block_table, r.draft_num_cached)
        return trees

    def _catch_up_rows(self, r: Request) -> tuple[int, torch.Tensor] | None:
        """(first row position, its features [n, H]) of the rows step 1 feeds, or None if the
        head cannot draft for `r` (no feature for its root row)."""
        st = self._state.get(r.request_id)
        root_row = r.num_tokens - 2  # reads (f_{L-2}, root)
        if st is None or root_row < 0 or not st.pending or st.end <= root_row:
            return None
        if st.pos0 is None or st.start != st.pos0 + r.draft_num_cached:
            # First rows, or a gap after what the head holds: start its history over here
            # (its reserved blocks stay; the rows are written again from index 0).
            st.pos0, r.draft_num_cached = st.start, 0
        rows = torch.cat(st.pending)[: root_row + 1 - st.start]
        return st.start, rows
