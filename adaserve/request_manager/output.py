"""Stop conditions and incremental detokenization of a request's output."""

from __future__ import annotations

from adaserve.request_manager.request import CompletionOutput, Request, RequestOutput


class OutputProcessor:
    """Appends committed tokens to requests, checks stop conditions, builds RequestOutputs."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or ())

    def commit(self, req: Request, tokens: list[int], now: float) -> int:
        """Append tokens one by one until a stop condition; returns how many were taken."""
        p = req.params
        for n, tok in enumerate(tokens, start=1):
            req.append_token(tok, now)
            reason = None
            if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
                reason = "stop"
            elif p.stop and self._hit_stop_string(req):
                reason = "stop"
            elif len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason is not None:
                req.finish(reason, now)
                return n
        return len(tokens)

    def _hit_stop_string(self, req: Request) -> bool:
        text = self._decode(req)
        for s in req.params.stop:
            at = text.find(s)
            if at != -1:
                req.stop_text = text[:at]
                return True
        return False

    def _decode(self, req: Request) -> str:
        return self.tokenizer.decode(req.output_token_ids, skip_special_tokens=True)

    def make_output(self, req: Request) -> RequestOutput:
        """Snapshot with the text/tokens not yet sent in `delta_*` (and marks them sent)."""
        text = req.stop_text if req.stop_text is not None else self._decode(req)
        visible = text
        if not req.finished:
            # Hold back an incomplete UTF-8 character and a possible start of a stop string.
            visible = visible.rstrip("\ufffd")
            for s in req.params.stop:
                for k in range(min(len(s) - 1, len(visible)), 0, -1):
                    if visible.endswith(s[:k]):
                        visible = visible[:-k]
                        break
        delta_text = visible[req.sent_text_len :] if len(visible) > req.sent_text_len else ""
        req.sent_text_len = max(req.sent_text_len, len(visible))
        delta_tokens = req.output_token_ids[req.sent_token_len :]
        req.sent_token_len = len(req.output_token_ids)
        out = CompletionOutput(
            0, text if req.finished else visible, list(req.output_token_ids), req.finish_reason
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
