"""Every request field OpenAI's and vLLM's APIs know, and what adaserve does with it.

A field adaserve implements is a field of the request model (`api/protocol.py`). Every other
field OpenAI or vLLM defines is listed here with why adaserve refuses it: it is accepted only at
its no-op value (unset, null, false, empty, or the value listed), and otherwise answered with a
400 naming it, so a client never silently gets something other than it asked for. A field
neither API knows is a 400 too (with the closest known name), as OpenAI answers: a typo such
as `max_token` must not pass unnoticed. `UNEFFECTFUL` fields change nothing about the output
(an end-user id, tags) and are accepted with any value.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

TOOLS = "tool calling is not supported by adaserve"
BEAM = "beam search is not supported by adaserve (sampling and greedy only)"
MULTIMODAL = "adaserve serves text-only models"


@dataclass(frozen=True)
class Unsupported:
    """A known field adaserve does not implement: why, and its no-op values besides the
    always-accepted null/false/empty."""

    why: str
    noop: tuple[Any, ...] = ()


# Fields OpenAI or vLLM define on both routes that adaserve does not implement.
_COMMON: dict[str, Unsupported] = {
    "use_beam_search": Unsupported(BEAM),
    "length_penalty": Unsupported(BEAM, (1, 1.0)),
    "early_stopping": Unsupported(BEAM),
    "best_of": Unsupported("best_of is not supported (use n)", (1,)),
    "spaces_between_special_tokens": Unsupported(
        "special tokens are left out of the text, so there are no spaces between them", (True,)
    ),
    "truncate_prompt_tokens": Unsupported(
        "prompts are never truncated; a prompt over the model's length is a 400"
    ),
    "prompt_logprobs": Unsupported(
        "prompt logprobs are not supported (logprobs of the output are)"
    ),
    "allowed_token_ids": Unsupported("restricting the vocabulary is not supported"),
    "bad_words": Unsupported("bad_words is not supported"),
    "logits_processors": Unsupported("custom logits processors are not supported"),
    "guided_decoding_backend": Unsupported(
        "structured output runs on xgrammar only", ("xgrammar", "auto")
    ),
    "guided_whitespace_pattern": Unsupported(
        "a whitespace pattern is not supported (structured_outputs.disable_any_whitespace is)"
    ),
    "priority": Unsupported("request priorities are not supported (use slo_tpot_ms)", (0,)),
    "request_id": Unsupported("send the id as the X-Request-Id header instead"),
    "return_tokens_as_token_ids": Unsupported("use return_token_ids"),
    "cache_salt": Unsupported("per-request prefix-cache salts are not supported"),
    "kv_transfer_params": Unsupported("disaggregated prefill is not supported"),
    "vllm_xargs": Unsupported("vLLM's extra arguments are not supported"),
    "mm_processor_kwargs": Unsupported(MULTIMODAL),
    "prompt_embeds": Unsupported("prompt embeddings are not supported (send text or token ids)"),
    "reasoning_effort": Unsupported("reasoning controls are not supported"),
    "include_reasoning": Unsupported("reasoning controls are not supported"),
    "thinking_token_budget": Unsupported("reasoning controls are not supported"),
    "store": Unsupported("adaserve stores no completions"),
    "service_tier": Unsupported("service tiers are not supported", ("auto", "default")),
    "prediction": Unsupported("predicted outputs are not supported"),
    "echo": Unsupported("echoing the prompt is not supported"),
}

_COMPLETION_ONLY: dict[str, Unsupported] = {
    "suffix": Unsupported("suffix (fill-in-the-middle) is not supported"),
}

_CHAT_ONLY: dict[str, Unsupported] = {
    "tools": Unsupported(TOOLS),
    "tool_choice": Unsupported(TOOLS, ("none",)),
    "parallel_tool_calls": Unsupported(TOOLS, (True,)),
    "functions": Unsupported(TOOLS),
    "function_call": Unsupported(TOOLS, ("none",)),
    "modalities": Unsupported(MULTIMODAL, (["text"],)),
    "audio": Unsupported(MULTIMODAL),
    "web_search_options": Unsupported("web search is not supported"),
    "verbosity": Unsupported("verbosity is not supported"),
    "documents": Unsupported("documents (RAG chat templates) are not supported"),
    "chat_template": Unsupported(
        "a per-request chat template is not supported (the model's is used)"
    ),
    "chat_template_kwargs": Unsupported("chat template arguments are not supported"),
    "add_generation_prompt": Unsupported(
        "the assistant's turn is always opened (add_generation_prompt true)", (True,)
    ),
    "continue_final_message": Unsupported("continuing the final message is not supported"),
}

# Known fields that do not change what is generated: accepted with any value.
UNEFFECTFUL = frozenset({"user", "metadata", "safety_identifier", "prompt_cache_key"})

REFUSED_COMPLETION = {**_COMMON, **_COMPLETION_ONLY}
REFUSED_CHAT = {**_COMMON, **_CHAT_ONLY}


def _is_noop(value: Any, refused: Unsupported) -> bool:
    if value is False:  # a no-op unless the field is on by default (noop lists True)
        return not any(v is True for v in refused.noop)
    if value is None or value == "" or value == [] or value == {}:
        return True
    # 1 == 1.0 is the same no-op, but True is not the number 1.
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in refused.noop)


def check_fields(data: Any, model: type[BaseModel], refused: Mapping[str, Unsupported]) -> None:
    """A ValueError naming the first field of `data` adaserve would otherwise ignore: a known
    field it does not implement asked for something, or a field nobody defines."""
    if not isinstance(data, dict):
        return  # the model's own validation names the problem
    ours = set(model.model_fields)
    for name, value in data.items():
        if name in ours or name in UNEFFECTFUL:
            continue
        if name in refused:
            if not _is_noop(value, refused[name]):
                raise FieldError(name, f"{name} is not supported by adaserve: {refused[name].why}")
            continue
        known = sorted(ours | set(refused) | UNEFFECTFUL)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else " (see docs/server.md)"
        raise FieldError(name, f"{name} is not a field of this request{hint}")


class FieldError(ValueError):
    """A refused or unknown request field; `param` is its name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
