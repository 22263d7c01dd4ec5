"""POST /tokenize and POST /detokenize, shaped like vLLM's: count a prompt's tokens the way
generation would before sending it, or read token ids back as text.

The engine thread owns the tokenizer (`AsyncEngine`), so both run there between iterations;
under Ray Serve, on an engine replica.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field

from adaserve.api.async_engine import EngineFront, Tokenize
from adaserve.api.errors import APIError
from adaserve.api.protocol import ChatMessage
from adaserve.api.serving import parse_body


def _strict(default: Any = None, **kw: Any) -> Any:
    return Field(default, strict=True, **kw)


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages (formatted by the chat template as chat requests are)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = _strict()
    prompt: str | None = _strict()
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # As generation requests (and vLLM): by default a prompt gets the tokenizer's special
    # tokens (BOS), chat messages only what the chat template writes.
    add_special_tokens: bool | None = _strict(None)
    add_generation_prompt: bool = _strict(True)

    def check(self) -> None:
        """What field validation cannot say: one input, and options that fit it."""
        if (self.prompt is None) == (self.messages is None):
            raise APIError(
                400, "send exactly one of prompt (a string) or messages (a chat)", param="prompt"
            )

    def to_tokenize(self) -> Tokenize:
        messages = None
        if self.messages is not None:
            messages = [{"role": m.role, "content": m.content} for m in self.messages]
        special = self.add_special_tokens
        if special is None:
            special = messages is None
        return Tokenize(self.prompt, messages, special, self.add_generation_prompt)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = _strict()
    tokens: list[int] = Field(..., strict=True)


class DetokenizeResponse(BaseModel):
    prompt: str


class Tokenization:
    """Handlers of /tokenize and /detokenize over an engine front."""

    def __init__(self, engine: EngineFront, model_name: str, max_model_len: int) -> None:
        self.engine, self.model_name, self.max_model_len = engine, model_name, max_model_len

    async def tokenize(self, request: Request) -> TokenizeResponse:
        body = await parse_body(request, TokenizeRequest, self.model_name)
        body.check()
        param = "prompt" if body.prompt is not None else "messages"
        tokens = await self._answer(self.engine.tokenize(body.to_tokenize()), param)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=self.max_model_len)

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        body = await parse_body(request, DetokenizeRequest, self.model_name)
        text = await self._answer(self.engine.detokenize(body.tokens), "tokens")
        return DetokenizeResponse(prompt=text)

    async def _answer(self, call: Any, param: str) -> Any:
        try:
            return await call
        except ValueError as exc:  # what the tokenizer or the vocabulary refused
            message = str(exc) if str(exc).startswith(param) else f"{param}: {exc}"
            raise APIError(400, message, param=param) from None
        except RuntimeError as exc:
            raise APIError(503, str(exc), code="server_unavailable") from None
