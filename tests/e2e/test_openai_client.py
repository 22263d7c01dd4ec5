"""The official `openai` client against `adaserve serve` (default model, default policy adaserve,
the ggml backend when installed): greedy output through HTTP is exactly `LLM.generate`'s; bad
input gets the right 4xx, never a 500.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import httpx
import openai
import pytest

from adaserve import LLM, SamplingParams
from tests.e2e.harness import metric, read_metrics, serve_subprocess, wait_for

pytestmark = pytest.mark.slow

KEY = "sk-adaserve-test"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a primary color."}]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serve_subprocess("--api-key", KEY, "--max-model-len", str(MAX_MODEL_LEN)) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    # No retries: a 429 or 5xx must show up as what it is.
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(max_model_len=MAX_MODEL_LEN)  # in-process, incremental: the target model alone


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)


def test_the_default_server_runs_on_ggml_when_installed(url: str) -> None:
    """`make serve` installs the cpu extra: the default GGUF model then runs on llama.cpp, and
    every test in this module exercises the ggml backend (CI installs it too)."""
    from adaserve.exec.ggml import ggml_available

    want = "ggml" if ggml_available() else "torch"
    assert metric(read_metrics(url), "adaserve_backend_info", backend=want) == 1.0


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    ids = [m.id for m in client.models.list().data]
    assert ids == [MODEL], ids


def test_completion_equals_llm_generate(client: openai.OpenAI, reference: LLM) -> None:
    want = reference.generate(PROMPT, GREEDY)[0]
    got = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == want.outputs[0].token_ids, "token ids differ"
    assert choice.text == want.outputs[0].text
    assert choice.finish_reason == want.outputs[0].finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.outputs[0].token_ids)
    info = got.model_extra["adaserve"]
    assert info["tpot_ms"] > 0 and info["slo_attained"] is None and info["slo_class"] == "none"


def test_streamed_completion_equals_llm_generate(client: openai.OpenAI, reference: LLM) -> None:
    want = reference.generate(PROMPT, GREEDY)[0].outputs[0]
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"slo_tpot_ms": 5000},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].choices[0].finish_reason == want.finish_reason
    info = final[0].model_extra["adaserve"]
    assert info["slo_tpot_ms"] == 5000 and info["tpot_attained"] is True, info
    # Every request has a first-token objective (the default from its prompt length) and
    # attains its SLO only when the first token met it too.
    assert info["ttft_objective_ms"] >= 1000 and info["slo_ttft_ms"] is None, info
    assert info["ttft_attained"] == (info["ttft_ms"] <= info["ttft_objective_ms"]), info
    assert info["slo_attained"] == info["ttft_attained"], info
    assert info["tpot_ms"] <= 5000 and info["slo_class"] == "relaxed", info
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == len(want.token_ids), chunks[-1]


def test_chat_equals_llm_chat(client: openai.OpenAI, reference: LLM) -> None:
    want = reference.chat(CHAT, GREEDY)[0]
    got = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.choices[0].message.role == "assistant"
    assert got.usage.prompt_tokens == len(want.prompt_token_ids), "chat template differs"
    streamed = client.chat.completions.create(
        model=MODEL, messages=CHAT, temperature=0, max_completion_tokens=MAX_TOKENS, stream=True
    )
    chunks = list(streamed)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert "adaserve" in chunks[-1].model_extra, "final chunk lacks the adaserve object"


def test_wrong_key_and_unknown_model_raise_the_clients_errors(url: str) -> None:
    bad = openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        good.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model", info.value.body


TOO_LONG = list(range(100, 100 + MAX_MODEL_LEN + 10))
MSG = [{"role": "user", "content": "hi"}]
# (endpoint, body (None: malformed JSON), status, param the error must name or None)
BAD_INPUT = [
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": {"text": "hi"}}, 400, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": -4}, 400, "max_tokens"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "warm"}, 400, "temperature"),
    ("completions", {"prompt": "hi", "slo_tpot_ms": 0}, 400, "slo_tpot_ms"),
    ("completions", {"prompt": "hi", "slo_tpot_ms": -20}, 400, "slo_tpot_ms"),
    ("completions", {"prompt": "hi", "slo_tpot_ms": "soon"}, 400, "slo_tpot_ms"),
    ("completions", {"prompt": "hi", "seed": "lucky"}, 400, "seed"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("completions", {"prompt": TOO_LONG}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 10**9]}, 400, "prompt"),
    ("completions", None, 400, None),
    ("chat/completions", {"model": MODEL}, 400, "messages"),
    ("chat/completions", {"messages": "hi"}, 400, "messages"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": 5}]},
        400,
        "messages[0].content",
    ),
    (
        "chat/completions",
        {"messages": MSG, "max_completion_tokens": 0},
        400,
        "max_completion_tokens",
    ),
    ("chat/completions", {"messages": MSG, "slo_tpot_ms": "x", "stream": True}, 400, "slo_tpot_ms"),
    (
        "chat/completions",
        {"messages": [{"role": "user", "content": "word " * 600}]},
        400,
        "messages",
    ),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_INPUT)
def test_bad_input_gets_the_right_status_and_names_the_field(
    url, endpoint, body, status, param
) -> None:
    content = b'{"prompt": "hi", "max_tokens": ' if body is None else None
    r = httpx.post(
        f"{url}/v1/{endpoint}",
        json=body,
        content=content,
        timeout=60,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert r.status_code == status, f"{body}: {r.status_code} {r.text}"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["param"] == param, f"{body}: param {error['param']!r}, want {param!r}"
    if param is not None:
        field = re.sub(r"\[\d+\]", "", param).split(".")[-1]  # messages[0].content -> content
        assert field in error["message"], f"message does not name {field}: {error['message']}"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}])
def test_missing_or_wrong_key_is_401(url: str, headers: dict) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    assert httpx.get(f"{url}/health").status_code == 200, "/health must not need the key"


def test_unknown_route_is_404_in_openai_shape(url: str) -> None:
    r = httpx.get(f"{url}/v1/engines", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "message" in r.json()["error"], r.text


def test_after_all_that_the_server_is_idle_and_clean(url: str) -> None:
    wait_for(lambda: metric(read_metrics(url), "adaserve_num_requests_running") == 0, 30, "idle")
    m = read_metrics(url)
    assert metric(m, "adaserve_kv_blocks_used") == 0, "KV blocks held with no request running"
    assert metric(m, "adaserve_kv_blocks_total") > 0
    assert metric(m, "adaserve_requests_total", finish_reason="error") == 0
