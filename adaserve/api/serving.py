"""/v1/completions and /v1/chat/completions: parse, admit, submit, then stream or collect.

One code path serves both endpoints; they differ only in how the prompt reaches the engine
(text or token ids vs. chat messages) and in the shape of their response objects.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.background import BackgroundTask

from adaserve.api.async_engine import (
    Accepted,
    Delta,
    EngineFailed,
    EngineFront,
    Refused,
    Rejected,
    RequestStream,
    StreamItem,
)
from adaserve.api.errors import APIError
from adaserve.api.fields import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    FieldError,
    Unsupported,
    check_fields,
)
from adaserve.api.protocol import (
    MAX_CHOICES,
    ChatCompletionRequest,
    CompletionRequest,
    _SamplingRequest,
    describe_validation_error,
)
from adaserve.api.replies import Reply
from adaserve.config import ServerConfig

BodyT = TypeVar("BodyT", bound=BaseModel)

# SLOs given as request headers, for clients and proxies that set headers but do not rewrite
# bodies (a Gateway API HTTPRoute filter, an ingress annotation). The body field wins when a
# request carries both.
SLO_HEADERS = {"x-slo-tpot-ms": "slo_tpot_ms", "x-slo-ttft-ms": "slo_ttft_ms"}


def slo_from_headers(headers: Mapping[str, str]) -> dict[str, float]:
    """{field: value} of the SLO headers present; a value that is not a number > 0 is a 400."""
    found: dict[str, float] = {}
    for header, field in SLO_HEADERS.items():
        raw = headers.get(header)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise APIError(
                400,
                f"header {header} must be a number of milliseconds greater than 0 (like the "
                f"body field {field}), got {raw!r}",
                param=header,
            )
        found[field] = value
    return found


# A client's own request id (X-Request-Id): echoed back, and part of the server's id, so one
# id follows the request through proxies, responses and the server log.
REQUEST_ID_HEADER = "x-request-id"
# Set to "best-effort" on a response whose slo_tpot_ms admission could not promise at the load
# it arrived at and served anyway (`Admission.best_effort`); absent otherwise.
SLO_ADMISSION_HEADER = "X-SLO-Admission"
MAX_REQUEST_ID_LEN = 128


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The X-Request-Id the client sent (None: none); a 400 unless it is 1-128 printable
    characters without spaces (it goes into ids and log lines)."""
    sent = headers.get(REQUEST_ID_HEADER)
    if sent is None:
        return None
    if not (0 < len(sent) <= MAX_REQUEST_ID_LEN and all("!" <= c <= "~" for c in sent)):
        raise APIError(
            400,
            f"header {REQUEST_ID_HEADER} must be 1 to {MAX_REQUEST_ID_LEN} printable ASCII "
            f"characters without spaces, got {sent[:40]!r}",
            param=REQUEST_ID_HEADER,
        )
    return sent


def request_id(kind: str, headers: Mapping[str, str]) -> str:
    """The server's id of a new request: `kind-CLIENTID-suffix` when the client sent an
    X-Request-Id (the suffix keeps two requests reusing one id apart), else `kind-random`."""
    sent = client_request_id(headers)
    if sent is None:
        return f"{kind}-{uuid.uuid4().hex}"
    return f"{kind}-{sent}-{uuid.uuid4().hex[:8]}"


async def parse_body(
    request: Request,
    model: type[BodyT],
    served_name: str,
    refused: Mapping[str, Unsupported] | None = None,
) -> BodyT:
    """The JSON body validated as `model`: a 400 naming the field, or a 404 for another model.
    With `refused` (the route's known fields adaserve does not implement), a field the model
    lacks is a 400 unless it asks for nothing (`fields.check_fields`)."""
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    if refused is not None:
        try:
            check_fields(data, model, refused)
        except FieldError as exc:
            raise APIError(400, str(exc), param=exc.param) from None
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        message, param = describe_validation_error(exc)
        raise APIError(400, message, param=param) from None
    name = getattr(body, "model", None)
    if name is not None and name != served_name:
        raise APIError(
            404,
            f"model {name!r} does not exist; this server serves "
            f"{served_name!r} (see GET /v1/models)",
            param="model",
            code="model_not_found",
        )
    return body


def _reject_constant(name: str) -> Any:
    # Python's json accepts NaN/Infinity; JSON does not, and no field means anything with them.
    raise ValueError(f"{name} is not valid JSON")


def sse(obj: BaseModel | dict) -> str:
    body = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {body}\n\n"


class OpenAIServing:
    """Handlers of the two generation endpoints over one engine front (`EngineFront`)."""

    def __init__(
        self, engine: EngineFront, cfg: ServerConfig, model_name: str, max_waiting: int | None
    ) -> None:
        self.engine, self.cfg, self.model_name = engine, cfg, model_name
        self.max_waiting = max_waiting
        self.draining = False  # set when shutdown starts: new requests get 503

    async def completions(self, request: Request) -> Response:
        body = await self._parse(request, CompletionRequest)
        assert isinstance(body, CompletionRequest)
        special = body.add_special_tokens
        prompts = [{"prompt": p, "add_special_tokens": special} for p in body.prompt_list()]
        return await self._generate(request, body, "cmpl", prompts)

    async def chat(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        assert isinstance(body, ChatCompletionRequest)
        chat = {"messages": body.message_dicts(), "add_special_tokens": body.add_special_tokens}
        return await self._generate(request, body, "chatcmpl", [chat])

    # ------------------------------------------------------------------ admission
    async def _parse(self, request: Request, model: type[_SamplingRequest]) -> _SamplingRequest:
        refused = REFUSED_CHAT if model is ChatCompletionRequest else REFUSED_COMPLETION
        body = await parse_body(request, model, self.model_name, refused)
        from_headers = {
            field: value
            for field, value in slo_from_headers(request.headers).items()
            if getattr(body, field) is None
        }
        return body.model_copy(update=from_headers) if from_headers else body

    def _admit(self) -> None:
        retry = {"Retry-After": str(self.cfg.retry_after_s)}
        if self.draining or not self.engine.alive:
            self.engine.metrics.reject("unavailable")
            raise APIError(
                503,
                "the server is shutting down; retry on another replica or later",
                code="server_unavailable",
                headers=retry,
            )
        if self.max_waiting is not None and self.engine.num_waiting >= self.max_waiting:
            self.engine.metrics.reject("queue_full")
            raise APIError(
                429,
                f"the waiting queue is full ({self.engine.num_waiting} requests "
                f"waiting, --max-waiting {self.max_waiting}); retry after "
                f"{self.cfg.retry_after_s} s",
                code="queue_full",
                headers=retry,
            )

    # ------------------------------------------------------------------ generation
    async def _generate(
        self, request: Request, body: _SamplingRequest, kind: str, prompts: list[dict[str, Any]]
    ) -> Response:
        """Run every choice of every prompt as an engine request of its own, then stream or
        collect them as one response."""
        arrival = time.monotonic()
        rid = request_id(kind, request.headers)
        try:
            params = body.to_sampling_params(self.cfg.default_slo_tpot_ms)
        except ValueError as exc:  # pydantic checked the fields; this is the engine's word
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0].rstrip(":")) from None
        if params.structured_output is not None:
            # Compiled on the tokenizer thread (cached for the engine); a bad schema is a 400.
            _, field = body.constraint()
            try:
                await self.engine.check_structured_output(params.structured_output)
            except ValueError as exc:
                raise APIError(400, f"{field}: {exc}", param=field) from None
        chat, n = kind == "chatcmpl", body.n or 1
        if len(prompts) * n > MAX_CHOICES:
            raise APIError(
                400,
                f"n times the batch's {len(prompts)} prompts is {len(prompts) * n} choices, "
                f"more than {MAX_CHOICES}; send several requests",
                param="n",
            )
        self._admit()
        streams = [
            self.engine.submit(
                rid if len(prompts) * n == 1 else f"{rid}-{i * n + j}",
                params.for_choice(j),
                arrival_time=arrival,
                fill_max_tokens=chat and body.requested_max_tokens() is None,
                **prompt,
            )
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        try:
            accepted = [await self._accepted(s, chat) for s in streams]
        except BaseException:  # refused, or cancelled (client gone): leave none running
            for s in streams:
                self.engine.abort(s)
            raise
        reply = Reply(rid, self.model_name, chat, body, [a.prompt_token_ids for a in accepted], n)
        # The client's own id when it sent one (`echo_request_id` adds it to every response).
        own_id = {} if REQUEST_ID_HEADER in request.headers else {"X-Request-Id": rid}
        if any(a.best_effort for a in accepted):
            # Its slo_tpot_ms could not be promised at this load: served in the time the
            # admitted SLOs leave (Admission.best_effort), and said so before any token.
            own_id[SLO_ADMISSION_HEADER] = "best-effort"
            self.engine.metrics.best_effort(params.slo_tpot_ms)
        if body.stream:
            return StreamingResponse(
                self._sse(streams, reply),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **own_id},
                background=BackgroundTask(self._abort_all, streams),
            )
        return await self._collect(request, streams, reply, own_id)

    async def _accepted(self, stream: RequestStream, chat: bool) -> Accepted:
        """The engine's acceptance of a submitted request (its prompt ids), else its APIError."""
        first = await stream.get()
        if isinstance(first, EngineFailed):  # the engine stopped before it saw the request
            raise APIError(
                503,
                first.message,
                code="server_unavailable",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        if isinstance(first, Refused):
            self.engine.metrics.reject("slo_unattainable")
            raise APIError(
                429,
                first.message,
                code="slo_unattainable",
                headers={"Retry-After": str(self.cfg.retry_after_s)},
            )
        if isinstance(first, Rejected):
            if first.message.startswith("logit_bias"):  # ids outside the vocabulary
                raise APIError(400, first.message, param="logit_bias")
            if chat:  # the engine speaks of "the prompt": the one the chat template made
                raise APIError(
                    400,
                    f"messages (as formatted by the chat template): {first.message}",
                    param="messages",
                )
            raise APIError(400, first.message, param="prompt")
        assert isinstance(first, Accepted)
        return first

    def _abort_all(self, streams: list[RequestStream]) -> None:
        for s in streams:
            self.engine.abort(s)

    async def _sse(self, streams: list[RequestStream], reply: Reply) -> AsyncIterator[str]:
        merged: asyncio.Queue[tuple[int, StreamItem]] = asyncio.Queue()
        pumps = [asyncio.create_task(_pump(i, s, merged)) for i, s in enumerate(streams)]
        finals: dict[int, Delta] = {}
        try:
            if reply.chat:
                for i in range(len(streams)):
                    yield sse(reply.chunk(i, Delta("", [], None), role="assistant"))
            while len(finals) < len(streams):
                i, item = await merged.get()
                if isinstance(item, EngineFailed):
                    yield sse({"error": APIError(500, item.message).info().model_dump()})
                    break
                assert isinstance(item, Delta)
                if item.text or item.token_ids or item.finished:
                    yield sse(reply.chunk(i, item))
                if item.finished:
                    finals[i] = item
            else:
                if reply.body.include_usage:
                    yield sse(reply.usage_chunk([finals[i] for i in range(len(streams))]))
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): free the requests' KV now
            for t in pumps:
                t.cancel()
            self._abort_all(streams)

    async def _collect(
        self,
        request: Request,
        streams: list[RequestStream],
        reply: Reply,
        headers: dict[str, str],
    ) -> Response:
        watcher = asyncio.create_task(self._abort_on_disconnect(request, streams))
        try:
            finals = []
            for stream in streams:  # each stream's queue fills on its own: order is free
                while True:
                    item = await stream.get()
                    if isinstance(item, EngineFailed):
                        raise APIError(500, item.message)
                    assert isinstance(item, Delta)
                    if item.finished:
                        finals.append(item)
                        break
            return JSONResponse(reply.full(finals).model_dump(), headers=headers)
        finally:
            watcher.cancel()
            self._abort_all(streams)

    async def _abort_on_disconnect(self, request: Request, streams: list[RequestStream]) -> None:
        # After the body is read, the next ASGI message is the disconnect (if it comes).
        while (await request.receive())["type"] != "http.disconnect":
            pass
        for stream in streams:
            self.engine.abort(stream)
            stream.queue.put_nowait(Delta("", [], "abort"))


async def _pump(
    index: int, stream: RequestStream, merged: asyncio.Queue[tuple[int, StreamItem]]
) -> None:
    """Forward one choice's stream into the response's merged queue until it ends."""
    while True:
        item = await stream.get()
        merged.put_nowait((index, item))
        if isinstance(item, EngineFailed) or (isinstance(item, Delta) and item.finished):
            return
