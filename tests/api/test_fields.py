"""Every request field OpenAI's and vLLM's APIs know is either implemented or a 400 naming it;
nothing is silently ignored (issue #34: a client that asks for something gets it or an error)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from adaserve import LLMEngine
from adaserve.api.fields import REFUSED_CHAT, REFUSED_COMPLETION, UNEFFECTFUL
from adaserve.api.protocol import ChatCompletionRequest, CompletionRequest
from adaserve.api.server import build_app
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from tests.e2e.harness import ThreadServer

PROMPT = "t5 t6 t7 t8"
MESSAGES = [{"role": "user", "content": "t5 t6"}]

# A value that asks for something (not the field's no-op) for every field either API knows.
SAMPLE: dict[str, Any] = {
    "max_tokens": 3,
    "max_completion_tokens": 3,
    "temperature": 0.5,
    "top_p": 0.5,
    "top_k": 5,
    "min_p": 0.1,
    "n": 2,
    "best_of": 2,
    "seed": 7,
    "stop": "t9",
    "stop_token_ids": [9],
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
    "min_tokens": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.5,
    "repetition_penalty": 1.2,
    "logit_bias": {"5": 10},
    "logprobs": 2,
    "top_logprobs": 2,
    "echo": True,
    "suffix": "t9",
    "user": "someone",
    "metadata": {"k": "v"},
    "safety_identifier": "x",
    "prompt_cache_key": "x",
    "slo_tpot_ms": 500,
    "slo_ttft_ms": 5000,
    "return_token_ids": True,
    "add_special_tokens": False,
    "use_beam_search": True,
    "length_penalty": 0.5,
    "early_stopping": True,
    "spaces_between_special_tokens": False,
    "truncate_prompt_tokens": 2,
    "prompt_logprobs": 1,
    "allowed_token_ids": [5, 6],
    "bad_words": ["t5"],
    "logits_processors": ["x"],
    "guided_json": {"type": "object"},
    "guided_regex": "(t5)+",
    "guided_choice": ["t5", "t6"],
    "guided_grammar": 'root ::= "t5" "t6"',
    "guided_decoding_backend": "outlines",
    "guided_whitespace_pattern": " ",
    "structured_outputs": {"choice": ["t7", "t8"]},
    "response_format": {"type": "json_object"},
    "priority": 1,
    "request_id": "abc",
    "return_tokens_as_token_ids": True,
    "cache_salt": "salt",
    "kv_transfer_params": {"a": 1},
    "vllm_xargs": {"a": 1},
    "mm_processor_kwargs": {"a": 1},
    "prompt_embeds": "AAAA",
    "reasoning_effort": "low",
    "include_reasoning": True,
    "thinking_token_budget": 10,
    "store": True,
    "service_tier": "flex",
    "prediction": {"type": "content", "content": "t5"},
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
    "tools": [{"type": "function", "function": {"name": "f"}}],
    "tool_choice": "auto",
    "parallel_tool_calls": False,
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"},
    "web_search_options": {},
    "verbosity": "low",
    "documents": [{"text": "t5"}],
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": False,
    "continue_final_message": True,
}
SAMPLE["web_search_options"] = {"search_context_size": "low"}

ROUTES = {
    "completions": (CompletionRequest, REFUSED_COMPLETION, {"prompt": PROMPT}),
    "chat/completions": (ChatCompletionRequest, REFUSED_CHAT, {"messages": MESSAGES}),
}


def known_fields(route: str) -> list[str]:
    model, refused, base = ROUTES[route]
    return sorted((set(model.model_fields) | set(refused) | UNEFFECTFUL) - set(base) - {"model"})


@pytest.fixture(scope="module")
def url(tiny_llama) -> Iterator[str]:
    engine = LLMEngine(
        ModelConfig(model=str(tiny_llama)),
        CacheConfig(num_blocks=64),
        SchedulerConfig(policy="incremental"),
    )
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        yield srv.url


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_every_known_field_has_a_sample_value(route: str) -> None:
    missing = [f for f in known_fields(route) if f not in SAMPLE]
    assert not missing, f"add a non-default value to SAMPLE for {missing}"


@pytest.mark.parametrize("route,field", [(r, f) for r in sorted(ROUTES) for f in known_fields(r)])
def test_each_known_field_is_served_or_refused_by_name(url: str, route: str, field: str) -> None:
    _, refused, base = ROUTES[route]
    body = {"max_tokens": 3, **base, field: SAMPLE[field]}
    r = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
    if field in refused:
        assert r.status_code == 400, f"{field}={SAMPLE[field]!r} was not refused: {r.text}"
        err = r.json()["error"]
        assert err["param"] == field and field in err["message"], err
        assert "not supported" in err["message"], err
    elif r.status_code == 400:  # an implemented field refuses this value: it must say so
        assert r.json()["error"]["param"] == field, r.text
    else:
        assert r.status_code == 200, f"{field}: {r.status_code} {r.text}"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_no_op_values_of_refused_fields_are_accepted(url: str, route: str) -> None:
    _, refused, base = ROUTES[route]
    for field, why in refused.items():
        for value in (None, *why.noop):
            body = {"max_tokens": 2, **base, field: value}
            r = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
            assert r.status_code == 200, f"{field}={value!r} asks for nothing: {r.text}"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_an_unknown_field_is_a_400_with_the_closest_name(url: str, route: str) -> None:
    _, _, base = ROUTES[route]
    r = httpx.post(f"{url}/v1/{route}", json={**base, "max_token": 3}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "max_token" and "'max_tokens'" in err["message"], err


@pytest.mark.parametrize(
    "message,param",
    [
        ({"tool_calls": [{"id": "1", "type": "function"}]}, "messages[0].tool_calls"),
        ({"tool_call_id": "1"}, "messages[0].tool_call_id"),
        ({"colour": "red"}, "messages[0].colour"),
    ],
)
def test_chat_message_fields_are_not_dropped(url: str, message: dict, param: str) -> None:
    body = {"messages": [{"role": "user", "content": "t5", **message}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize(
    "options,param",
    [
        ({"continuous_usage_stats": True}, "stream_options.continuous_usage_stats"),
        ({"include_usages": True}, "stream_options.include_usages"),
    ],
)
def test_stream_options_are_not_dropped(url: str, options: dict, param: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "stream": True, "stream_options": options}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_returned_assistant_message_can_be_sent_back(url: str) -> None:
    """OpenAI's response message carries null tool_calls, refusal, audio: no-ops."""
    turn = {"role": "assistant", "content": "t7", "tool_calls": None, "refusal": None}
    body = {"messages": [*MESSAGES, turn, {"role": "user", "content": "t8"}], "max_tokens": 2}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text


def _text(url: str, route: str, **body: object) -> str:
    base = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    r = httpx.post(f"{url}/v1/{route}", json={**base, **body}, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if route == "completions" else choice["message"]["content"]


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize(
    "field,value",
    [
        ("repetition_penalty", 5.0),
        ("presence_penalty", 2.0),
        ("frequency_penalty", 2.0),
        ("logit_bias", {"9": 100}),
    ],
)
def test_penalties_change_greedy_output(url: str, route: str, field: str, value: object) -> None:
    greedy = dict(max_tokens=24, temperature=0, ignore_eos=True)
    plain = _text(url, route, **greedy)
    assert _text(url, route, **greedy, **{field: value}) != plain, f"{field} changed nothing"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_min_p_one_keeps_only_the_top_token(url: str, route: str) -> None:
    greedy = _text(url, route, max_tokens=12, temperature=0, ignore_eos=True)
    sampled = _text(url, route, max_tokens=12, temperature=1.0, min_p=1.0, ignore_eos=True)
    assert sampled == greedy, "min_p 1 must leave only the most likely token"


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_stop_and_include_stop_str_in_output_on_both_routes(url: str, route: str) -> None:
    words = _text(url, route, max_tokens=8, temperature=0, ignore_eos=True).split()
    stop = words[2]
    at = words.index(stop)  # its first occurrence
    cut = _text(url, route, max_tokens=8, temperature=0, ignore_eos=True, stop=stop)
    kept = _text(
        url,
        route,
        max_tokens=8,
        temperature=0,
        ignore_eos=True,
        stop=[stop],
        include_stop_str_in_output=True,
    )
    assert cut.split() == words[:at] and kept.split() == words[: at + 1], (cut, kept, words)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_min_tokens_outlasts_a_stop_token(url: str, route: str) -> None:
    r = httpx.post(
        f"{url}/v1/{route}",
        json={
            **ROUTES[route][2],
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
        timeout=60,
    )
    first = r.json()["choices"][0]["token_ids"][0]
    body = dict(max_tokens=8, temperature=0, stop_token_ids=[first], return_token_ids=True)
    base = ROUTES[route][2]
    early = httpx.post(f"{url}/v1/{route}", json={**base, **body}, timeout=60).json()
    late = httpx.post(f"{url}/v1/{route}", json={**base, **body, "min_tokens": 5}, timeout=60)
    assert len(early["choices"][0]["token_ids"]) == 1, early
    assert len(late.json()["choices"][0]["token_ids"]) >= 5, late.text


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("bias", [{"96": 1}, {"x": 1}, {"5": 101}])
def test_a_bad_logit_bias_is_a_400_naming_it(url: str, route: str, bias: dict) -> None:
    body = {**ROUTES[route][2], "max_tokens": 2, "logit_bias": bias}
    r = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", r.text


def test_a_strong_logit_bias_forces_its_token(url: str) -> None:
    r = httpx.post(
        f"{url}/v1/completions",
        json={
            "prompt": PROMPT,
            "max_tokens": 4,
            "logit_bias": {"9": 100},
            "return_token_ids": True,
        },
        timeout=60,
    )
    assert r.json()["choices"][0]["token_ids"] == [9] * 4, r.text
