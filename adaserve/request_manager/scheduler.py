"""The iteration loop: admit -> prefill -> speculate -> select -> verify -> commit.

`incremental` is the same loop with no draft: every request's tree is its root alone, so
verification degenerates to sampling one token from the target.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from adaserve.config import SchedulerConfig
from adaserve.exec.cost_model import ForwardCostModel
from adaserve.exec.engine import ExecutionEngine, SequenceBatchBuilder
from adaserve.exec.profile import forward_cost_points
from adaserve.request_manager.control import SpeculationController
from adaserve.request_manager.drafters import Drafter, make_drafter
from adaserve.request_manager.output import OutputProcessor
from adaserve.request_manager.policies import SpecShape, select_nodes, spec_shape
from adaserve.request_manager.request import Request, RequestStatus
from adaserve.request_manager.slo import TSpecEstimator, slo_requirements
from adaserve.tree import (
    CandidateTree,
    build_verify_tree,
    top_chain,
    tree_attention_mask,
    verify,
)


@dataclass
class IterationStats:
    """What one iteration did; the metrics and the benchmark read these."""

    kind: str  # "prefill" or "decode"
    num_requests: int
    num_tokens: int  # tokens in the target forward (prompt tokens or tree tokens)
    padded_tokens: int = 0  # tokens the forward ran, padding included
    speculative: bool = False  # the policy speculates (whether or not it drafted now)
    drafted: bool = False  # the drafter ran this iteration
    draft_nodes: int = 0  # non-root nodes the drafter proposed
    tree_tokens: int = 0  # non-root tree nodes verified
    accepted_tokens: int = 0  # non-root tree nodes accepted
    emitted_tokens: int = 0  # tokens committed (accepted + bonus)
    budget: int = 0
    depth: int = 0
    width: int = 0
    draft_s: float = 0.0
    select_s: float = 0.0
    verify_s: float = 0.0
    total_s: float = 0.0

    @property
    def budget_utilization(self) -> float:
        return self.num_tokens / self.budget if self.budget else 0.0


class Scheduler:
    """Owns the waiting and running queues and advances requests one iteration at a time."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        engine: ExecutionEngine,
        drafter: str = "auto",
        cost_model: ForwardCostModel | None = None,
    ) -> None:
        """`cost_model`: the target's forward cost (from a profile); measured here if None."""
        self.cfg = cfg
        self.engine = engine
        self.output = OutputProcessor(engine.tokenizer, engine.max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.t_spec = TSpecEstimator(cfg.t_spec_init_s, cfg.t_spec_ema)
        self.last_stats: IterationStats | None = None
        self.num_preemptions = 0
        self.drafter: Drafter | None = None
        self.controller: SpeculationController | None = None
        if cfg.speculative:
            if drafter == "auto":
                drafter = "model" if engine.draft is not None else "suffix"
            if "model" in drafter:
                engine.enable_draft_graphs(cfg.max_num_seqs, _widest_frontier(cfg))
            self.drafter = make_drafter(drafter, cfg, engine)
        if cfg.controlled:
            assert self.drafter is not None
            if cost_model is None:
                cost_model = ForwardCostModel(forget=cfg.cost_forget)
                cost_model.seed(forward_cost_points(engine.target, cfg.budget))
            draft_cost = None
            if self.drafter.costly and engine.draft is not None:
                # A draft step feeds up to max_num_seqs * W_max frontier tokens.
                draft_cost = ForwardCostModel(forget=cfg.cost_forget)
                draft_cost.seed(forward_cost_points(engine.draft, cfg.budget))
            self.controller = SpeculationController(
                cfg, self.drafter.costly, cfg.budget, cost_model, draft_cost
            )

    # ------------------------------------------------------------------ queue management
    def add(self, req: Request) -> None:
        limit = self.engine.max_model_len
        if len(req.prompt_token_ids) == 0:
            raise ValueError("prompt must contain at least one token")
        if len(req.prompt_token_ids) >= limit:
            raise ValueError(
                f"prompt has {len(req.prompt_token_ids)} tokens; the model allows at "
                f"most {limit - 1} prompt tokens (max_model_len {limit}, one is "
                "needed for output)"
            )
        for name, runner in (("target", self.engine.target), ("draft", self.engine.draft)):
            if (
                runner is not None
                and runner.cache.blocks_needed([], len(req.prompt_token_ids) + 1)
                > runner.cache.num_blocks
            ):
                raise ValueError(
                    f"prompt has {len(req.prompt_token_ids)} tokens, more than the {name} KV cache "
                    f"holds ({runner.cache.num_blocks * runner.cache.block_size} tokens); "
                    "shorten it or give the server more KV blocks"
                )
        bad = [t for t in req.prompt_token_ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise ValueError(
                f"prompt token ids {bad[:3]} are outside the vocabulary "
                f"[0, {self.engine.vocab_size})"
            )
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request as aborted and free its KV now."""
        for queue in (self.running, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._free(req)
                    if self.drafter is not None:
                        self.drafter.on_release(req)
                    req.finish("abort", time.monotonic())
                    return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, req: Request) -> None:
        self.engine.target.cache.release(req.block_table)
        req.num_cached = 0
        if self.engine.draft is not None:
            self.engine.draft.cache.release(req.draft_block_table)
        req.draft_num_cached = 0

    def _retire_finished(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            self._free(req)
            if self.drafter is not None:
                self.drafter.on_finish(req)
                self.drafter.on_release(req)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that got tokens or finished in it."""
        admitted = self._admit()
        if admitted:
            changed = self._prefill(admitted)
        elif self.running:
            changed = self._decode()
        else:
            return []
        self._retire_finished()
        return changed

    def _admit(self) -> list[Request]:
        t_cache = self.engine.target.cache
        admitted: list[Request] = []
        tokens = 0
        # Keep one free block per running request so decoding can grow without preempting at once.
        reserve = len(self.running)
        while self.waiting and len(self.running) + len(admitted) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            n = req.num_tokens
            if admitted and tokens + n > self.cfg.max_num_batched_tokens:
                break
            need = t_cache.blocks_needed(req.block_table, n) + reserve
            if need > t_cache.allocator.num_free or not self._draft_fits(req, n):
                break
            self.waiting.popleft()
            t_cache.reserve(req.block_table, n)
            if self.engine.draft is not None:
                self.engine.draft.cache.reserve(req.draft_block_table, n)
            admitted.append(req)
            tokens += n
            reserve += 1
        return admitted

    def _draft_fits(self, req: Request, n: int) -> bool:
        d = self.engine.draft
        return (
            d is None
            or d.cache.blocks_needed(req.draft_block_table, n) <= d.cache.allocator.num_free
        )

    def _prefill(self, reqs: list[Request]) -> list[Request]:
        start = time.monotonic()
        target, draft = SequenceBatchBuilder(), SequenceBatchBuilder()
        rows: list[int | None] = []
        for r in reqs:
            r.status = RequestStatus.RUNNING
            # A request resumed after preemption already has output: its last token is the next
            # root, so it is not fed here and nothing is sampled.
            resumed = bool(r.output_token_ids)
            tokens = r.all_token_ids[: r.num_tokens - 1] if resumed else r.all_token_ids
            idx = target.add(
                tokens,
                list(range(len(tokens))),
                len(tokens),
                r.block_table,
                logits="none" if resumed else "last",
            )
            rows.append(idx[0] if idx else None)
            r.num_cached = len(tokens)
            if self.engine.draft is not None:
                draft.add(
                    tokens,
                    list(range(len(tokens))),
                    len(tokens),
                    r.draft_block_table,
                    logits="none",
                )
                r.draft_num_cached = len(tokens)
        logits = self.engine.target.forward(target.batch)
        if self.engine.draft is not None:
            self.engine.draft.forward(draft.batch)
        now = time.monotonic()
        for r, row in zip(reqs, rows):
            if row is not None:
                assert logits is not None
                _, token = verify(
                    logits[row : row + 1],
                    [r.last_token],
                    [-1],
                    r.params.temperature,
                    r.params.top_k,
                    r.params.top_p,
                    r.generator,
                )
                self.output.commit(r, [token], now)
        self.running.extend(reqs)
        self.last_stats = IterationStats(
            "prefill",
            len(reqs),
            len(target.batch.token_ids),
            emitted_tokens=len(reqs),
            total_s=now - start,
        )
        return reqs

    def _shape(self) -> SpecShape | None:
        """This iteration's tree shape; None: plain decoding (incremental, or drafting is off)."""
        shape = spec_shape(self.cfg, len(self.running))
        ctl = self.controller
        if shape is not None and ctl is not None:
            context = sum(r.num_cached for r in self.running)
            if not ctl.should_draft(len(self.running), shape, context):
                return None
        return shape

    def _decode(self) -> list[Request]:
        start = time.monotonic()
        shape = self._shape()
        cut_short = self._make_room(shape)
        if not self.running:
            return cut_short
        reqs = list(self.running)
        stats = IterationStats(
            "decode", len(reqs), 0, budget=self.cfg.budget, speculative=self.cfg.speculative
        )
        context = sum(r.num_cached for r in reqs)
        ctl = self.controller
        if shape is None:
            trees = [CandidateTree.root(r.last_token) for r in reqs]
            selections = [[0] for _ in reqs]
        else:
            assert self.drafter is not None
            stats.drafted = True
            stats.depth, stats.width = shape.depth, shape.width
            if self.engine.draft is not None:
                scratch = self.drafter.scratch_tokens(shape)
                for r in reqs:  # _make_room checked these fit; the drafter frees the scratch
                    self.engine.draft.cache.reserve(r.draft_block_table, r.num_tokens + scratch)
            keep_going = ctl.keep_going(len(reqs), context) if ctl is not None else None
            trees = self.drafter.propose(reqs, shape, keep_going)
            t_draft = time.monotonic()
            stats.draft_s = t_draft - start
            trees = [self._cap_depth(r, t) for r, t in zip(reqs, trees)]
            if self.cfg.policy == "sequence":
                trees = [top_chain(t) for t in trees]  # a drafter may branch; sequence is a chain
            stats.draft_nodes = sum(len(t) - 1 for t in trees)
            # Controlled: the selection sees calibrated f(v) and the cost model's t_spec.
            scored = trees if ctl is None else ctl.calibrate(trees)
            t_spec = self.t_spec.value_s if ctl is None else ctl.t_spec_s(len(reqs), context, shape)
            a_cap, a_need = slo_requirements(reqs, t_draft, t_spec, shape.depth)
            selections, slo_step = select_nodes(self.cfg, scored, a_cap, a_need)
            if ctl is not None:
                selections, _ = ctl.prune(scored, selections, slo_step, context)
            stats.select_s = time.monotonic() - t_draft
        t_verify = time.monotonic()
        self._verify_and_commit(reqs, trees, selections, stats, context)
        end = time.monotonic()
        stats.verify_s = end - t_verify
        stats.total_s = end - start
        if shape is not None:
            self.t_spec.update(stats.total_s)
            if ctl is not None and self.drafter is not None and self.drafter.costly:
                steps = max(max(t.depths) for t in trees)
                ctl.record_draft_time(stats.draft_s, steps, len(reqs) * shape.width, context)
                # Scored by what was accepted, not by what calibration expected: a cold
                # calibration must not switch off a draft that is doing well.
                realized = len(reqs) + stats.accepted_tokens
                ctl.record_score(
                    ctl.iteration_ratio(
                        realized, len(reqs), stats.padded_tokens, context, stats.draft_s
                    )
                )
        self.last_stats = stats
        return reqs

    def _cap_depth(self, req: Request, tree: CandidateTree) -> CandidateTree:
        """Drop nodes deeper than the request can still use (max_tokens, max_model_len)."""
        room = (
            min(
                req.params.max_tokens - len(req.output_token_ids),
                self.engine.max_model_len - req.num_tokens,
            )
            - 1
        )
        if max(tree.depths) <= room:
            return tree
        keep = [v for v in range(len(tree)) if tree.depths[v] <= room]
        capped = CandidateTree.root(tree.tokens[0])
        new_id = {0: 0}
        for v in keep[1:]:
            (new_id[v],) = capped.add_nodes(
                [new_id[tree.parents[v]]], [tree.tokens[v]], [tree.logprobs[v]]
            )
        return capped

    def _verify_and_commit(
        self,
        reqs: list[Request],
        trees: list[CandidateTree],
        selections: list[list[int]],
        stats: IterationStats,
        context: int,
    ) -> None:
        cache = self.engine.target.cache
        ctl = self.controller
        builder = SequenceBatchBuilder()
        vtrees, rows = [], []
        for r, tree, sel in zip(reqs, trees, selections):
            vt = build_verify_tree(tree, sel)
            n = len(vt.tokens)
            cache.reserve(r.block_table, r.num_cached + n)
            mask = None if n == 1 else tree_attention_mask(vt.parents, r.num_cached)
            rows.append(
                builder.add(
                    vt.tokens,
                    [r.num_cached + d for d in vt.depths],
                    r.num_cached + n,
                    r.block_table,
                    mask=mask,
                )
            )
            vtrees.append(vt)
        stats.num_tokens = len(builder.batch.token_ids)
        pad_to = stats.num_tokens
        if ctl is not None:
            pad_to = ctl.pad_to(stats.num_tokens, context)
        t_forward = time.monotonic()
        logits = self.engine.target.forward(builder.batch, pad_to=pad_to)
        assert logits is not None
        now = time.monotonic()
        stats.padded_tokens = pad_to
        if ctl is not None:
            ctl.observe_forward(pad_to, context, now - t_forward)
        for r, tree, vt, row in zip(reqs, trees, vtrees, rows):
            p = r.params
            accepted, bonus = verify(
                logits[row[0] : row[-1] + 1],
                vt.tokens,
                vt.parents,
                p.temperature,
                p.top_k,
                p.top_p,
                r.generator,
            )
            if ctl is not None and len(vt) > 1:
                ctl.observe_verification(
                    tree, vt.source_nodes, [vt.source_nodes[v] for v in accepted]
                )
            keep = [0] + accepted
            cache.keep_subset(r.block_table, r.num_cached, keep)
            r.num_cached += len(keep)
            emitted = self.output.commit(r, [vt.tokens[v] for v in accepted] + [bonus], now)
            m = r.metrics
            m.num_iterations += 1
            m.num_tree_tokens += len(vt.tokens) - 1
            m.num_accepted_tokens += len(accepted)
            stats.tree_tokens += len(vt.tokens) - 1
            stats.accepted_tokens += len(accepted)
            stats.emitted_tokens += emitted

    def _make_room(self, shape: SpecShape | None) -> list[Request]:
        """Preempt (recompute later) the newest requests until every tree fits in free KV.

        Returns the request finished for lack of KV, if even it alone no longer fits.
        """
        t_cache, d = self.engine.target.cache, self.engine.draft
        tree_nodes = 1 if shape is None else shape.max_nodes
        scratch = 0 if shape is None or self.drafter is None else self.drafter.scratch_tokens(shape)
        while self.running:
            t_need = sum(
                t_cache.blocks_needed(r.block_table, r.num_cached + tree_nodes)
                for r in self.running
            )
            d_need = (
                0
                if d is None
                else sum(
                    d.cache.blocks_needed(r.draft_block_table, r.num_tokens + scratch)
                    for r in self.running
                )
            )
            if t_need <= t_cache.allocator.num_free and (
                d is None or d_need <= d.cache.allocator.num_free
            ):
                return
            victim = self.running.pop()
            self._free(victim)
            if self.drafter is not None:
                self.drafter.on_release(victim)
            if not self.running:
                # Alone and still too big: the pool cannot hold this request any longer.
                victim.finish("length", time.monotonic())
                return [victim]
            victim.status = RequestStatus.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
        return []


def _widest_frontier(cfg: SchedulerConfig) -> int:
    """The most nodes one request feeds in a draft step under this policy (graph widths)."""
    if cfg.policy == "specinfer":
        expansion = cfg.specinfer_expansion
        sizes = SpecShape(len(expansion), max(expansion), expansion).frontier_sizes()
        return max(sizes[:-1], default=1)
    return 1 if cfg.policy == "sequence" else cfg.max_width
