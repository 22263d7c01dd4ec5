"""n > 1 and batched prompts: every choice is its own engine request, numbered as OpenAI does
(prompt i's j-th sample is choice i * n + j), seeded seed + j, usage summed, streamed chunks
tagged with their choice."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from adaserve import LLMEngine
from adaserve.api.server import build_app
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from tests.e2e.harness import ThreadServer

PROMPTS = ["t5 t6 t7", "t9 t8"]


@pytest.fixture(scope="module")
def url(tiny_llama) -> Iterator[str]:
    engine = LLMEngine(
        ModelConfig(model=str(tiny_llama)),
        CacheConfig(num_blocks=128),
        SchedulerConfig(policy="incremental"),
    )
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        yield srv.url


def post(url: str, route: str = "completions", **body: object) -> dict:
    r = httpx.post(f"{url}/v1/{route}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, route: str = "completions", **body: object) -> list[dict]:
    with httpx.stream("POST", f"{url}/v1/{route}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines[-1]
    return [json.loads(ln) for ln in lines[:-1]]


def test_n_choices_are_seed_plus_j_and_usage_is_summed(url: str) -> None:
    body = dict(prompt=PROMPTS[0], max_tokens=6, temperature=1.0, ignore_eos=True, seed=11)
    got = post(url, n=3, **body)
    assert [c["index"] for c in got["choices"]] == [0, 1, 2], got["choices"]
    for j, choice in enumerate(got["choices"]):
        alone = post(url, **{**body, "seed": 11 + j})["choices"][0]["text"]
        assert choice["text"] == alone, f"choice {j} is not the request seeded {11 + j}"
        assert choice["adaserve"]["slo_class"] == "none", "each choice carries its measurements"
    assert len({c["text"] for c in got["choices"]}) > 1, "three samples all equal"
    usage = got["usage"]
    assert usage["prompt_tokens"] == 3 and usage["completion_tokens"] == 18, usage
    assert "adaserve" not in got, "with several choices the measurements are per choice"


def test_a_batch_of_prompts_gets_each_prompts_greedy_output(url: str) -> None:
    body = dict(max_tokens=5, temperature=0, ignore_eos=True, return_token_ids=True)
    got = post(url, prompt=PROMPTS, n=2, **body)
    alone = [post(url, prompt=p, **body)["choices"][0] for p in PROMPTS]
    texts = [c["text"] for c in got["choices"]]
    assert texts == [alone[0]["text"]] * 2 + [alone[1]["text"]] * 2, texts
    assert [c["prompt_token_ids"] for c in got["choices"][::2]] == [[5, 6, 7], [9, 8]]
    assert got["usage"]["prompt_tokens"] == 5 and got["usage"]["completion_tokens"] == 20


def test_streamed_choices_carry_their_index_and_add_up(url: str) -> None:
    body = dict(prompt=PROMPTS, max_tokens=5, temperature=0, ignore_eos=True, n=2)
    whole = post(url, **body)
    chunks = stream(url, stream_options={"include_usage": True}, **body)
    texts = {i: "" for i in range(4)}
    finished = set()
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert finished == {0, 1, 2, 3}, finished
    assert [texts[i] for i in range(4)] == [c["text"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"], chunks[-1]


def test_chat_n_choices(url: str) -> None:
    msgs = [{"role": "user", "content": "t5 t6"}]
    got = post(url, "chat/completions", messages=msgs, n=2, max_tokens=4, seed=3)
    assert [c["index"] for c in got["choices"]] == [0, 1]
    assert all(c["message"]["role"] == "assistant" for c in got["choices"])
    chunks = stream(url, "chat/completions", messages=msgs, n=2, max_tokens=4, seed=3)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert sorted(roles) == [0, 1], "each streamed choice opens with its role"
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c["choices"][0]["index"]] += c["choices"][0]["delta"].get("content") or ""
    assert [texts[0], texts[1]] == [c["message"]["content"] for c in got["choices"]]


@pytest.mark.parametrize("body", [{"n": 0}, {"n": 129}, {"n": 65, "prompt": PROMPTS}])
def test_too_many_choices_is_a_400_naming_n(url: str, body: dict) -> None:
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "t5", **body}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
