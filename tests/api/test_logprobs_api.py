"""logprobs through the API: OpenAI's completions and chat shapes, streamed pieces adding up to
the whole, and the engine's own numbers."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import httpx
import pytest

from adaserve import LLMEngine, SamplingParams
from adaserve.api.server import build_app
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from tests.e2e.harness import ThreadServer

PROMPT = "t5 t6 t7"
BODY = dict(prompt=PROMPT, max_tokens=6, temperature=0, ignore_eos=True)


def make_engine(tiny_llama) -> LLMEngine:
    return LLMEngine(
        ModelConfig(model=str(tiny_llama)),
        CacheConfig(num_blocks=64),
        SchedulerConfig(policy="incremental"),
    )


@pytest.fixture(scope="module")
def url(tiny_llama) -> Iterator[str]:
    with ThreadServer(build_app(make_engine(tiny_llama), ServerConfig())) as srv:
        yield srv.url


def post(url: str, route: str, body: dict) -> dict:
    r = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_logprobs_have_openais_shape_and_the_engines_numbers(url, tiny_llama):
    got = post(url, "completions", {**BODY, "logprobs": 2})["choices"][0]["logprobs"]
    engine = make_engine(tiny_llama)
    engine.add_request(
        PROMPT, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    )
    while engine.has_unfinished():
        outs = engine.step()
    ref = outs[0].outputs[0].logprobs
    assert got["tokens"] == [e.token for e in ref], got["tokens"]
    assert all(math.isclose(a, e.logprob, abs_tol=1e-5) for a, e in zip(got["token_logprobs"], ref))
    assert [list(d) for d in got["top_logprobs"]] == [[t[1] for t in e.top] for e in ref]
    offsets = [0]
    for tok in got["tokens"][:-1]:
        offsets.append(offsets[-1] + len(tok))
    assert got["text_offset"] == offsets


def test_streamed_completion_logprobs_add_up_to_the_whole(url) -> None:
    whole = post(url, "completions", {**BODY, "logprobs": 1})["choices"][0]["logprobs"]
    pieces: dict[str, list] = {k: [] for k in whole}
    body = {**BODY, "logprobs": 1, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                lp = json.loads(line[6:])["choices"][0]["logprobs"]
                for k in pieces:
                    pieces[k] += lp[k]
    assert pieces == whole


def test_chat_logprobs_have_openais_shape(url) -> None:
    msgs = [{"role": "user", "content": "t5 t6"}]
    body = dict(messages=msgs, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    content = post(url, "chat/completions", body)["choices"][0]["logprobs"]["content"]
    assert len(content) == 4
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}, entry
        assert entry["bytes"] == list(entry["token"].encode())
        assert len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0
        assert entry["top_logprobs"][0]["token"] == entry["token"], "greedy takes the top token"
    plain = post(url, "chat/completions", {**body, "logprobs": False, "top_logprobs": None})
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize(
    "route,extra,param",
    [
        ("completions", {"logprobs": 21}, "logprobs"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_logprobs_are_400s_naming_the_field(url, route, extra, param) -> None:
    base = (
        {"prompt": PROMPT}
        if route == "completions"
        else {"messages": [{"role": "user", "content": "t5"}]}
    )
    r = httpx.post(f"{url}/v1/{route}", json={**base, **extra}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_official_client_reads_choices_and_logprobs(url) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    models = client.models.list().data[0].id
    got = client.completions.create(
        model=models, prompt=[PROMPT, "t8 t9"], n=2, max_tokens=3, logprobs=2, seed=1
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert all(len(c.logprobs.token_logprobs) == 3 for c in got.choices)
    chat = client.chat.completions.create(
        model=models,
        messages=[{"role": "user", "content": "t5"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"repetition_penalty": 1.3, "min_tokens": 2},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 2
    with pytest.raises(openai.BadRequestError, match="tool calling"):
        client.chat.completions.create(
            model=models,
            messages=[{"role": "user", "content": "t5"}],
            tools=[{"type": "function", "function": {"name": "f"}}],
        )
