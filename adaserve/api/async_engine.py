"""The engine loop in its own thread, talking to asyncio through queues.

`LLMEngine` is single-threaded, so one thread owns it (the detokenizer runs in `step()`).
Prompts are tokenized and chat-templated before they reach it, on a tokenizer thread with a
copy of the tokenizer of its own, so a long prompt never stalls the streams in the batch;
/tokenize and /detokenize run there too. HTTP handlers send commands (add, abort, stop)
through a thread-safe queue; the engine thread drains them between iterations, so requests
from all connections batch together, and posts each request's results back to the event loop
with `call_soon_threadsafe`, one callback per iteration.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal, Protocol

from adaserve.api.logs import log_finished
from adaserve.api.metrics import FinishedRequest, ServerMetrics
from adaserve.exec.openmp import release_thread_pool
from adaserve.llm import LLMEngine, decode_ids, encode_chat, encode_prompt
from adaserve.request_manager.logprobs import TokenLogprob
from adaserve.request_manager.request import RequestOutput, SamplingParams
from adaserve.request_manager.structured import StructuredOutput

logger = logging.getLogger("adaserve.api")


@dataclass(frozen=True)
class Accepted:
    """The engine queued the request."""

    prompt_token_ids: list[int]
    # Admission could not promise its SLO and serves it best effort
    # (`Admission.best_effort_refusal`).
    best_effort: bool = False


@dataclass(frozen=True)
class Rejected:
    """The engine refused the request (the client's fault: a 400); `message` says why."""

    message: str


@dataclass(frozen=True)
class Refused:
    """Admission said no under the current load (a 429 with Retry-After, not the client's
    fault); `message` says why."""

    message: str


@dataclass(frozen=True)
class EngineFailed:
    """The engine raised while running the request (the server's fault: a 500)."""

    message: str


@dataclass(frozen=True)
class Delta:
    """New output of a request; `summary` is set on the last one."""

    text: str
    token_ids: list[int]
    finish_reason: str | None
    # Set on the last Delta only: the whole output and what the request measured.
    full_text: str = ""
    full_token_ids: tuple[int, ...] = ()
    summary: FinishedRequest | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of `token_ids`, if asked
    full_logprobs: tuple[TokenLogprob, ...] = ()  # on the last Delta: of the whole output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


StreamItem = Accepted | Rejected | Refused | EngineFailed | Delta
ENGINE_STOPPED = "the engine has stopped (server shutting down)"
# Seconds an idle engine thread waits for commands before it looks at held requests again.
HOLD_POLL_S = 0.005


@dataclass(frozen=True)
class Tokenize:
    """A /tokenize request: a prompt, or chat messages through the chat template, tokenized
    as a generation request would be."""

    prompt: str | None = None
    messages: list[dict] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def run(self, tokenizer) -> list[int]:
        if self.messages is not None:
            return encode_chat(
                tokenizer, self.messages, self.add_generation_prompt, self.add_special_tokens
            )
        assert self.prompt is not None
        return encode_prompt(tokenizer, self.prompt, self.add_special_tokens)


class RequestStream:
    """The event-loop side of one request: an asyncio queue the engine thread fills."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        self.started = False  # produced a token or ended: no longer counts as waiting
        self.done = False

    async def get(self) -> StreamItem:
        return await self.queue.get()


class EngineFront(Protocol):
    """What the HTTP routes need of the engine behind them, called from the event loop:
    `AsyncEngine` (the engine thread of this process) or `RemoteEngine` (replicas on Ray
    Serve, adaserve/cluster/ray_serve.py). A submitted request's stream yields Accepted,
    Rejected, Refused or EngineFailed first, then Deltas until one is finished."""

    metrics: ServerMetrics
    num_waiting: int  # submitted, no token yet
    num_open: int  # submitted, stream not ended
    idle: threading.Event  # set while num_open is 0

    @property
    def alive(self) -> bool: ...

    def start(self) -> None: ...

    async def shutdown(self, timeout_s: float = 30.0) -> None: ...

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        fill_max_tokens: bool = False,
        arrival_time: float | None = None,
        add_special_tokens: bool | None = None,
    ) -> RequestStream: ...

    def abort(self, stream: RequestStream) -> None: ...

    def abort_all(self) -> None: ...

    async def tokenize(self, t: Tokenize) -> list[int]:
        """Token ids; ValueError for input the tokenizer or chat template refuses,
        RuntimeError when no engine can answer."""
        ...

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids; ValueError for ids outside the vocabulary."""
        ...

    async def check_structured_output(self, so: StructuredOutput) -> None:
        """Compile a structured output constraint ahead of its request; ValueError saying
        what is wrong with it."""
        ...


@dataclass(frozen=True)
class _Add:
    stream: RequestStream
    prompt_token_ids: list[int]
    params: SamplingParams
    # Chat without max_tokens: generate up to the model's length limit (as OpenAI and vLLM).
    fill_max_tokens: bool
    arrival_time: float


@dataclass(frozen=True)
class _Abort:
    request_id: str


class _Stop:
    pass


class _AbortAll:
    """The drain grace period is over: finish every request now, finish reason "abort"."""


class StreamBook:
    """The event-loop side of an engine front: open streams counted, items handed over."""

    def __init__(self) -> None:
        # Requests submitted that have not produced a token yet, and requests submitted
        # whose stream has not ended (a drain waits for this to reach 0).
        self.num_waiting = 0
        self.num_open = 0
        self.idle = threading.Event()  # set while num_open is 0 (a drain waits on it)
        self.idle.set()

    def _open(self, request_id: str) -> RequestStream:
        stream = RequestStream(request_id, asyncio.get_running_loop())
        self.num_waiting += 1
        self.num_open += 1
        self.idle.clear()
        return stream

    def _mark_done(self, stream: RequestStream) -> None:
        if not stream.done:
            stream.done = True
            self.num_open -= 1
            if self.num_open == 0:
                self.idle.set()
        if not stream.started:
            stream.started = True
            self.num_waiting -= 1

    def _deliver(self, items: list[tuple[RequestStream, StreamItem]]) -> None:
        """Runs on the event loop: hand items to their streams."""
        for stream, item in items:
            if ends_stream(item):
                self._mark_done(stream)
            elif isinstance(item, Delta) and not stream.started:
                stream.started = True
                self.num_waiting -= 1
            stream.queue.put_nowait(item)


def ends_stream(item: StreamItem) -> bool:
    """Nothing follows this item on its stream."""
    return isinstance(item, (Rejected, Refused, EngineFailed)) or (
        isinstance(item, Delta) and item.finished
    )


class AsyncEngine(StreamBook):
    """Owns the engine thread. Public methods are called from the event loop."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, admission: str = "queue") -> None:
        super().__init__()
        self.engine = engine
        self.metrics = metrics
        self.admission = admission
        self._commands: queue.SimpleQueue[_Add | _Abort | _AbortAll | _Stop] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        # Requests --admission slo would refuse for their TPOT, held until the load allows
        # them or their hold runs out (`_add`); engine thread only, in arrival order.
        self._held: list[_Add] = []
        self._thread = threading.Thread(target=self._run, name="adaserve-engine", daemon=True)
        # Prompts are tokenized here, one at a time, by a tokenizer of this thread's own (a
        # Rust tokenizer borrowed by two threads at once can fail "Already borrowed").
        self._tokenizer = copy.deepcopy(engine.tokenizer)
        self._vocab_size = engine.engine.vocab_size
        self._tokenizing = ThreadPoolExecutor(1, thread_name_prefix="adaserve-tokenizer")
        self._last_stats: object = None
        # Called on the engine thread after every iteration (a replica's routing stats).
        self.on_state: Callable[[], None] | None = None

    # ------------------------------------------------------------------ event-loop side
    def start(self) -> None:
        # The engine was built on this thread: free the OpenMP workers that left docked here,
        # or the engine thread's forwards run at a third of their speed (exec/openmp.py).
        release_thread_pool()
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(
        self,
        request_id: str,
        params: SamplingParams,
        *,
        prompt: str | list[int] | None = None,
        messages: list[dict] | None = None,
        fill_max_tokens: bool = False,
        arrival_time: float | None = None,
        add_special_tokens: bool | None = None,
    ) -> RequestStream:
        """Queue a request; its stream yields Accepted or Rejected first, then Deltas.
        `add_special_tokens` None: a text prompt gets them (BOS), chat messages do not."""
        stream = self._open(request_id)
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        special = messages is None if add_special_tokens is None else add_special_tokens
        self._tokenizing.submit(
            self._encode, stream, prompt, messages, special, params, fill_max_tokens, arrival
        )
        return stream

    def _encode(
        self,
        stream: RequestStream,
        prompt: str | list[int] | None,
        messages: list[dict] | None,
        add_special_tokens: bool,
        params: SamplingParams,
        fill_max_tokens: bool,
        arrival: float,
    ) -> None:
        """On the tokenizer thread: the prompt's ids go to the engine thread (or a Rejected
        to the client for input the tokenizer or chat template refuses)."""
        try:
            if messages is not None:
                ids = encode_chat(self._tokenizer, messages, True, add_special_tokens)
            else:
                assert prompt is not None
                ids = encode_prompt(self._tokenizer, prompt, add_special_tokens)
        except Exception as exc:
            self._post([(stream, Rejected(str(exc) or type(exc).__name__))])
            return
        if not self.alive:
            self._post([(stream, EngineFailed(ENGINE_STOPPED))])
            return
        self._commands.put(_Add(stream, list(ids), params, fill_max_tokens, arrival))

    def abort(self, stream: RequestStream) -> None:
        """Abort a request (client gone); its KV blocks are freed before the next iteration."""
        if not stream.done:
            self._mark_done(stream)
            self._commands.put(_Abort(stream.request_id))

    def abort_all(self) -> None:
        """Finish every request now (thread-safe): each client gets its final chunk with
        finish reason "abort". Called when a drain's grace period ends."""
        self._commands.put(_AbortAll())

    async def tokenize(self, t: Tokenize) -> list[int]:
        return await self._on_tokenizer(lambda: t.run(self._tokenizer))

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._on_tokenizer(
            lambda: decode_ids(self._tokenizer, self._vocab_size, token_ids)
        )

    async def check_structured_output(self, so: StructuredOutput) -> None:
        await self._on_tokenizer(lambda: self.engine.check_structured_output(so))

    async def _on_tokenizer(self, fn: Callable[[], object]) -> Any:
        """fn() on the tokenizer thread; ValueError for input it refuses."""
        if not self.alive:
            raise RuntimeError(ENGINE_STOPPED)
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._tokenizing, fn)
        except Exception as exc:  # tokenizer, chat template, vocabulary: the client's input
            raise ValueError(str(exc) or type(exc).__name__) from exc

    async def shutdown(self, timeout_s: float = 30.0) -> None:
        """Abort whatever still runs and stop the thread."""
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, timeout_s)
        # Prompts still being tokenized find the engine stopped and say so to their clients.
        self._tokenizing.shutdown(wait=False)

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                self._release_held()
                if self.engine.has_unfinished():
                    self._step()
                self._publish_state()
        except Exception:  # a bug here must not leave clients hanging forever
            logger.exception("engine thread crashed")
            self._fail_all("the engine thread crashed; see the server log")
        finally:
            self._abort_all()
            self._refuse_queued()
            self._publish_state()

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop. While requests are held, an idle
        engine waits for commands only HOLD_POLL_S at a time, to look at them again."""
        pending: list[tuple[RequestStream, StreamItem]] = []
        try:
            cmd = self._commands.get(block=block, timeout=HOLD_POLL_S if self._held else None)
            while True:
                if isinstance(cmd, _Stop):
                    return False
                if isinstance(cmd, _Add):
                    item = self._add(cmd)
                    if item is not None:
                        pending.append((cmd.stream, item))
                elif isinstance(cmd, _AbortAll):
                    for rid in list(self._streams):
                        self._abort(rid, pending)
                else:
                    self._abort(cmd.request_id, pending)
                cmd = self._commands.get_nowait()
        except queue.Empty:
            return True
        finally:
            self._post(pending)

    def _add(self, cmd: _Add) -> StreamItem | None:
        """Queue the request in the engine; None when its client has gone meanwhile or it is
        held (`_slo_refusal`)."""
        if cmd.stream.done:  # aborted while it was being tokenized or held: never queued
            return None
        eng = self.engine
        ids = cmd.prompt_token_ids
        try:
            params = cmd.params
            verdict = self._slo_refusal(cmd, len(ids), known_length=not cmd.fill_max_tokens)
            if isinstance(verdict, Refused):
                return verdict
            if verdict == "held":
                return None
            if cmd.fill_max_tokens:
                params = replace(params, max_tokens=max(1, eng.max_model_len - len(ids)))
            self._check_fits_cache(len(ids))
            eng.add_request(
                ids,
                params,
                request_id=cmd.stream.request_id,
                arrival_time=cmd.arrival_time,
                best_effort=verdict == "best_effort",
            )
        except Exception as exc:  # engine validation: bad input
            return Rejected(str(exc) or type(exc).__name__)
        self._streams[cmd.stream.request_id] = cmd.stream
        return Accepted(list(ids), verdict == "best_effort")

    def _slo_refusal(
        self, cmd: _Add, prompt_tokens: int, known_length: bool
    ) -> Refused | Literal["admit", "held", "best_effort"]:
        """--admission slo: refuse a request when the current load cannot meet its TPOT SLO
        or its first token's objective, or admitting it would break an admitted request's
        (`Admission.judge`; its max_tokens only when the client set it). One refused for its
        TPOT is held instead (appended to `_held`, "held" returned) while its hold lasts
        (`Admission.hold_s`): streams finish every second here, and the first token it can
        still get in time is worth more to its client than a 429 to retry after. One still
        refused when its hold runs out, or refused for its first token (not for its work), is
        served best effort when `Admission.best_effort_refusal` allows ("best_effort"); "admit"
        admits it as asked."""
        if self.admission != "slo":
            return "admit"
        admission, params = self.engine.admission, cmd.params
        waited = max(0.0, time.monotonic() - cmd.arrival_time)
        prefix = self.engine.engine.target_prefix  # (a prompt seen before costs its tail)
        cached = (
            0 if prefix is None else prefix.cached_tokens(cmd.prompt_token_ids, prompt_tokens - 1)
        )
        why = admission.judge(
            params.slo_tpot_ms,
            prompt_tokens,
            params.slo_ttft_ms,
            params.max_tokens if known_length else None,
            waited,
            key=cmd.stream.request_id,
            cached_tokens=cached,
        )
        if why is None:
            return "admit"
        if not why.first_token and waited < admission.hold_s(
            params.slo_tpot_ms, prompt_tokens, params.slo_ttft_ms
        ):
            self._held.append(cmd)
            return "held"
        spare = (
            "the least compute is served first"
            if why.work
            else admission.best_effort_refusal(
                params.slo_tpot_ms, prompt_tokens, params.slo_ttft_ms, waited, cached
            )
        )
        if spare is None:
            logger.info("best effort %s: %s", cmd.stream.request_id, why.message)
            return "best_effort"
        logger.info(
            "refused %s: %s [prediction: %s]%s",
            cmd.stream.request_id,
            why.message,
            ", ".join(f"{k} {v:.4g}" for k, v in admission.last_prediction.items()),
            "" if spare is None else f" [not best effort: {spare}]",
        )
        return Refused(why.message)

    def _release_held(self) -> None:
        """Look at the held requests again, in arrival order: admitted, refused (their hold
        ran out, or their first token can no longer come in time) or held on."""
        if not self._held:
            return
        held, self._held = self._held, []
        pending: list[tuple[RequestStream, StreamItem]] = []
        for cmd in held:
            item = self._add(cmd)
            if item is not None:
                pending.append((cmd.stream, item))
        self._post(pending)

    def _check_fits_cache(self, num_prompt_tokens: int) -> None:
        # A prompt that can never be admitted would wait forever; say so now instead.
        for runner in (self.engine.engine.target, self.engine.engine.draft):
            if runner is None:
                continue
            need = runner.cache.blocks_needed([], num_prompt_tokens + 1)
            if need > runner.cache.num_blocks:
                raise ValueError(
                    f"prompt has {num_prompt_tokens} tokens and needs {need} KV "
                    f"blocks; this server's cache holds {runner.cache.num_blocks}"
                )

    def _abort(self, request_id: str, pending: list[tuple[RequestStream, StreamItem]]) -> None:
        stream = self._streams.pop(request_id, None)
        out = self.engine.abort(request_id)
        if out is not None and stream is not None:
            pending.append((stream, self._delta(out)))

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as exc:
            logger.exception("engine step failed")
            self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
            return
        stats = self.engine.last_stats
        if stats is not None and stats is not self._last_stats:
            self._last_stats = stats
            self.metrics.observe_iteration(stats)
        pending: list[tuple[RequestStream, StreamItem]] = []
        for out in outs:
            stream = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
            if stream is not None:
                pending.append((stream, self._delta(out)))
        self._post(pending)
        if not outs:
            time.sleep(0.001)  # nothing could run this round (e.g. waiting for KV): do not spin

    def _delta(self, out: RequestOutput) -> Delta | EngineFailed:
        """The stream item of an engine output; records the metrics of a finished request."""
        if not out.finished:
            return Delta(
                out.delta_text, list(out.delta_token_ids), None, logprobs=out.delta_logprobs
            )
        summary = self._finished(out, out.outputs[0].finish_reason or "abort")
        if summary.finish_reason == "error":  # this request alone failed inside the engine
            return EngineFailed(
                f"internal error while processing this request: {out.error}; other requests "
                "were not affected, retry it"
            )
        return Delta(
            out.delta_text,
            list(out.delta_token_ids),
            summary.finish_reason,
            out.outputs[0].text,
            tuple(out.outputs[0].token_ids),
            summary,
            out.delta_logprobs,
            tuple(out.outputs[0].logprobs or ()),
        )

    def _finished(self, out: RequestOutput, finish_reason: str) -> FinishedRequest:
        """A finished request's summary, counted in the metrics and the access log."""
        summary = self._summarize(out, finish_reason)
        self.metrics.observe_finished(summary)
        log_finished(out.request_id, summary)
        return summary

    def _summarize(self, out: RequestOutput, finish_reason: str) -> FinishedRequest:
        m = out.metrics
        return FinishedRequest(
            finish_reason=finish_reason,
            slo_tpot_ms=m.slo_tpot_ms,
            slo_class=self.metrics.slo_class(m.slo_tpot_ms),
            slo_attained=m.slo_attained,
            slo_ttft_ms=m.slo_ttft_ms,
            ttft_attained=m.ttft_attained,
            tpot_attained=m.tpot_attained,
            ttft_objective_ms=m.ttft_objective_ms,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=m.num_output_tokens,
            ttft_s=m.ttft_s,
            tpot_ms=m.tpot_ms,
            e2e_s=m.e2e_s,
            spec_tree_tokens=m.num_tree_tokens,
            spec_accepted_tokens=m.num_accepted_tokens,
            queue_s=m.queue_s,
            prefill_s=m.prefill_s,
            decode_s=m.decode_s,
        )

    def _fail_all(self, message: str) -> None:
        """Abort every request (freeing its KV) and tell its client the engine failed."""
        pending: list[tuple[RequestStream, StreamItem]] = []
        for rid, stream in list(self._streams.items()):
            try:
                out = self.engine.abort(rid)
                if out is not None:
                    self._finished(out, "error")
            except Exception:
                logger.exception("abort of %s failed", rid)
            pending.append((stream, EngineFailed(message)))
        self._streams.clear()
        self._post(pending)

    def _abort_all(self) -> None:
        pending: list[tuple[RequestStream, StreamItem]] = []
        for rid in list(self._streams):
            self._abort(rid, pending)
        self._post(pending)

    def _refuse_queued(self) -> None:
        """Answer requests still queued when the loop ends (stop or crash) instead of never."""
        pending: list[tuple[RequestStream, StreamItem]] = []
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                pending.append((cmd.stream, EngineFailed(ENGINE_STOPPED)))
        pending += [(cmd.stream, EngineFailed(ENGINE_STOPPED)) for cmd in self._held]
        self._held.clear()
        self._post(pending)

    def _post(self, items: list[tuple[RequestStream, StreamItem]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for stream, item in items:
            by_loop[stream.loop].append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _publish_state(self) -> None:
        sched = self.engine.scheduler
        alloc = self.engine.engine.target.cache.allocator
        self.metrics.set_engine_state(
            # As vLLM counts them: a prompt being prefilled in chunks is in the batch too.
            len(sched.running) + len(sched.prefilling),
            len(sched.waiting),
            alloc.num_used,
            alloc.num_blocks,
            sched.num_preemptions,
        )
        prefix = self.engine.engine.target_prefix
        if prefix is not None:
            self.metrics.set_prefix_cache(prefix.queried_tokens, prefix.hit_tokens)
        calibration = sched.controller.calibration_summary()
        if calibration is not None:
            self.metrics.set_calibration(*calibration)
        if self.on_state is not None:
            self.on_state()
