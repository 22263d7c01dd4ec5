"""The iteration loop: admit -> plan (trees + prefill chunks) -> one forward -> commit.

One iteration carries, in a single target forward, the verification trees of the running
requests and a chunk of waiting prompts (chunked prefill, sized by the running requests'
SLOs: `prefill.py`). `incremental` is the same loop with no draft: every tree is its root
alone, so verification degenerates to sampling one token from the target.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from dataclasses import dataclass

from adaserve.config import SchedulerConfig
from adaserve.exec.cost_model import ForwardCostModel
from adaserve.exec.engine import ExecutionEngine, SequenceBatchBuilder
from adaserve.request_manager.acceptance_log import AcceptanceLog
from adaserve.request_manager.drafters import Drafter
from adaserve.request_manager.output import OutputProcessor
from adaserve.request_manager.policies import SpecShape
from adaserve.request_manager.prefill import chunk_tokens, prefill_target
from adaserve.request_manager.request import Request, RequestStatus
from adaserve.request_manager.speculation import TreePlan, TreePlanner
from adaserve.tree import build_verify_tree, tree_attention_mask, verify

logger = logging.getLogger("adaserve.scheduler")


# --admission slo admits a request while the predicted TPOT is within this share of the SLO:
# at 10x the sustainable rate on the development machine, admitted 120 ms requests ran
# 1-25% slower than predicted (docs/results.md, "Overload").
SLO_HEADROOM = 0.85


@dataclass
class IterationStats:
    """What one iteration did; the metrics and the benchmark read these."""

    kind: str  # "decode" (something decoded, maybe with prefill chunks) or "prefill"
    num_requests: int  # decoding requests (prefill iterations: requests prefilled)
    num_tokens: int  # tree tokens in the target forward (prefill iterations: prompt tokens)
    prefill_tokens: int = 0  # prompt tokens computed in this forward
    prefill_requests: int = 0  # requests that got a prefill chunk
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
    forward_s: float = 0.0  # the target forward alone
    # Wall time of the iteration outside model forwards: scheduling, sampling, detokenizing,
    # and what the serving loop did since the previous iteration ended (streaming, new
    # requests). None after an idle engine (the gap then is waiting, not work).
    host_s: float | None = None

    @property
    def budget_utilization(self) -> float:
        return self.num_tokens / self.budget if self.budget else 0.0


class Scheduler:
    """Owns the waiting, prefilling and running queues and advances them one iteration."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        engine: ExecutionEngine,
        drafter: str | Drafter = "auto",
        cost_model: ForwardCostModel | None = None,
    ) -> None:
        """`cost_model`: the target's forward cost (from a profile); measured here if None.

        `drafter`: a name (`make_drafter`) or a Drafter instance (the simulator's).
        """
        self.cfg = cfg
        self.engine = engine
        self.clock = engine.clock
        ids = getattr(engine.target.cache, "num_free_ids", None)
        if ids is not None and cfg.max_num_seqs + cfg.budget > ids:
            # ggml: each running request holds a sequence id and each extra leaf of a verified
            # tree borrows one (at most B leaves in a forward).
            raise ValueError(
                f"max_num_seqs {cfg.max_num_seqs} + budget {cfg.budget} exceeds the "
                f"{ids} sequence ids of the ggml backend; lower max_num_seqs"
            )
        # Set to an AcceptanceLog to record every verified tree (`--record-acceptance`).
        self.acceptance_log: AcceptanceLog | None = None
        if cfg.record_acceptance is not None:
            self.acceptance_log = AcceptanceLog(cfg.record_acceptance)
        self.output = OutputProcessor(engine.tokenizer, engine.max_model_len)
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []  # admitted, prompt KV not complete yet (FIFO)
        self.running: list[Request] = []  # decoding
        self.last_stats: IterationStats | None = None
        self.num_preemptions = 0
        # Tokens a decoding request has recently got per iteration (EMA; >= 1: speculation's
        # gain), for predicting the TPOT of a request admitted now (`predicted_tpot_s`).
        self.tokens_per_request = 1.0
        # Recent decode iterations as they ran (EMA, None before the first): wall time from
        # one start to the next (forward, prefill chunks riding along, drafting, host time),
        # forward tokens per decoding request, and decoding requests.
        self.decode_period_s: float | None = None
        self._forward_tokens_per_request = 1.0
        # Host seconds per iteration (EMA of IterationStats.host_s): an iteration lasts the
        # forward the cost model predicts plus this, which TPOT predictions must count.
        self.host_s = 0.0
        self._busy_until: float | None = None  # end of the last iteration, while work remains
        self._host_samples = 0
        if cost_model is None and (cfg.chunked_prefill or cfg.controlled):
            cost_model = ForwardCostModel(forget=cfg.cost_forget)
            cost_model.seed(engine.target.cost_points(max(cfg.budget, 64)))
        self.cost = cost_model
        self.planner = TreePlanner(cfg, engine, drafter, cost_model or ForwardCostModel())
        self.drafter = self.planner.drafter
        self.controller = self.planner.controller

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
        for queue in (self.running, self.prefilling, self.waiting):
            for req in queue:
                if req.request_id == request_id:
                    queue.remove(req)
                    self._free(req)
                    req.finish("abort", self.clock())
                    return req
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running)

    def _free(self, req: Request) -> None:
        self.engine.target.cache.release(req.block_table)
        req.num_cached = 0
        req.block_hashes.clear()
        if self.engine.draft is not None:
            self.engine.draft.cache.release(req.draft_block_table)
        req.draft_num_cached = 0
        req.draft_block_hashes.clear()
        if self.drafter is not None:
            self.drafter.on_release(req)

    def predicted_tpot_s(self) -> float | None:
        """Seconds per output token a request admitted now would see once it decodes, over
        the tokens per request iterations have recently emitted. The iteration: the cost
        model's time of a decode iteration over everyone here plus it (at most max_num_seqs,
        one token each), or, while requests decode, the recent iteration period scaled by
        the cost model from the running batch to that one, if longer (it has what the cost
        of one token each misses: prefill chunks riding along, tree tokens, drafting).
        None without a cost model (nothing to predict from)."""
        if self.cost is None:
            return None
        reqs = [*self.running, *self.prefilling, *self.waiting]
        n = min(len(reqs) + 1, self.cfg.max_num_seqs)
        context = sum(r.num_tokens for r in reqs[:n])
        iteration = self.iteration_s(n, context)
        if self.running and self.decode_period_s is not None:
            per = self._forward_tokens_per_request
            now = self.iteration_s(
                max(1, round(per * len(self.running))), sum(r.num_tokens for r in self.running)
            )
            after = self.iteration_s(max(1, round(per * n)), context)
            if now > 0:
                iteration = max(iteration, self.decode_period_s * after / now)
        return iteration / self.tokens_per_request

    def iteration_s(
        self, tokens: int, context: int, silent: int = 0, silent_pairs: int = 0
    ) -> float:
        """Predicted wall time of an iteration whose forward runs `tokens` tokens, `silent` of
        them without logits (prompt-chunk tokens) attending `silent_pairs` keys in all."""
        assert self.cost is not None
        return self.cost.predict(tokens, context, silent, silent_pairs) + self.host_s

    def slo_refusal(self, slo_tpot_ms: float | None) -> str | None:
        """Why a request with this TPOT SLO should be refused now, or None to admit it.

        Refused when the predicted TPOT with it admitted exceeds SLO_HEADROOM of its own SLO,
        or of the tightest SLO among the requests already admitted: a lenient request that
        would push the others past theirs is refused too, so admitted requests keep their
        SLOs."""
        tpot = self.predicted_tpot_s()
        if tpot is None:
            return None
        ms = 1000.0 * tpot
        if slo_tpot_ms is not None and ms > SLO_HEADROOM * slo_tpot_ms:
            return (
                f"slo_tpot_ms {slo_tpot_ms:g} cannot be met at the current load (about "
                f"{ms:.0f} ms per token predicted); retry later or relax slo_tpot_ms"
            )
        admitted = [r.params.slo_tpot_ms for r in (*self.running, *self.prefilling, *self.waiting)]
        held = min((s for s in admitted if s is not None), default=None)
        if held is not None and ms > SLO_HEADROOM * held:
            return (
                f"admitting this request would slow the requests being served past their "
                f"slo_tpot_ms {held:g} (about {ms:.0f} ms per token predicted); retry later"
            )
        return None

    def fail(self, req: Request, exc: BaseException) -> None:
        """Work of `req` alone raised: finish it with reason "error" (KV freed, an error id
        logged with the traceback); every other request goes on."""
        error_id = uuid.uuid4().hex[:12]
        logger.error("request %s failed, error id %s", req.request_id, error_id, exc_info=exc)
        for queue in (self.running, self.prefilling, self.waiting):
            if req in queue:
                queue.remove(req)
        self._free(req)
        req.error = f"{type(exc).__name__}: {exc} (error id {error_id})"
        req.finish("error", self.clock())
        self._failed.append(req)

    def _retire_finished(self) -> None:
        for req in [r for r in self.running if r.finished]:
            self.running.remove(req)
            if self.drafter is not None:
                self.drafter.on_finish(req)
            self._free(req)

    # ------------------------------------------------------------------ admission
    def _admit(self) -> list[Request]:
        """Waiting -> prefilling while KV and max_num_seqs allow; prefix-cache hits count."""
        t_cache, d = self.engine.target.cache, self.engine.draft
        admitted: list[Request] = []
        tokens = 0
        # Keep one free block per running request so decoding can grow without preempting at once.
        reserve = len(self.running) + len(self.prefilling)
        while (
            self.waiting
            and len(self.running) + len(self.prefilling) + len(admitted) < self.cfg.max_num_seqs
        ):
            req = self.waiting[0]
            n = req.num_tokens
            if (
                not self.cfg.chunked_prefill
                and admitted
                and tokens + n > self.cfg.max_num_batched_tokens
            ):
                break
            self._match_prefix(req)
            need = t_cache.blocks_needed(req.block_table, n) + reserve
            draft_fits = d is None or (
                d.cache.blocks_needed(req.draft_block_table, n) <= d.cache.allocator.num_free
            )
            if need > t_cache.allocator.num_free or not draft_fits:
                self._free(req)  # the matched blocks go back to the cache
                break
            self.waiting.popleft()
            t_cache.reserve(req.block_table, n)
            if d is not None:
                d.cache.reserve(req.draft_block_table, n)
            req.status = RequestStatus.RUNNING
            admitted.append(req)
            tokens += n - req.num_cached
            reserve += 1
        self.prefilling.extend(admitted)
        return admitted

    def _match_prefix(self, req: Request) -> None:
        """Take the cached KV of the longest known prefix (at least one token is computed)."""
        tokens, limit = req.all_token_ids, prefill_target(req) - 1
        if self.engine.target_prefix is not None:
            req.block_table[:] = self.engine.target_prefix.match(tokens, limit, req.block_hashes)
            req.num_cached = len(req.block_table) * self.engine.target.cache.block_size
        if self.engine.draft_prefix is not None and self.engine.draft is not None:
            blocks = self.engine.draft_prefix.match(tokens, limit, req.draft_block_hashes)
            req.draft_block_table[:] = blocks
            req.draft_num_cached = len(blocks) * self.engine.draft.cache.block_size

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[Request]:
        """Run one iteration; returns the requests that got tokens or finished in it."""
        self._failed: list[Request] = []
        self._admit()
        if not (self.running or self.prefilling):
            self._busy_until = None
            return []
        start = self.clock()
        gap = None if self._busy_until is None else start - self._busy_until
        if not self.cfg.chunked_prefill and self.prefilling:
            decoding: list[Request] = []  # a whole-prompt prefill iteration, as before chunking
            shape, cut_short = None, []
        else:
            shape = self.planner.shape(self.running) if self.running else None
            cut_short = self._make_room(shape)
            decoding = list(self.running)
        context = sum(r.num_cached for r in decoding)
        plan = self._plan_trees(decoding, shape, context)
        chunks = self._plan_chunks(decoding, plan, context)
        if not decoding and not chunks:  # _make_room finished the last request
            return cut_short
        stats = IterationStats(
            "decode" if decoding else "prefill",
            len(decoding) if decoding else len(chunks),
            0,
            budget=self.cfg.budget,
            speculative=self.cfg.speculative and bool(decoding),
            drafted=plan.shape is not None,
            draft_nodes=sum(len(t) - 1 for t in plan.trees),
            draft_s=plan.draft_s,
            select_s=plan.select_s,
        )
        if plan.shape is not None:
            stats.depth, stats.width = plan.shape.depth, plan.shape.width
        t_verify = self.clock()
        changed = self._forward_and_commit(decoding, plan, chunks, stats, context)
        end = self.clock()
        stats.verify_s = end - t_verify
        stats.total_s = end - start
        if gap is not None:
            stats.host_s = max(0.0, gap + stats.total_s - stats.forward_s - stats.draft_s)
            rate = max(0.1, 1.0 / (self._host_samples + 1))  # the mean until 10 samples
            self.host_s += rate * (stats.host_s - self.host_s)
            self._host_samples += 1
        self.planner.after_iteration(
            plan, len(decoding), stats.accepted_tokens, stats.num_tokens, context, stats.total_s
        )
        self.last_stats = stats
        if decoding:
            per = (stats.emitted_tokens - stats.prefill_requests) / len(decoding)
            self.tokens_per_request += 0.1 * (max(per, 1.0) - self.tokens_per_request)
            if stats.host_s is not None:  # busy since the last iteration: a true period
                period = stats.total_s + gap
                last = self.decode_period_s
                self.decode_period_s = period if last is None else last + 0.2 * (period - last)
                tokens = stats.num_tokens / len(decoding)
                self._forward_tokens_per_request += 0.2 * (
                    tokens - self._forward_tokens_per_request
                )
        self._retire_finished()
        busy = self.running or self.prefilling or self.waiting
        self._busy_until = self.clock() if busy else None
        out = cut_short + changed
        return out + [r for r in self._failed if r not in out]

    def _plan_trees(
        self, decoding: list[Request], shape: SpecShape | None, context: int
    ) -> TreePlan:
        pending = sum(prefill_target(r) - r.num_cached for r in self.prefilling)
        extra = min(pending, self.cfg.max_prefill_chunk)  # roughly what prefill adds to t_spec
        return self.planner.plan(decoding, shape, context, extra)

    def _plan_chunks(
        self, decoding: list[Request], plan: TreePlan, context: int
    ) -> list[tuple[Request, int]]:
        """(request, prompt tokens) to prefill in this forward, FIFO."""
        if not self.prefilling:
            return []
        if not self.cfg.chunked_prefill:
            return [(r, prefill_target(r) - r.num_cached) for r in self.prefilling]
        assert self.cost is not None
        tree_tokens = sum(len(s) for s in plan.selections)
        budget = chunk_tokens(
            self.iteration_s,
            decoding,
            plan.expected_tokens,
            self.prefilling,
            tree_tokens,
            context,
            self.clock(),
            self.cfg.max_prefill_chunk,
            self.cfg.max_num_batched_tokens,
            self.cfg.min_prefill_chunk,
            self.cfg.slo_pace_margin,
            self.cfg.slo_repay,
        )
        chunks = []
        for r in self.prefilling:
            if budget <= 0:
                break
            n = min(budget, prefill_target(r) - r.num_cached)
            if n > 0:
                chunks.append((r, n))
                budget -= n
        return chunks

    def _forward_and_commit(
        self,
        decoding: list[Request],
        plan: TreePlan,
        chunks: list[tuple[Request, int]],
        stats: IterationStats,
        context: int,
    ) -> list[Request]:
        """One target forward over the trees and the chunks (and the draft over the chunks)."""
        cache = self.engine.target.cache
        builder = SequenceBatchBuilder()
        vtrees, rows, flat = [], [], []  # flat: each sequence's first token in the batch
        for r, tree, sel in zip(decoding, plan.trees, plan.selections):
            vt = build_verify_tree(tree, sel)
            n = len(vt.tokens)
            flat.append(len(builder.batch.token_ids))
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
        chunk_rows = []
        for r, n in chunks:
            start, end = r.num_cached, r.num_cached + n
            last = end == prefill_target(r) and not r.output_token_ids  # first token sampled
            flat.append(len(builder.batch.token_ids))
            idx = builder.add(
                r.all_token_ids[start:end],
                list(range(start, end)),
                end,
                r.block_table,
                logits="last" if last else "none",
            )
            chunk_rows.append(idx[0] if idx else None)
        total = len(builder.batch.token_ids)
        stats.prefill_tokens = total - stats.num_tokens
        stats.prefill_requests = len(chunks)
        if not decoding:
            stats.num_tokens = stats.prefill_tokens
        ctl = self.controller
        pad = ctl is not None and self.engine.target.supports_padding
        silent, silent_pairs = builder.batch.silent_tokens()  # prompt-chunk tokens, mostly
        pad_to = ctl.pad_to(total, context, silent, silent_pairs) if pad else total
        t_forward = self.clock()
        logits = self.engine.target.forward(builder.batch, pad_to=pad_to)
        now = self.clock()
        stats.padded_tokens = pad_to
        stats.forward_s = now - t_forward
        if self.cost is not None:
            chunk_context = sum(r.num_cached for r, _ in chunks)
            # Padding rows return no logits either.
            self.cost.observe(
                pad_to,
                context + chunk_context,
                now - t_forward,
                silent + pad_to - total,
                silent_pairs,
            )
        self._draft_prefill(chunks)
        self._chunk_features(chunks, flat)
        self._commit_trees(decoding, plan, vtrees, rows, logits, stats, now, flat)
        return self._commit_chunks(chunks, chunk_rows, logits, stats, now) + decoding

    def _draft_prefill(self, chunks: list[tuple[Request, int]]) -> None:
        """The draft model computes the same prompt tokens into its own KV."""
        d = self.engine.draft
        if d is None or not chunks or self.engine.draft_is_head:
            return
        ctl = self.controller
        if ctl is not None and not ctl.drafting_on:
            # Drafting is off (it does not pay): do not pay for draft prefill either. When it
            # comes back on, the drafter's first step feeds every token the draft has not seen.
            return
        builder = SequenceBatchBuilder()
        for r, n in chunks:
            start, end = r.draft_num_cached, r.num_cached + n
            if end > start:
                builder.add(
                    r.all_token_ids[start:end],
                    list(range(start, end)),
                    end,
                    r.draft_block_table,
                    logits="none",
                )
                r.draft_num_cached = end
        if len(builder):
            d.forward(builder.batch)
        if self.engine.draft_prefix is not None:
            for r, _ in chunks:
                self.engine.draft_prefix.register(
                    r.draft_block_table, r.all_token_ids, r.draft_num_cached, r.draft_block_hashes
                )

    def _chunk_features(self, chunks, flat: list[int]) -> None:
        """A feature-reading drafter (EAGLE) gets the target's hidden states of every prompt
        token prefilled now (the roots and accepted nodes: `_commit_trees`)."""
        d = self.drafter
        if d is None or not d.wants_features or not chunks:
            return
        hidden = self.engine.target.last_hidden
        assert hidden is not None
        for (r, n), start in zip(chunks, flat[-len(chunks) :]):
            d.observe_features(r, r.num_cached, hidden[start : start + n])

    def _commit_trees(self, decoding, plan, vtrees, rows, logits, stats, now, flat) -> None:
        features = self.drafter is not None and self.drafter.wants_features
        for r, tree, vt, row, start in zip(decoding, plan.trees, vtrees, rows, flat):
            try:
                self._commit_tree(r, tree, vt, row, start, logits, stats, now, features)
            except Exception as exc:  # this request's walk or commit: it alone fails
                self.fail(r, exc)

    def _commit_tree(self, r, tree, vt, row, start, logits, stats, now, features) -> None:
        """Walk one request's verified tree, keep the accepted path's KV, emit its tokens."""
        cache, ctl, prefix = self.engine.target.cache, self.controller, self.engine.target_prefix
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
        if len(vt) > 1:
            taken = [vt.source_nodes[v] for v in accepted]
            if ctl is not None:
                ctl.observe_verification(tree, vt.source_nodes, taken)
            if self.acceptance_log is not None:
                self.acceptance_log.record(tree, vt.source_nodes, taken)
        keep = [0] + accepted
        if features:  # the root's and accepted nodes' hidden states, in path order
            hidden = self.engine.target.last_hidden
            assert hidden is not None and self.drafter is not None
            self.drafter.observe_features(r, r.num_cached, hidden[[start + v for v in keep]])
        cache.keep_subset(r.block_table, r.num_cached, keep)
        r.num_cached += len(keep)
        emitted = self.output.commit(r, [vt.tokens[v] for v in accepted] + [bonus], now)
        if prefix is not None:
            prefix.register(r.block_table, r.all_token_ids, r.num_cached, r.block_hashes)
        m = r.metrics
        m.num_iterations += 1
        m.num_tree_tokens += len(vt.tokens) - 1
        m.num_accepted_tokens += len(accepted)
        stats.tree_tokens += len(vt.tokens) - 1
        stats.accepted_tokens += len(accepted)
        stats.emitted_tokens += emitted

    def _commit_chunks(self, chunks, chunk_rows, logits, stats, now) -> list[Request]:
        """Advance prefills; a request whose prompt is complete samples its first token."""
        done = []
        for (r, n), row in zip(chunks, chunk_rows):
            try:
                if self._commit_chunk(r, n, row, logits, stats, now):
                    done.append(r)
            except Exception as exc:  # e.g. detokenizing its first token: it alone fails
                self.fail(r, exc)
        return done

    def _commit_chunk(self, r: Request, n: int, row, logits, stats, now) -> bool:
        """Advance one prefill; True when its prompt is complete (it joins the running)."""
        r.num_cached += n
        prefix = self.engine.target_prefix
        if prefix is not None:
            prefix.register(r.block_table, r.all_token_ids, r.num_cached, r.block_hashes)
        if r.num_cached < prefill_target(r):
            return False
        self.prefilling.remove(r)
        self.running.append(r)
        if row is not None:  # a fresh request: its first token comes from the last chunk
            p = r.params
            _, token = verify(
                logits[row : row + 1],
                [r.last_token],
                [-1],
                p.temperature,
                p.top_k,
                p.top_p,
                r.generator,
            )
            self.output.commit(r, [token], now)
            stats.emitted_tokens += 1
        return True

    # ------------------------------------------------------------------ KV pressure
    def _make_room(self, shape: SpecShape | None) -> list[Request]:
        """Preempt (recompute later) the newest requests until every tree fits in free KV.

        Prefilling requests go first (newest first), then decoding ones. Returns the request
        finished for lack of KV, if even it alone no longer fits.
        """
        t_cache, d = self.engine.target.cache, self.engine.draft
        tree_nodes = 1 if shape is None else shape.max_nodes
        scratch = self.planner.scratch_tokens(shape)
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
                return []
            if self.prefilling:
                victim = self.prefilling.pop()
            else:
                victim = self.running.pop()
                if not self.running:
                    # Alone and still too big: the pool cannot hold this request any longer.
                    self._free(victim)
                    victim.finish("length", self.clock())
                    return [victim]
            self._free(victim)
            victim.status = RequestStatus.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
        return []
