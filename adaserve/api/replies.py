"""The response objects of one API request, whose choices are engine requests of their own.

A completion with a batch of P prompts and `n` choices each runs P * n engine requests; choice
`i * n + j` is prompt i's j-th sample, as OpenAI numbers them. Usage counts each prompt once
and every choice's output. With one choice the request's `adaserve` measurements sit beside
`usage`, as always; with several each choice carries its own.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from adaserve.api.async_engine import Delta
from adaserve.api.metrics import FinishedRequest
from adaserve.api.protocol import (
    AdaserveInfo,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
    _SamplingRequest,
)
from adaserve.request_manager.logprobs import TokenLogprob

# JSON has no -inf; vLLM reports a token the model rules out at this floor too.
LOGPROB_FLOOR = -9999.0


def _lp(value: float) -> float:
    return max(value, LOGPROB_FLOOR)


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> CompletionLogprobs:
    """OpenAI's completions shape; `offset`: the text's length before the first entry."""
    offsets = []
    for e in entries:
        offsets.append(offset)
        offset += len(e.token)
    return CompletionLogprobs(
        tokens=[e.token for e in entries],
        token_logprobs=[_lp(e.logprob) for e in entries],
        top_logprobs=[{tok: _lp(v) for _, tok, v in e.top} for e in entries],
        text_offset=offsets,
    )


def chat_logprobs(entries: Sequence[TokenLogprob]) -> ChatLogprobs:
    """OpenAI's chat shape: one object per token with its bytes and alternatives."""
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=e.token,
                logprob=_lp(e.logprob),
                bytes=list(e.token.encode()),
                top_logprobs=[
                    ChatTopLogprob(token=tok, logprob=_lp(v), bytes=list(tok.encode()))
                    for _, tok, v in e.top
                ],
            )
            for e in entries
        ]
    )


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


class Reply:
    """Builds the response objects of one request (completion or chat) and its choices."""

    def __init__(
        self,
        request_id: str,
        model: str,
        chat: bool,
        body: _SamplingRequest,
        prompt_token_ids: list[list[int]],
        n: int,
    ) -> None:
        """`prompt_token_ids`: per choice, the ids of its prompt."""
        self.id, self.model, self.chat, self.body = request_id, model, chat, body
        self.prompt_token_ids, self.n = prompt_token_ids, n
        self.created = int(time.time())
        self.want_ids = bool(body.return_token_ids)
        self.single = len(prompt_token_ids) == 1
        self.want_logprobs = body.requested_logprobs() is not None
        self.text_offsets = [0] * len(prompt_token_ids)  # streamed: per choice, text so far

    def _head(self) -> dict[str, Any]:
        return dict(id=self.id, created=self.created, model=self.model)

    def _info(self, d: Delta) -> AdaserveInfo | None:
        return adaserve_info(d.summary) if d.summary is not None else None

    def chunk(self, index: int, d: Delta, role: str | None = None) -> BaseModel:
        """A streamed chunk of choice `index`; its last one carries its measurements."""
        ids = list(d.token_ids) if self.want_ids else None
        if self.chat:
            # The final chunk's delta is {} when it brings no text, as in OpenAI's stream.
            content = None if d.finished and not d.text else d.text
            choice = ChatChunkChoice(
                index=index,
                delta=ChatMessageOut(role=role, content=content),
                logprobs=chat_logprobs(d.logprobs) if self.want_logprobs and d.logprobs else None,
                finish_reason=d.finish_reason,
                token_ids=ids,
            )
            return ChatCompletionChunk(**self._head(), choices=[choice], adaserve=self._info(d))
        lps = None
        if self.want_logprobs:
            lps = completion_logprobs(d.logprobs, self.text_offsets[index])
            self.text_offsets[index] += sum(len(e.token) for e in d.logprobs)
        text = CompletionChoice(
            index=index, text=d.text, logprobs=lps, token_ids=ids, finish_reason=d.finish_reason
        )
        return CompletionResponse(**self._head(), choices=[text], adaserve=self._info(d))

    def usage(self, finals: list[Delta]) -> UsageInfo:
        prompt = sum(len(ids) for ids in self.prompt_token_ids[:: self.n])  # each prompt once
        output = sum(d.summary.num_output_tokens for d in finals if d.summary is not None)
        return UsageInfo(
            prompt_tokens=prompt, completion_tokens=output, total_tokens=prompt + output
        )

    def usage_chunk(self, finals: list[Delta]) -> BaseModel:
        info = self._info(finals[0]) if self.single else None
        kw: dict[str, Any] = dict(choices=[], usage=self.usage(finals), adaserve=info)
        return (
            ChatCompletionChunk(**self._head(), **kw)
            if self.chat
            else CompletionResponse(**self._head(), **kw)
        )

    def full(self, finals: list[Delta]) -> BaseModel:
        """The non-streamed response once every choice finished (`finals` in choice order)."""
        if any(d.summary is None for d in finals):  # aborted by a disconnect: nobody reads it
            return CompletionResponse(**self._head(), choices=[])
        batch = len(self.prompt_token_ids) > self.n  # several prompts
        kw: dict[str, Any] = dict(
            usage=self.usage(finals),
            adaserve=self._info(finals[0]) if self.single else None,
            prompt_token_ids=self.prompt_token_ids[0] if self.want_ids and not batch else None,
        )
        if self.chat:
            chats = [self._chat_choice(i, d) for i, d in enumerate(finals)]
            return ChatCompletionResponse(**self._head(), choices=chats, **kw)
        texts = [self._text_choice(i, d, batch) for i, d in enumerate(finals)]
        return CompletionResponse(**self._head(), choices=texts, **kw)

    def _chat_choice(self, index: int, d: Delta) -> ChatChoice:
        return ChatChoice(
            index=index,
            message=ChatMessageOut(role="assistant", content=d.full_text),
            logprobs=chat_logprobs(d.full_logprobs) if self.want_logprobs else None,
            finish_reason=d.finish_reason,
            token_ids=list(d.full_token_ids) if self.want_ids else None,
            adaserve=None if self.single else self._info(d),
        )

    def _text_choice(self, index: int, d: Delta, batch: bool) -> CompletionChoice:
        return CompletionChoice(
            index=index,
            text=d.full_text,
            logprobs=completion_logprobs(d.full_logprobs, 0) if self.want_logprobs else None,
            finish_reason=d.finish_reason,
            token_ids=list(d.full_token_ids) if self.want_ids else None,
            prompt_token_ids=self.prompt_token_ids[index] if self.want_ids and batch else None,
            adaserve=None if self.single else self._info(d),
        )
