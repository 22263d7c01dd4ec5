"""Offline API shaped like vLLM's: `LLM(...).generate(prompts, SamplingParams(...))`.

`LLMEngine` is the step-wise core that both `LLM` and the HTTP server drive: add requests,
call `step()` repeatedly, read back `RequestOutput`s with the new text in `delta_text`.
It is not thread-safe: one thread owns it (the server puts it in its own thread).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from typing import Any, cast

from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig
from adaserve.exec.engine import ExecutionEngine
from adaserve.exec.model.eagle import is_eagle_head
from adaserve.request_manager.admission import Admission
from adaserve.request_manager.control.cost_model import ForwardCostModel
from adaserve.request_manager.request import Request, RequestOutput, SamplingParams
from adaserve.request_manager.scheduler import Scheduler
from adaserve.request_manager.structured import GrammarCompiler, StructuredOutput

logger = logging.getLogger(__name__)


def encode_prompt(tokenizer, prompt: str | Sequence[int], add_special_tokens: bool = True):
    """A prompt's token ids as requests get them: a text prompt with the tokenizer's special
    tokens (BOS) as transformers' `tokenizer(prompt)` adds them, unless asked not to; token
    ids as they are."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    return [int(t) for t in prompt]


def encode_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    add_special_tokens: bool = False,
) -> list[int]:
    """Chat messages through the tokenizer's chat template, as token ids (the template writes
    its own special tokens; `add_special_tokens` adds the tokenizer's on top, as vLLM does)."""
    if add_special_tokens:
        text = tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        return list(tokenizer.encode(text, add_special_tokens=True))
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def decode_ids(tokenizer, vocab_size: int, token_ids: Sequence[int]) -> str:
    """The text of token ids; ValueError naming the first id outside the vocabulary."""
    for i, t in enumerate(token_ids):
        if not 0 <= t < vocab_size:
            raise ValueError(f"tokens[{i}] = {t} is outside the vocabulary [0, {vocab_size})")
    return tokenizer.decode(list(token_ids))


class LLMEngine:
    """Continuous-batching engine over one target (and draft) model."""

    def __init__(
        self,
        model_cfg: ModelConfig,
        cache_cfg: CacheConfig,
        sched_cfg: SchedulerConfig,
        prepare: bool = True,
    ) -> None:
        """`prepare=False`: skip what `apply_profile` redoes anyway (timing the forward cost
        curve that seeds the cost model, ~7 s on ggml here; capturing CUDA graphs); the
        engine serves only after `apply_profile`."""
        self.model_cfg, self.cache_cfg, self.sched_cfg = model_cfg, cache_cfg, sched_cfg
        self.prepared = prepare
        drafter = model_cfg.resolved_drafter
        need_draft: bool | str = False
        if sched_cfg.speculative and ("model" in drafter or "eagle" in drafter):
            need_draft = "eagle" if "eagle" in drafter else "model"
        self.engine = ExecutionEngine(model_cfg, cache_cfg, need_draft=need_draft)
        self.tokenizer = self.engine.tokenizer
        # What the engine loaded decides: a draft named by hub id is known to be an EAGLE
        # head only once its files are here.
        draft = self.engine.draft_path
        if model_cfg.drafter == "auto" and draft is not None and is_eagle_head(draft):
            drafter = "eagle"
        self.drafter = drafter
        # Unprepared: unseeded cost models, replaced with the scheduler by apply_profile.
        self.scheduler = Scheduler(sched_cfg, self.engine, drafter, measure=prepare)
        if prepare:
            self._capture_graphs()
        self._ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()

    def apply_profile(
        self,
        budget: int,
        t_spec_s: float,
        cost_model: ForwardCostModel | None = None,
        ceiling: int | None = None,
    ) -> None:
        """Use a measured budget B, initial t_spec and forward cost model (engine idle only);
        `ceiling`: the controlled policy's `budget_ceiling` (None: the configured one)."""
        if self.has_unfinished():
            raise RuntimeError("apply_profile needs an idle engine")
        if ceiling is None:
            ceiling = self.sched_cfg.budget_ceiling
        self.sched_cfg = replace(
            self.sched_cfg, budget=budget, budget_ceiling=ceiling, t_spec_init_s=t_spec_s
        )
        self.scheduler = Scheduler(self.sched_cfg, self.engine, self.drafter, cost_model)
        self._capture_graphs()  # a larger B reaches more token buckets
        self.prepared = True

    def use_clock(self, clock: Callable[[], float]) -> None:
        """Read every timestamp (arrivals, token times, deadlines, paces) from `clock` from
        now on (engine idle only): the benchmarks that serve engines side by side give each
        one a clock that runs only during its own steps (`bench.passes.OwnClock`)."""
        if self.has_unfinished():
            raise RuntimeError("use_clock needs an idle engine")
        self.engine.clock = clock
        self.scheduler.clock = clock
        self.scheduler.admission.clock = clock

    def _capture_graphs(self) -> None:
        """CUDA graphs of the decode iterations this configuration meets, captured now."""
        if not self.model_cfg.cuda_graph_capture_at_start:
            return
        budget = self.sched_cfg.budget if self.sched_cfg.speculative else 0
        start = time.perf_counter()
        n = self.engine.capture_graphs(self.sched_cfg.max_num_seqs, budget)
        if n:
            logger.info(
                "captured %d CUDA graphs in %.1f s (decode iterations of up to %d requests, "
                "B = %d)",
                n,
                time.perf_counter() - start,
                self.sched_cfg.max_num_seqs,
                budget,
            )

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def tokenize(self, prompt: str | Sequence[int], add_special_tokens: bool = True) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, add_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        return encode_chat(self.tokenizer, messages, add_generation_prompt)

    def detokenize(self, token_ids: Sequence[int]) -> str:
        return decode_ids(self.tokenizer, self.engine.vocab_size, token_ids)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        arrival_time: float | None = None,
        best_effort: bool = False,
    ) -> Request:
        """Queue a request; raises ValueError naming the problem for bad input. `best_effort`:
        admission could not meet its SLO and serves it anyway (`Request.best_effort`)."""
        if not self.prepared:
            raise RuntimeError("an engine built with prepare=False serves after apply_profile")
        if params.n != 1:
            raise ValueError(
                f"n = {params.n}: the engine runs one sample per request; use LLM.generate or "
                "add params.for_choice(j) for each j"
            )
        ids = self.tokenize(prompt)
        grammar = None
        if params.structured_output is not None:
            grammar = self.grammars.grammar(params.structured_output, params.stop_token_ids)
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        req = Request(
            rid,
            ids,
            params,
            prompt=prompt if isinstance(prompt, str) else None,
            # Arrivals, token times and deadlines all on the clock the scheduler reads.
            arrival_time=arrival_time if arrival_time is not None else self.engine.clock(),
            default_seed=self.model_cfg.seed,
        )
        req.grammar = grammar
        if best_effort:
            req.best_effort = req.prefill_yields = True
        self.scheduler.add(req)
        return req

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler of this model's tokenizer, built on first use (the
        server's tokenizer thread compiles a request's constraint before the engine thread
        takes the request: both may ask first)."""
        with self._grammars_lock:
            if self._grammars is None:
                # A copy of its own: the first call may come from the server's tokenizer
                # thread while the engine thread decodes with this tokenizer.
                self._grammars = GrammarCompiler(
                    copy.deepcopy(self.tokenizer),
                    self.engine.vocab_size,
                    self.scheduler.output.eos_ids,
                )
            return self._grammars

    def check_structured_output(self, so: StructuredOutput) -> None:
        """Compile a constraint (cached for the request that carries it); ValueError saying
        what is wrong with it."""
        self.grammars.grammar(so)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        return None if req is None else self.scheduler.output.make_output(req)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        """One iteration; outputs of requests that got tokens or finished."""
        plan = self.scheduler.schedule()
        out = self.engine.run(plan)
        return self._outputs(self.scheduler.commit(plan, out))

    @property
    def admission(self) -> Admission:
        """Load averages, predicted TPOT and refusal (what `--admission slo` asks)."""
        return self.scheduler.admission

    def _outputs(self, changed: list[Request]) -> list[RequestOutput]:
        outs = []
        for r in changed:
            try:
                outs.append(self.scheduler.output.make_output(r))
            except Exception as exc:  # detokenizing this request: it alone fails
                if not r.finished or r.finish_reason != "error":
                    self.scheduler.fail(r, exc)
                outs.append(self.scheduler.output.error_output(r))
        return outs

    @property
    def last_stats(self):
        return self.scheduler.last_stats


class LLM:
    """Offline batched generation. Keyword arguments go to the config dataclasses by name."""

    def __init__(
        self,
        model: str | None = None,
        draft_model: str | None = None,
        policy: str = "incremental",
        **kwargs,
    ) -> None:
        groups: dict[type, dict[str, Any]] = {
            ModelConfig: {"model": model, "draft_model": draft_model},
            CacheConfig: {},
            SchedulerConfig: {"policy": policy},
        }
        for key, value in kwargs.items():
            owner = next((c for c in groups if key in {f.name for f in fields(c)}), None)
            if owner is None:
                raise TypeError(f"LLM() got an unknown argument {key!r}")
            groups[owner][key] = value
        self.llm_engine = LLMEngine(
            ModelConfig(**groups[ModelConfig]),
            CacheConfig(**groups[CacheConfig]),
            SchedulerConfig(**groups[SchedulerConfig]),
        )

    @property
    def tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (strings or token-id lists); outputs in prompt order.

        One prompt (a string or a token-id list) may be passed on its own."""
        one = isinstance(prompts, str) or (prompts and isinstance(prompts[0], int))
        # (The element check above is what tells one prompt from many; mypy cannot follow it.)
        batch = cast("Sequence[str | Sequence[int]]", [prompts] if one else prompts)
        params = sampling_params or SamplingParams()
        plist = list(params) if isinstance(params, Sequence) else [params] * len(batch)
        if len(plist) != len(batch):
            raise ValueError(f"got {len(plist)} sampling params for {len(batch)} prompts")
        eng = self.llm_engine
        now = eng.engine.clock()
        reqs: list[list[Request]] = []  # per prompt, its n samples
        try:
            for p, sp in zip(batch, plist):
                reqs.append([])
                for j in range(sp.n):
                    reqs[-1].append(eng.add_request(p, sp.for_choice(j), arrival_time=now))
        except Exception:
            for r in (r for samples in reqs for r in samples):  # all or nothing
                eng.abort(r.request_id)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < sum(map(len, reqs)):
            for out in eng.step():
                if out.finished:
                    done[out.request_id] = out
        return [_merged([done[r.request_id] for r in samples]) for samples in reqs]

    def chat(
        self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template, then generate."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        ids = [self.llm_engine.apply_chat_template(c) for c in convs]  # type: ignore[arg-type]
        return self.generate(ids, sampling_params)


def _merged(samples: list[RequestOutput]) -> RequestOutput:
    """A prompt's n samples as one output whose `outputs` are indexed 0..n-1 (vLLM's shape)."""
    first = samples[0]
    if len(samples) == 1:
        return first
    outputs = [dataclasses.replace(s.outputs[0], index=j) for j, s in enumerate(samples)]
    return dataclasses.replace(first, outputs=outputs)
