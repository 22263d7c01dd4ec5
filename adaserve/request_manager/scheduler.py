"""The scheduler: plan an iteration, hand it to the engine, commit what it returned.

    plan = scheduler.schedule()     # admit, draft + select trees, size prompt chunks, reserve KV
    out = engine.run(plan)          # one target forward over trees and chunks
    scheduler.commit(plan, out)     # walk the trees, keep accepted KV, emit tokens, advance prompts

One iteration carries, in a single target forward, the verification trees of the running
requests and chunks of waiting prompts (chunked prefill, sized by the running requests'
SLOs: `prefill.py`). `incremental` is the same loop with no draft: every tree is its root
alone, so verification degenerates to sampling one token from the target.
"""

from __future__ import annotations

import logging
import uuid
from collections import deque
from dataclasses import replace

import torch

from adaserve.config import SchedulerConfig
from adaserve.exec.batch import SequenceBatchBuilder
from adaserve.exec.runner import Engine, ForwardOutput
from adaserve.request_manager.acceptance_log import AcceptanceLog
from adaserve.request_manager.admission import Admission
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.drafters import Drafter
from adaserve.request_manager.logits_process import needs_processing, process_tree_logits
from adaserve.request_manager.logprobs import token_logprobs
from adaserve.request_manager.output import OutputProcessor
from adaserve.request_manager.pacing import deferred_rows
from adaserve.request_manager.plan import ChunkItem, IterationPlan, TreeItem
from adaserve.request_manager.policies import SpecShape
from adaserve.request_manager.prefill import chunk_tokens, prefill_order, prefill_target
from adaserve.request_manager.request import Request, RequestStatus
from adaserve.request_manager.speculation import TreePlan, TreePlanner
from adaserve.request_manager.stats import IterationStats
from adaserve.request_manager.timeline import IterationTimeline
from adaserve.tree import build_verify_tree, is_greedy, verify, walk_greedy

logger = logging.getLogger("adaserve.scheduler")


class Scheduler:
    """Owns the waiting, prefilling and running queues and advances them one iteration."""

    def __init__(
        self,
        cfg: SchedulerConfig,
        engine: Engine,
        drafter: str | Drafter = "auto",
        cost_model: ForwardCostModel | None = None,
        measure: bool = True,
    ) -> None:
        """`cost_model`: the target's forward cost (from a profile); measured here if None.
        `measure=False`: nothing is timed (a scheduler about to be replaced, with a profile's
        cost model: `LLMEngine(prepare=False)`); the cost models stay unseeded.

        `drafter`: a name (`make_drafter`) or a Drafter instance (the simulator's).
        """
        ids = getattr(engine.target.cache, "num_free_ids", None)
        if ids is not None and cfg.max_num_seqs + cfg.budget > ids:
            # ggml: each running request holds a sequence id and each extra leaf of a verified
            # tree borrows one (at most B leaves in a forward).
            raise ValueError(
                f"max_num_seqs {cfg.max_num_seqs} + budget {cfg.budget} exceeds the "
                f"{ids} sequence ids of the ggml backend; lower max_num_seqs"
            )
        if ids is not None and cfg.max_num_seqs + cfg.selection_budget > ids:
            cfg = replace(cfg, budget_ceiling=ids - cfg.max_num_seqs)  # as many leaves as ids
        self.cfg = cfg
        self.engine = engine
        self.clock = engine.clock
        # Set to an AcceptanceLog to record every verified tree (`--record-acceptance`).
        self.acceptance_log: AcceptanceLog | None = None
        if cfg.record_acceptance is not None:
            self.acceptance_log = AcceptanceLog(cfg.record_acceptance)
        # Set to an IterationTimeline to record every iteration (`--record-iterations`).
        self.timeline: IterationTimeline | None = None
        if cfg.record_iterations is not None:
            self.timeline = IterationTimeline(cfg.record_iterations, cfg.slo_pace_margin)
        self.output = OutputProcessor(
            engine.tokenizer, engine.max_model_len, engine.generation_eos_ids
        )
        self.waiting: deque[Request] = deque()
        # Admitted, prompt KV not complete yet; earliest TTFT deadline first (prefill_order).
        self.prefilling: list[Request] = []
        self.running: list[Request] = []  # decoding
        self.last_stats: IterationStats | None = None
        self.num_preemptions = 0
        self._failed: list[Request] = []  # failed since the iteration began
        if cost_model is None and (cfg.chunked_prefill or cfg.controlled):
            cost_model = ForwardCostModel(forget=cfg.cost_forget)
            if measure:
                cost_model.seed_measured(
                    engine.target, max(cfg.selection_budget, 64), cfg.speculative
                )
        self.cost = cost_model
        self.admission = Admission(
            cfg, cost_model, lambda: (self.running, self.prefilling, self.waiting), self.clock
        )
        self.planner = TreePlanner(cfg, engine, drafter, cost_model or ForwardCostModel(), measure)
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
        if any(t >= self.engine.vocab_size for t, _ in req.params.logit_bias):
            raise ValueError(
                f"logit_bias has token ids outside the vocabulary [0, {self.engine.vocab_size})"
            )
        if req.ttft_objective_ms is None:
            req.ttft_objective_ms = self.admission.ttft_objective_ms(
                len(req.prompt_token_ids), None
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
            req.schedule(self.clock())
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
        plan = self.schedule()
        return self.commit(plan, self.engine.run(plan))

    def schedule(self) -> IterationPlan:
        """Plan one iteration: admit, draft and select trees, size prompt chunks, reserve KV."""
        self._failed = []
        self._admit()
        start = self.clock()
        if not (self.running or self.prefilling):
            return IterationPlan.empty(start, self.cfg.selection_budget, idle=True)
        gap = self.admission.gap_s(start)
        deferred: list[Request] = []
        if not self.cfg.chunked_prefill and self.prefilling:
            decoding: list[Request] = []  # a whole-prompt prefill iteration, as before chunking
            shape, cut_short = None, []
        else:
            shape = self.planner.shape(self.running) if self.running else None
            cut_short = self._make_room(shape)
            decoding = list(self.running)
            deferred = self._deferred(decoding, start)
            if deferred:
                decoding = [r for r in decoding if r not in deferred]
        context = sum(r.num_cached for r in decoding)
        trees = self._plan_trees(decoding, shape, context)
        chunks = self._plan_chunks(decoding, trees, context)
        if not decoding and not chunks:  # _make_room finished the last request
            return IterationPlan.empty(start, self.cfg.selection_budget, tuple(cut_short))
        plan = self._build(decoding, trees, chunks, context, start, gap, cut_short)
        plan.stats.deferred_rows = len(deferred)
        return plan

    def _deferred(self, running: list[Request], now: float) -> list[Request]:
        """Streams far ahead of their pace that sit out this iteration so that a tighter one
        meets its SLO (`pacing.deferred_rows`; `--no-slo-defer-rows` keeps every row)."""
        if not self.cfg.slo_defer_rows or self.cost is None or len(running) < 2:
            return []
        cfg, adm = self.cfg, self.admission
        per_row = adm.forward_tokens_per_request if cfg.speculative else 1.0

        def rows_s(rows: int, context: int) -> float:
            # Speculating rows verify trees: priced at the forward tokens a row recently ran,
            # and paced by the tokens it recently emitted. Priced at one token each, a GPU
            # batch of ~2.5-token trees looked over every pace and rows sat out that it had
            # room for (paper-scale simulation: 54.5% against 68.0%).
            return adm.iteration_s(max(rows, round(per_row * rows)), context)

        return deferred_rows(
            rows_s,
            running,
            now,
            cfg.slo_pace_margin,
            cfg.slo_repay,
            cfg.slo_bank_spend,
            adm.tokens_per_request if cfg.speculative else 1.0,
            adm.decode_slowdown or 1.0,
        )

    def _plan_trees(
        self, decoding: list[Request], shape: SpecShape | None, context: int
    ) -> TreePlan:
        # Prompts served best effort ride only in time no pace needs: not in t_spec.
        pending = sum(
            prefill_target(r) - r.num_cached for r in self.prefilling if not r.best_effort
        )
        extra = min(pending, self.cfg.max_prefill_chunk)  # roughly what prefill adds to t_spec
        return self.planner.plan(decoding, shape, context, extra)

    def _plan_chunks(
        self, decoding: list[Request], plan: TreePlan, context: int
    ) -> list[tuple[Request, int]]:
        """(request, prompt tokens) to prefill in this forward, earliest TTFT deadline first."""
        if not self.prefilling:
            return []
        if not self.cfg.chunked_prefill:
            return [(r, prefill_target(r) - r.num_cached) for r in self.prefilling]
        self.prefilling[:] = prefill_order(self.prefilling)
        assert self.cost is not None
        tree_tokens = sum(len(s) for s in plan.selections)
        # Prompts served best effort (every prompt is, when one heads the queue) are priced as
        # iterations have recently run: they take the time the paces leave, not a prediction.
        slowdown = 1.0
        if self.prefilling[0].best_effort:
            slowdown = max(1.0, self.admission.decode_slowdown or 1.0)

        def cost(tokens: int, context: int, silent: int = 0, pairs: int = 0) -> float:
            return slowdown * self.admission.iteration_s(tokens, context, silent, pairs)

        budget = chunk_tokens(
            cost,
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
            self.cfg.slo_bank_spend,
            self.cfg.prefill_iteration_ms / 1000.0,
            self.engine.target.attention_tile_tokens,
            self.cfg.slo_future_lend,
        )
        chunks: list[tuple[Request, int]] = []
        for r in self.prefilling:
            # Prompts served best effort come last and take none of the time sized for the
            # prompts before them (their deadlines, the streams' banks): only a queue they head
            # sizes a chunk for them, from the time left at every stream's pace.
            if budget <= 0 or (r.best_effort and chunks):
                break
            n = min(budget, prefill_target(r) - r.num_cached)
            if n > 0:
                chunks.append((r, n))
                budget -= n
        return chunks

    def _build(
        self,
        decoding: list[Request],
        spec: TreePlan,
        chunks: list[tuple[Request, int]],
        context: int,
        start: float,
        gap: float | None,
        cut_short: list[Request],
    ) -> IterationPlan:
        """The batch of the trees and the chunks, with their KV slots reserved."""
        built = self.clock()
        cache = self.engine.target.cache
        builder = SequenceBatchBuilder()
        trees = []
        for r, tree, sel in zip(decoding, spec.trees, spec.selections):
            vt = build_verify_tree(tree, sel)
            n = len(vt.tokens)
            first = len(builder.batch.token_ids)
            cache.reserve(r.block_table, r.num_cached + n)
            rows = builder.add(
                vt.tokens,
                [r.num_cached + d for d in vt.depths],
                r.num_cached + n,
                r.block_table,
                tree=None if n == 1 else vt.parents,
            )
            trees.append(TreeItem(r, tree, vt, r.num_cached, first, tuple(rows)))
        num_tree_tokens = len(builder.batch.token_ids)
        draft_builder = SequenceBatchBuilder()
        items = []
        for r, n in chunks:
            begin, end = r.num_cached, r.num_cached + n
            last = end == prefill_target(r) and not r.output_token_ids  # first token sampled
            first = len(builder.batch.token_ids)
            idx = builder.add(
                r.all_token_ids[begin:end],
                list(range(begin, end)),
                end,
                r.block_table,
                logits="last" if last else "none",
            )
            items.append(
                ChunkItem(r, begin, end, first, idx[0] if idx else None, self._draft_end(r, end))
            )
            if items[-1].draft_end is not None:
                # The draft model computes the same prompt tokens into its own KV.
                d0 = r.draft_num_cached
                draft_builder.add(
                    r.all_token_ids[d0:end],
                    list(range(d0, end)),
                    end,
                    r.draft_block_table,
                    logits="none",
                )
        batch = builder.batch
        total = len(batch.token_ids)
        silent, silent_pairs, tree_pairs = batch.cost_terms()  # prompt chunks, tree nodes
        pad = self.engine.target.supports_padding
        pad_to = (
            self.controller.pad_to(total, context, silent, silent_pairs, tree_pairs)
            if pad
            else total
        )
        chunk_context = sum(r.num_cached for r, _ in chunks)
        predicted = None
        if self.cost is not None:
            predicted = self.cost.predict(
                pad_to, context + chunk_context, silent + pad_to - total, silent_pairs, tree_pairs
            )
        prefill_tokens = total - num_tree_tokens
        stats = IterationStats(
            "decode" if decoding else "prefill",
            len(decoding) if decoding else len(chunks),
            num_tree_tokens if decoding else prefill_tokens,
            prefill_tokens=prefill_tokens,
            prefill_requests=len(chunks),
            padded_tokens=pad_to,
            budget=self.cfg.selection_budget,
            speculative=self.cfg.speculative and bool(decoding),
            drafted=spec.shape is not None,
            draft_nodes=sum(len(t) - 1 for t in spec.trees),
            draft_s=spec.draft_s,
            select_s=spec.select_s,
        )
        if spec.shape is not None:
            stats.depth, stats.width = spec.shape.depth, spec.shape.width
        return IterationPlan(
            trees=tuple(trees),
            chunks=tuple(items),
            batch=batch,
            pad_to=pad_to,
            draft_batch=draft_builder.batch if len(draft_builder) else None,
            budget=self.cfg.selection_budget,
            context=context,
            chunk_context=chunk_context,
            predicted_s=predicted,
            speculation=spec,
            stats=stats,
            started_s=start,
            built_s=built,
            gap_s=gap,
            cut_short=tuple(cut_short),
        )

    def _draft_end(self, r: Request, end: int) -> int | None:
        """How far a draft model's KV catches up on this chunk (None: it does not)."""
        if self.engine.draft is None or self.engine.draft_is_head:
            return None
        decoding = len(self.running) + len(self.prefilling)
        context = sum(q.num_cached for q in self.running) + end
        if not self.planner.draft_may_pay(decoding, context):
            # Drafting is off or could not pay at this load even if the target accepted every
            # draft token: do not pay for draft prefill either. If it comes back on, the
            # drafter's first step feeds every token the draft has not seen.
            return None
        return end if end > r.draft_num_cached else None

    # ------------------------------------------------------------------ commit
    def commit(self, plan: IterationPlan, out: ForwardOutput) -> list[Request]:
        """Apply what the engine returned: verify trees, keep accepted KV, emit tokens, advance
        prompts; returns the requests that got tokens or finished in this iteration."""
        if plan.idle:
            self.admission.busy_until = None
            return []
        if plan.is_empty:
            return list(plan.cut_short) + self._failed
        stats = plan.stats
        stats.forward_s = out.forward_s
        if self.cost is not None:
            silent, silent_pairs, tree_pairs = plan.batch.cost_terms()
            total = len(plan.batch.token_ids)
            # Padding rows return no logits either.
            self.cost.observe(
                plan.pad_to,
                plan.context + plan.chunk_context,
                out.forward_s,
                silent + plan.pad_to - total,
                silent_pairs,
                tree_pairs,
            )
        if plan.trees and not plan.chunks:
            # How this decode forward compared with its prediction (trees against plain).
            self.controller.observe_forward(
                plan.predicted_s,
                out.forward_s,
                len(plan.batch.token_ids) - len(plan.trees),
                plan.pad_to > len(plan.batch.token_ids),
            )
        self._commit_draft_prefill(plan)
        self._chunk_features(plan, out)
        best = self._greedy_argmax(plan, out)
        for item in plan.trees:
            try:
                self._commit_tree(item, out, stats, best)
            except Exception as exc:  # this request's walk or commit: it alone fails
                self.fail(item.request, exc)
        done = []
        for chunk in plan.chunks:
            try:
                if self._commit_chunk(chunk, out, stats, best):
                    done.append(chunk.request)
            except Exception as exc:  # e.g. detokenizing its first token: it alone fails
                self.fail(chunk.request, exc)
        end = self.clock()
        stats.verify_s = end - plan.built_s
        stats.total_s = end - plan.started_s
        decoding = plan.decoding
        self.admission.observe(stats, plan.gap_s, len(decoding), plan.context)
        self.planner.after_iteration(
            plan.speculation,
            len(decoding),
            stats.accepted_tokens,
            stats.num_tokens,
            plan.context,
            stats.total_s,
        )
        self.last_stats = stats
        if self.timeline is not None:
            self.timeline.record(plan)
        self._retire_finished()
        busy = self.running or self.prefilling or self.waiting
        self.admission.busy_until = self.clock() if busy else None
        changed = list(plan.cut_short) + done + decoding
        return changed + [r for r in self._failed if r not in changed]

    def _commit_draft_prefill(self, plan: IterationPlan) -> None:
        """The draft model now holds the chunks' prompt tokens too."""
        for c in plan.chunks:
            if c.draft_end is not None:
                c.request.draft_num_cached = c.draft_end
        if self.engine.draft_prefix is not None and plan.draft_batch is not None:
            for c in plan.chunks:
                r = c.request
                self.engine.draft_prefix.register(
                    r.draft_block_table, r.all_token_ids, r.draft_num_cached, r.draft_block_hashes
                )

    def _chunk_features(self, plan: IterationPlan, out: ForwardOutput) -> None:
        """A feature-reading drafter (EAGLE) gets the target's hidden states of every prompt
        token prefilled now (the roots and accepted nodes: `_commit_tree`)."""
        d = self.drafter
        if d is None or not d.wants_features or not plan.chunks:
            return
        assert out.hidden is not None
        for c in plan.chunks:
            d.observe_features(
                c.request, c.start, out.hidden[c.first_row : c.first_row + c.num_tokens]
            )

    def _greedy_argmax(self, plan: IterationPlan, out: ForwardOutput) -> list[int] | None:
        """Every logit row's argmax, read back in one go, when a request of this iteration
        decodes greedily from raw logits (its walk needs nothing else); None when none does.
        One read-back per iteration instead of one per request: on a GPU each is a wait for
        the device, on a CPU each argmax call costs ~0.1 ms over a 49k vocabulary."""
        if out.logits is None:
            return None
        rows = [i.request for i in plan.trees]
        rows += [c.request for c in plan.chunks if c.logit_row is not None]
        if not any(self._raw_greedy(r) for r in rows):
            return None
        return out.logits.argmax(dim=-1).tolist()

    @staticmethod
    def _raw_greedy(r: Request) -> bool:
        """Greedy on the target's logits as they are (no grammar, penalties or min_p)."""
        return (
            is_greedy(r.params.temperature) and r.grammar is None and not needs_processing(r.params)
        )

    def _commit_tree(
        self,
        item: TreeItem,
        out: ForwardOutput,
        stats: IterationStats,
        best: list[int] | None = None,
    ) -> None:
        """Walk one request's verified tree, keep the accepted path's KV, emit its tokens.
        `best`: every logit row's argmax (`_greedy_argmax`), for a raw greedy request."""
        r, vt, rows = item.request, item.tree, item.logit_rows
        cache, prefix = self.engine.target.cache, self.engine.target_prefix
        assert out.logits is not None
        p = r.params
        if best is not None and self._raw_greedy(r):
            accepted, bonus = walk_greedy(best[rows[0] : rows[-1] + 1], vt.tokens, vt.parents)
        else:
            logits = self._processed(r, out.logits[rows[0] : rows[-1] + 1], vt.tokens, vt.parents)
            accepted, bonus = verify(
                logits,
                vt.tokens,
                vt.parents,
                p.temperature,
                p.top_k,
                p.top_p,
                r.generator,
            )
        if len(vt) > 1:
            taken = [vt.source_nodes[v] for v in accepted]
            self.controller.observe_verification(item.candidate, vt.source_nodes, taken)
            if self.acceptance_log is not None:
                self.acceptance_log.record(item.candidate, vt.source_nodes, taken)
        keep = [0] + accepted
        if self.drafter is not None and self.drafter.wants_features:
            # The root's and accepted nodes' hidden states, in path order.
            assert out.hidden is not None
            self.drafter.observe_features(
                r, r.num_cached, out.hidden[[item.first_row + v for v in keep]]
            )
        cache.keep_subset(r.block_table, r.num_cached, keep)
        r.num_cached += len(keep)
        tokens = [vt.tokens[v] for v in accepted] + [bonus]
        emitted = self.output.commit(r, tokens, out.end_s)
        if p.logprobs is not None:  # token i was predicted by the row of path node keep[i]
            tree_logits = out.logits[rows[0] : rows[-1] + 1]
            self._record_logprobs(r, tree_logits[keep[:emitted]], tokens[:emitted])
        if prefix is not None:
            prefix.register(r.block_table, r.all_token_ids, r.num_cached, r.block_hashes)
        m = r.metrics
        m.num_iterations += 1
        m.num_tree_tokens += len(vt.tokens) - 1
        m.num_accepted_tokens += len(accepted)
        stats.tree_tokens += len(vt.tokens) - 1
        stats.accepted_tokens += len(accepted)
        stats.emitted_tokens += emitted

    def _processed(
        self, r: Request, logits: torch.Tensor, tokens: list[int], parents: list[int]
    ) -> torch.Tensor:
        """A tree's logits after the request's structured output, penalties, min_p and
        min_tokens, each node with its own path's context; unchanged when the request uses
        none of them. The grammar's mask comes first, as in vLLM (min_p then sees the
        allowed tokens only)."""
        p = r.params
        if r.grammar is not None:
            logits = r.grammar.mask_tree(logits, tokens, parents)
        if not needs_processing(p):
            return logits
        stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.output.eos_ids)
        return process_tree_logits(
            logits, tokens, parents, r.prompt_token_ids, r.output_token_ids, p, stop_ids
        )

    def _record_logprobs(self, r: Request, logits: torch.Tensor, tokens: list[int]) -> None:
        """The emitted tokens' logprobs from the raw rows that predicted them ([k, V])."""
        assert r.params.logprobs is not None
        r.logprobs += token_logprobs(logits, tokens, r.params.logprobs, self.output.token_text)

    def _commit_chunk(
        self,
        c: ChunkItem,
        out: ForwardOutput,
        stats: IterationStats,
        best: list[int] | None = None,
    ) -> bool:
        """Advance one prefill; True when its prompt is complete (it joins the running).
        `best` as in `_commit_tree`."""
        r = c.request
        r.num_cached += c.num_tokens
        prefix = self.engine.target_prefix
        if prefix is not None:
            prefix.register(r.block_table, r.all_token_ids, r.num_cached, r.block_hashes)
        if r.num_cached < prefill_target(r):
            return False
        self.prefilling.remove(r)
        self.running.append(r)
        if c.logit_row is not None:  # a fresh request: its first token comes from the last chunk
            assert out.logits is not None
            p = r.params
            root = [r.last_token]
            if best is not None and self._raw_greedy(r):
                token = best[c.logit_row]
            else:
                _, token = verify(
                    self._processed(r, out.logits[c.logit_row : c.logit_row + 1], root, [-1]),
                    root,
                    [-1],
                    p.temperature,
                    p.top_k,
                    p.top_p,
                    r.generator,
                )
            self.output.commit(r, [token], out.end_s)
            if p.logprobs is not None:
                self._record_logprobs(r, out.logits[c.logit_row : c.logit_row + 1], [token])
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
