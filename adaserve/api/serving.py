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
)
from adaserve.api.errors import APIError
from adaserve.api.fields import (
    REFUSED_CHAT,
    REFUSED_COMPLETION,
    FieldError,
    Unsupported,
    check_fields,
)
from adaserve.api.metrics import FinishedRequest
from adaserve.api.protocol import (
    AdaserveInfo,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    _SamplingRequest,
    describe_validation_error,
)
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


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000.0 * seconds


def adaserve_info(s: FinishedRequest) -> AdaserveInfo:
    return AdaserveInfo(
        tpot_ms=s.tpot_ms,
        ttft_ms=_ms(s.ttft_s),
        e2e_ms=_ms(s.e2e_s),
        slo_tpot_ms=s.slo_tpot_ms,
        slo_class=s.slo_class,
        slo_attained=s.slo_attained,
        slo_ttft_ms=s.slo_ttft_ms,
        ttft_objective_ms=s.ttft_objective_ms,
        ttft_attained=s.ttft_attained,
        tpot_attained=s.tpot_attained,
        spec_tree_tokens=s.spec_tree_tokens,
        spec_accepted_tokens=s.spec_accepted_tokens,
    )


def usage_info(num_prompt_tokens: int, s: FinishedRequest) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=num_prompt_tokens,
        completion_tokens=s.num_output_tokens,
        total_tokens=num_prompt_tokens + s.num_output_tokens,
    )


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
        return await self._generate(
            request, body, "cmpl", prompt=body.prompt, add_special_tokens=body.add_special_tokens
        )

    async def chat(self, request: Request) -> Response:
        body = await self._parse(request, ChatCompletionRequest)
        assert isinstance(body, ChatCompletionRequest)
        return await self._generate(
            request,
            body,
            "chatcmpl",
            messages=body.message_dicts(),
            add_special_tokens=body.add_special_tokens,
        )

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
        self, request: Request, body: _SamplingRequest, kind: str, **prompt: Any
    ) -> Response:
        arrival = time.monotonic()
        rid = request_id(kind, request.headers)
        try:
            params = body.to_sampling_params(self.cfg.default_slo_tpot_ms)
        except ValueError as exc:  # pydantic checked the fields; this is the engine's word
            raise APIError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
        self._admit()
        chat = kind == "chatcmpl"
        stream = self.engine.submit(
            rid,
            params,
            arrival_time=arrival,
            fill_max_tokens=chat and body.requested_max_tokens() is None,
            **prompt,
        )
        try:
            first = await stream.get()
        except BaseException:  # cancelled (client gone, shutdown): do not leave it running
            self.engine.abort(stream)
            raise
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
            if chat:  # the engine speaks of "the prompt": the one the chat template made
                raise APIError(
                    400,
                    f"messages (as formatted by the chat template): {first.message}",
                    param="messages",
                )
            raise APIError(400, first.message, param="prompt")
        assert isinstance(first, Accepted)
        reply = _Reply(stream.request_id, self.model_name, chat, body, first.prompt_token_ids)
        # The client's own id when it sent one (`echo_request_id` adds it to every response).
        own_id = {} if REQUEST_ID_HEADER in request.headers else {"X-Request-Id": rid}
        if body.stream:
            return StreamingResponse(
                self._sse(stream, reply),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **own_id},
                background=BackgroundTask(self.engine.abort, stream),
            )
        return await self._collect(request, stream, reply, own_id)

    async def _sse(self, stream: RequestStream, reply: _Reply) -> AsyncIterator[str]:
        try:
            if reply.chat:
                yield sse(reply.chunk(Delta("", [], None), role="assistant"))
            while True:
                item = await stream.get()
                if isinstance(item, EngineFailed):
                    yield sse({"error": APIError(500, item.message).info().model_dump()})
                    break
                assert isinstance(item, Delta)
                if item.text or item.token_ids or item.finished:
                    yield sse(reply.chunk(item))
                if item.finished:
                    if reply.body.include_usage:
                        yield sse(reply.usage_chunk(item))
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (or we are done): free the request's KV now
            self.engine.abort(stream)

    async def _collect(
        self, request: Request, stream: RequestStream, reply: _Reply, headers: dict[str, str]
    ) -> Response:
        watcher = asyncio.create_task(self._abort_on_disconnect(request, stream))
        try:
            while True:
                item = await stream.get()
                if isinstance(item, EngineFailed):
                    raise APIError(500, item.message)
                assert isinstance(item, Delta)
                if item.finished:
                    return JSONResponse(reply.full(item).model_dump(), headers=headers)
        finally:
            watcher.cancel()
            self.engine.abort(stream)

    async def _abort_on_disconnect(self, request: Request, stream: RequestStream) -> None:
        # After the body is read, the next ASGI message is the disconnect (if it comes).
        while (await request.receive())["type"] != "http.disconnect":
            pass
        self.engine.abort(stream)
        stream.queue.put_nowait(Delta("", [], "abort"))


class _Reply:
    """Builds the response objects of one request (completion or chat)."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        body: _SamplingRequest,
        prompt_token_ids: list[int],
    ) -> None:
        self.id, self.model, self.chat, self.body = request_id, model, chat, body
        self.prompt_token_ids = prompt_token_ids
        self.created = int(time.time())
        self.want_ids = bool(body.return_token_ids)

    def chunk(self, d: Delta, role: str | None = None) -> BaseModel:
        ids = list(d.token_ids) if self.want_ids else None
        info = adaserve_info(d.summary) if d.summary is not None else None
        if self.chat:
            # The final chunk's delta is {} when it brings no text, as in OpenAI's stream.
            content = None if d.finished and not d.text else d.text
            choice = ChatChunkChoice(
                delta=ChatMessageOut(role=role, content=content),
                finish_reason=d.finish_reason,
                token_ids=ids,
            )
            return ChatCompletionChunk(
                id=self.id, created=self.created, model=self.model, choices=[choice], adaserve=info
            )
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[CompletionChoice(text=d.text, token_ids=ids, finish_reason=d.finish_reason)],
            adaserve=info,
        )

    def usage_chunk(self, d: Delta) -> BaseModel:
        assert d.summary is not None
        kw: dict[str, Any] = dict(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[],
            usage=usage_info(len(self.prompt_token_ids), d.summary),
            adaserve=adaserve_info(d.summary),
        )
        return ChatCompletionChunk(**kw) if self.chat else CompletionResponse(**kw)

    def full(self, d: Delta) -> BaseModel:
        """The non-streaming response of a finished request."""
        if d.summary is None:  # aborted by a disconnect: nobody will read it
            return CompletionResponse(
                id=self.id, created=self.created, model=self.model, choices=[]
            )
        ids = list(d.full_token_ids) if self.want_ids else None
        prompt_ids = self.prompt_token_ids if self.want_ids else None
        kw: dict[str, Any] = dict(
            id=self.id,
            created=self.created,
            model=self.model,
            usage=usage_info(len(self.prompt_token_ids), d.summary),
            adaserve=adaserve_info(d.summary),
            prompt_token_ids=prompt_ids,
        )
        if self.chat:
            msg = ChatMessageOut(role="assistant", content=d.full_text)
            return ChatCompletionResponse(
                choices=[ChatChoice(message=msg, finish_reason=d.finish_reason, token_ids=ids)],
                **kw,
            )
        return CompletionResponse(
            choices=[
                CompletionChoice(text=d.full_text, finish_reason=d.finish_reason, token_ids=ids)
            ],
            **kw,
        )
