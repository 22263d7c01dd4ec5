"""Pydantic models of the OpenAI API subset adaserve serves, plus its extensions.

Requests: the OpenAI and vLLM fields adaserve implements, validated strictly (a string where a
number belongs is a 400, not a silent coercion), plus `slo_tpot_ms` and `slo_ttft_ms`. Every
other field is checked by `api/fields.py` before these models see the body: accepted only at
its no-op value, so a client never silently gets something other than it asked for.
Responses: OpenAI's objects plus an `adaserve` object beside `usage`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
)

from adaserve.api.structured import ResponseFormat, StructuredOutputsParams, pick_constraint
from adaserve.request_manager.logprobs import MAX_TOP_LOGPROBS
from adaserve.request_manager.request import SamplingParams
from adaserve.request_manager.structured import StructuredOutput

SAMPLING_EPS = 1e-5
# Most choices one request may ask for (n times the prompts of a batch): each is an engine
# request of its own.
MAX_CHOICES = 128
MIN_TOP_P = 1e-9


def _strict(default: Any = None, **kw: Any) -> Any:
    return Field(default, strict=True, **kw)


# Fields passed to SamplingParams under the same name when given.
_PROCESSING = (
    "min_tokens",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "include_stop_str_in_output",
    "skip_special_tokens",
)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown option is a 400, not dropped

    include_usage: bool = _strict(False)
    # OpenAI's padding of streamed chunks against side channels: adaserve sends none.
    include_obfuscation: bool | None = _strict(None)
    continuous_usage_stats: bool | None = _strict(None)  # vLLM's: usage in every chunk

    @field_validator("continuous_usage_stats")
    @classmethod
    def _no_continuous_usage(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError(
                "continuous_usage_stats is not supported by adaserve: usage comes in the last "
                "chunk (include_usage)"
            )
        return v


class _SamplingRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    # Fields not declared here never reach the model: `fields.check_fields` refuses them first.
    model_config = ConfigDict(extra="ignore")

    model: str | None = _strict()
    max_tokens: int | None = _strict(ge=1)
    temperature: float | None = _strict(ge=0, allow_inf_nan=False)
    top_p: float | None = _strict(gt=0, le=1, allow_inf_nan=False)
    n: int | None = _strict()
    # torch generators take seeds in [-2**63, 2**64).
    seed: int | None = _strict(ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    stream: bool | None = _strict(False)
    stream_options: StreamOptions | None = None
    # Extensions.
    slo_tpot_ms: float | None = _strict(
        gt=0,
        allow_inf_nan=False,
        description="adaserve: this request's time-per-output-token SLO in milliseconds; the "
        "scheduler speculates and orders work so it is met (default: the server's "
        "--default-slo-tpot-ms, else best effort)",
    )
    slo_ttft_ms: float | None = _strict(
        gt=0,
        allow_inf_nan=False,
        description="adaserve: time-to-first-token SLO in milliseconds; prefill of this prompt "
        "is sized to meet it",
    )
    top_k: int | None = _strict(
        ge=-1, description="adaserve: sample from the k most likely tokens (0 or -1: off)"
    )
    ignore_eos: bool | None = _strict(
        False, description="adaserve: keep generating past end-of-sequence up to max_tokens"
    )
    stop_token_ids: list[int] | None = _strict(
        description="adaserve: token ids that end generation (besides stop strings)"
    )
    return_token_ids: bool | None = _strict(
        False, description="adaserve: also return prompt and output token ids"
    )
    # vLLM's sampling extensions (`request_manager/logits_process.py`).
    min_tokens: int | None = _strict(
        ge=0, description="vLLM: EOS, stop_token_ids and stop strings wait for this many tokens"
    )
    repetition_penalty: float | None = _strict(
        gt=0,
        allow_inf_nan=False,
        description="vLLM: > 1 discourages tokens of the prompt and output so far (1: off)",
    )
    presence_penalty: float | None = _strict(ge=-2, le=2, allow_inf_nan=False)
    frequency_penalty: float | None = _strict(ge=-2, le=2, allow_inf_nan=False)
    min_p: float | None = _strict(
        ge=0,
        le=1,
        allow_inf_nan=False,
        description="vLLM: drop tokens below min_p times the most likely token's probability",
    )
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (a string) -> bias in [-100, 100] added to its logit"
    )
    include_stop_str_in_output: bool | None = _strict(
        False, description="vLLM: keep the matched stop string in the text"
    )
    skip_special_tokens: bool | None = _strict(
        True, description="vLLM: leave special tokens out of the text"
    )
    # Structured output (`api/structured.py`): one constraint per request.
    response_format: ResponseFormat | None = Field(
        None, description="OpenAI's: text, json_object or json_schema"
    )
    structured_outputs: StructuredOutputsParams | None = Field(
        None, description="vLLM's: one of json, regex, choice, grammar, json_object"
    )
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older spelling")
    guided_regex: str | None = _strict(description="vLLM's older spelling")
    guided_choice: list[str] | None = _strict(description="vLLM's older spelling")
    guided_grammar: str | None = _strict(description="vLLM's older spelling")

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_CHOICES:
            raise ValueError(f"n must be an integer in [1, {MAX_CHOICES}], got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit() or not -100 <= bias <= 100:
                raise ValueError(
                    "logit_bias maps token ids (strings of digits) to biases in [-100, 100], "
                    f"got {key!r}: {bias}"
                )
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_strings(cls, v: Any) -> Any:
        items = [v] if isinstance(v, str) else v
        if v is not None and (
            not isinstance(items, list) or not all(isinstance(s, str) and s for s in items)
        ):
            raise ValueError(
                f"stop must be a non-empty string or a list of non-empty strings, got {_short(v)}"
            )
        return v

    # Chat without max_tokens generates up to the model's length (as OpenAI and vLLM).
    fills_max_tokens: ClassVar[bool] = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """Alternatives per token to return with logprobs (None: no logprobs)."""
        return None

    def constraint(self) -> tuple[StructuredOutput | None, str | None]:
        """The structured output asked for and the field that asked; ValueError naming the
        field for two constraints or a malformed one."""
        guided = {
            name: getattr(self, name)
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        }
        return pick_constraint(self.response_format, self.structured_outputs, guided)

    def to_sampling_params(self, default_slo_tpot_ms: float | None) -> SamplingParams:
        """Engine parameters; fields the client left out keep SamplingParams' defaults."""
        kw: dict[str, Any] = {}
        if (max_tokens := self.requested_max_tokens()) is not None:
            kw["max_tokens"] = max_tokens
        elif self.fills_max_tokens and self.min_tokens:
            # The server fills max_tokens up to the model's length later; until then it must
            # not be below min_tokens.
            kw["max_tokens"] = max(SamplingParams.max_tokens, self.min_tokens)
        if self.temperature is not None:
            # As in vLLM: below SAMPLING_EPS sampling is greedy in all but name, and dividing
            # logits by such a temperature overflows to inf (NaN probabilities).
            kw["temperature"] = 0.0 if self.temperature < SAMPLING_EPS else self.temperature
        if self.top_p is not None:
            # Any top_p <= 1/V keeps just the top token; a floor changes nothing but keeps the
            # engine's float32 comparison from seeing 0.
            kw["top_p"] = max(self.top_p, MIN_TOP_P)
        if self.seed is not None:
            kw["seed"] = self.seed
        if self.top_k is not None:
            kw["top_k"] = -1 if self.top_k == 0 else self.top_k  # 0 means off, as in vLLM
        if self.stop is not None:
            kw["stop"] = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        kw["stop_token_ids"] = tuple(self.stop_token_ids or ())
        kw["ignore_eos"] = bool(self.ignore_eos)
        kw["logprobs"] = self.requested_logprobs()
        if self.logit_bias:
            kw["logit_bias"] = {int(t): float(b) for t, b in self.logit_bias.items()}
        kw["n"] = self.n or 1
        for name in _PROCESSING:
            if (value := getattr(self, name)) is not None:
                kw[name] = value
        kw["structured_output"], _ = self.constraint()
        slo = self.slo_tpot_ms if self.slo_tpot_ms is not None else default_slo_tpot_ms
        return SamplingParams(slo_tpot_ms=slo, slo_ttft_ms=self.slo_ttft_ms, **kw)


def _one_prompt(v: Any) -> bool:
    """A non-empty string or a non-empty list of token ids."""
    if isinstance(v, str):
        return bool(v)
    return (
        isinstance(v, list)
        and bool(v)
        and all(isinstance(t, int) and not isinstance(t, bool) for t in v)
    )


class CompletionRequest(_SamplingRequest):
    # str | list[int], also a batch of one ([str] or [[int]]); checked by `_one_prompt`.
    prompt: Any = Field(
        ...,
        description="the prompt: a string or a list of token ids, or a batch (list) of them; "
        "choice i * n + j is prompt i's j-th sample",
        json_schema_extra={
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "integer"}},
                {
                    "type": "array",
                    "items": {"type": "string"},
                    "minItems": 1,
                    "maxItems": MAX_CHOICES,
                },
                {
                    "type": "array",
                    "items": {"type": "array", "items": {"type": "integer"}},
                    "minItems": 1,
                    "maxItems": MAX_CHOICES,
                },
            ]
        },
    )
    logprobs: int | None = _strict(
        ge=0,
        le=MAX_TOP_LOGPROBS,
        description="return each token's logprob and this many most likely alternatives",
    )
    add_special_tokens: bool = _strict(
        True,
        description="add the tokenizer's special tokens (BOS) to a text prompt, as "
        "transformers, vLLM and llama.cpp do",
    )

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompts(cls, v: Any) -> str | list[int] | list[str | list[int]]:
        if _one_prompt(v):
            return v
        if isinstance(v, list) and v and all(_one_prompt(p) for p in v):
            if len(v) > MAX_CHOICES:
                raise ValueError(f"prompt: a batch holds at most {MAX_CHOICES}, got {len(v)}")
            return v[0] if len(v) == 1 else v  # a batch of one is that prompt
        raise ValueError(
            "prompt must be a non-empty string, a non-empty list of token ids, or a batch "
            f"(list) of them, got {_short(v)}"
        )

    def prompt_list(self) -> list[str | list[int]]:
        """The batch's prompts (one for a single prompt)."""
        p = self.prompt
        return [p] if isinstance(p, str) or all(isinstance(t, int) for t in p) else list(p)

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class ChatMessage(BaseModel):
    # A field no message has is a 400 (`describe_validation_error`), not silently dropped.
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Any = None  # str or a list of text parts; normalised to str by `_text`
    name: str | None = _strict(description="the participant's name, passed to the chat template")
    # What a previous assistant turn of OpenAI's response carries back (null when unused):
    # accepted only empty, since adaserve has no tool calling or audio.
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None
    function_call: Any = None
    audio: Any = None
    refusal: str | None = None
    annotations: list[Any] | None = None

    @field_validator("tool_calls", "tool_call_id", "function_call", "audio")
    @classmethod
    def _no_tools(cls, v: Any, info: ValidationInfo) -> Any:
        if v:
            raise ValueError(
                f"{info.field_name} is not supported by adaserve: it has no tool calling or audio"
            )
        return v

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v: Any) -> str:
        if v is None or isinstance(v, str):
            return v or ""
        if isinstance(v, list) and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in v
        ):
            return "".join(p["text"] for p in v)
        raise ValueError(
            'content must be a string or a list of {"type": "text", "text": '
            "...} parts (adaserve serves text-only models)"
        )


class ChatCompletionRequest(_SamplingRequest):
    fills_max_tokens: ClassVar[bool] = True
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = _strict(ge=1)
    logprobs: bool | None = _strict(False, description="return each token's logprob")
    top_logprobs: int | None = _strict(
        ge=0, le=MAX_TOP_LOGPROBS, description="with logprobs: this many alternatives per token"
    )
    add_special_tokens: bool = _strict(
        False,
        description="also add the tokenizer's special tokens to the templated chat (the chat "
        "template already writes its own, BOS included: true usually doubles it)",
    )

    def requested_logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> int | None:
        # max_completion_tokens replaces the deprecated max_tokens in OpenAI's chat API.
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def message_dicts(self) -> list[dict[str, str]]:
        return [
            {"role": m.role, "content": m.content, **({"name": m.name} if m.name else {})}
            for m in self.messages
        ]


def describe_validation_error(exc: ValidationError) -> tuple[str, str | None]:
    """(message, param) of the first error, e.g. ("max_tokens: ... got 0", "max_tokens")."""
    err = exc.errors(include_url=False)[0]
    loc = err.get("loc", ())
    param = None
    if loc:
        param = str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[1:])
    msg = str(err.get("msg", "invalid value"))
    if param is None:
        return f"request body must be a JSON object, got {_short(err.get('input'))}", None
    if err.get("type") == "missing":
        return f"{param} is required", param
    if err.get("type") == "extra_forbidden":
        return f"{param} is not a field adaserve or OpenAI knows there", param
    if err.get("type") == "value_error":  # our validators: a whole sentence naming the field
        return msg.removeprefix("Value error, "), param
    msg = msg.replace("Input should be", "must be").replace("List should", "must")
    return f"{param} {msg}, got {_short(err.get('input'))}", param


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


# ---------------------------------------------------------------------------- responses
class _Response(BaseModel):
    """Response objects; fields named in `_omit_if_none` are left out rather than null."""

    _omit_if_none: ClassVar[frozenset[str]] = frozenset(
        {"usage", "adaserve", "token_ids", "prompt_token_ids", "role", "content"}
    )

    @model_serializer(mode="wrap")
    def _omit_nones(self, handler: Any) -> dict[str, Any]:
        data = handler(self)
        return {k: v for k, v in data.items() if v is not None or k not in self._omit_if_none}


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class AdaserveInfo(_Response):
    """What adaserve measured for one request (beside `usage`)."""

    tpot_ms: float | None  # mean time per output token after the first; None for 1 token
    ttft_ms: float | None
    e2e_ms: float | None
    slo_tpot_ms: float | None
    slo_class: str
    # TPOT within slo_tpot_ms and the first token within its objective; None: no SLO.
    slo_attained: bool | None
    slo_ttft_ms: float | None = None
    # The first token's objective: slo_ttft_ms, else the default from the prompt length.
    ttft_objective_ms: float | None = None
    ttft_attained: bool | None = None  # None: no objective
    tpot_attained: bool | None = None  # TPOT alone (the paper's attainment); None: no SLO
    spec_tree_tokens: int  # speculated tokens the target verified for this request
    spec_accepted_tokens: int  # of which accepted


class CompletionLogprobs(_Response):
    """OpenAI's legacy shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob]
    refusal: None = None


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None  # a batch's: each choice its own prompt's
    adaserve: AdaserveInfo | None = None  # with several choices: each its own


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    adaserve: AdaserveInfo | None = None
    prompt_token_ids: list[int] | None = None


class ChatMessageOut(_Response):
    role: str | None = None
    content: str | None = None


class ChatChoice(_Response):
    index: int = 0
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None
    adaserve: AdaserveInfo | None = None  # with several choices: each its own


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    adaserve: AdaserveInfo | None = None
    prompt_token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    adaserve: AdaserveInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "adaserve"
    root: str | None = None
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
