"""Stop conditions and incremental detokenization of a request's output.

Text is decoded as tokens arrive, by the tokenizers library's streaming decoder: each new token
costs the same however long the output is (decoding the whole output again after every token
cost O(length) per token, on the engine thread every stream waits for). It yields complete
characters only; a finished request's text is one whole decode, exactly as before.
"""

from __future__ import annotations

import logging

from tokenizers.decoders import DecodeStream

from adaserve.request_manager.request import CompletionOutput, Request, RequestOutput

logger = logging.getLogger(__name__)

# Marks a request whose streaming decoder failed: its text is decoded whole from then on.
_WHOLE = "whole"


class OutputProcessor:
    """Appends committed tokens to requests, checks stop conditions, builds RequestOutputs."""

    def __init__(
        self, tokenizer, max_model_len: int, generation_eos_ids: tuple[int, ...] = ()
    ) -> None:
        """`generation_eos_ids`: the checkpoint's generation_config.json end ids, which stop
        generation besides the tokenizer's eos_token (as in transformers' generate())."""
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or ())
        self.eos_ids.update(generation_eos_ids)
        # The streaming decoder needs the Rust tokenizer, and matches a whole decode only
        # where transformers does not clean up spaces afterwards.
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleanup = getattr(tokenizer, "clean_up_tokenization_spaces", False)
        self.backend = backend if backend is not None and not cleanup else None

    def commit(self, req: Request, tokens: list[int], now: float) -> int:
        """Append tokens one by one until a stop condition; returns how many were taken."""
        p = req.params
        for n, tok in enumerate(tokens, start=1):
            req.append_token(tok, now)
            reason = self._stop_reason(req, tok)
            if reason is None and (
                len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len
            ):
                reason = "length"
            if reason is not None:
                req.finish(reason, now)
                return n
        return len(tokens)

    def token_text(self, token_id: int) -> str:
        """One token decoded alone (the `token` of a logprob entry)."""
        return self.tokenizer.decode([token_id])

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        """ "stop" if `tok`, just appended, ends the request by EOS, a stop id or a stop string.
        Not before min_tokens tokens (as vLLM; the logits held EOS and stop ids back too)."""
        p = req.params
        if len(req.output_token_ids) < p.min_tokens:
            if p.stop:  # a stop string wholly inside the first min_tokens tokens never stops
                req.stop_searched = len(self._text(req))
            return None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "stop"
        if p.stop and self._hit_stop_string(req):
            return "stop"
        return None

    def _hit_stop_string(self, req: Request) -> bool:
        text = self._text(req)
        # Only where a match could end in text new since the last search.
        longest = max(len(s) for s in req.params.stop)
        start = max(0, req.stop_searched - longest + 1)
        req.stop_searched = len(text)
        found = [(at, len(s)) for s in req.params.stop if (at := text.find(s, start)) != -1]
        if found:
            at, length = min(found)
            req.stop_text = text[: at + length if req.params.include_stop_str_in_output else at]
            return True
        return False

    def _decode(self, req: Request) -> str:
        """The whole output decoded at once (trailing U+FFFD for an incomplete character)."""
        return self.tokenizer.decode(
            req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens
        )

    def _text(self, req: Request) -> str:
        """The output's complete characters so far, decoded incrementally."""
        if self.backend is None or req.detok == _WHOLE:
            return self._decode(req).rstrip("\ufffd")
        if req.detok is None:
            req.detok = DecodeStream(skip_special_tokens=req.params.skip_special_tokens)
        ids = req.output_token_ids
        chunks = []
        try:
            for t in ids[req.detok_len :]:
                chunk = req.detok.step(self.backend, t)  # type: ignore[attr-defined]
                if chunk is not None:
                    chunks.append(chunk)
        except Exception:  # an id the tokenizer does not know: decode whole from now on
            logger.warning("streaming detokenization failed for %s", req.request_id)
            req.detok = _WHOLE
            return self._text(req)
        req.detok_len = len(ids)
        if chunks:
            req.text += "".join(chunks)
        return req.text

    def make_output(self, req: Request) -> RequestOutput:
        """Snapshot with the text/tokens not yet sent in `delta_*` (and marks them sent)."""
        if req.stop_text is not None:
            text = req.stop_text
        elif req.finished:
            text = self._decode(req)
        else:
            text = self._text(req)
        visible = text
        if not req.finished:
            # Hold back a possible start of a stop string (an incomplete UTF-8 character
            # is not in the text yet).
            for s in req.params.stop:
                for k in range(min(len(s) - 1, len(visible)), 0, -1):
                    if visible.endswith(s[:k]):
                        visible = visible[:-k]
                        break
        delta_text = visible[req.sent_text_len :] if len(visible) > req.sent_text_len else ""
        req.sent_text_len = max(req.sent_text_len, len(visible))
        delta_tokens = req.output_token_ids[req.sent_token_len :]
        delta_logprobs = req.logprobs[req.sent_token_len :]
        req.sent_token_len = len(req.output_token_ids)
        out = CompletionOutput(
            0,
            text if req.finished else visible,
            list(req.output_token_ids),
            req.finish_reason,
            list(req.logprobs) if req.params.logprobs is not None else None,
        )
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [out],
            req.finished,
            req.metrics,
            delta_text,
            delta_tokens,
            delta_logprobs,
            req.error,
        )

    def error_output(self, req: Request) -> RequestOutput:
        """The output of a request whose own snapshot failed: its tokens, no text."""
        out = CompletionOutput(0, "", list(req.output_token_ids), req.finish_reason)
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [out],
            True,
            req.metrics,
            error=req.error,
        )
