"""Prompt fidelity as transformers has it: a completion prompt gets the tokenizer's special
tokens (BOS), a chat gets exactly its template, and generation_config.json's end ids stop
generation. Checked against transformers' own tokenization, through the real server and the
official openai client, and offline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from tokenizers import processors
from transformers import AutoTokenizer

from adaserve import LLM, SamplingParams
from adaserve.api.server import build_app
from adaserve.config import ServerConfig
from tests.api.test_server_tiny import make_engine
from tests.conftest import make_tiny_checkpoint, make_tokenizer
from tests.e2e.harness import ThreadServer

BOS = 2  # "t2"
CHAT = "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}"


@pytest.fixture(scope="module")
def bos_model(tmp_path_factory) -> Path:
    """The tiny model with a tokenizer that adds BOS, as Llama's and Mistral's do."""
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("bos_model"), "llama")
    tok = make_tokenizer(96)
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="t2 $A", pair="t2 $A t2 $B", special_tokens=[("t2", BOS)]
    )
    tok.bos_token = "t2"
    tok.chat_template = CHAT
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def hf(bos_model):
    return AutoTokenizer.from_pretrained(bos_model)


@pytest.fixture(scope="module")
def server(bos_model) -> Iterator[ThreadServer]:
    cfg = ServerConfig(served_model_name="bos", admission="queue")
    with ThreadServer(build_app(make_engine(bos_model), cfg)) as srv:
        yield srv


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)


def test_a_completion_prompt_gets_bos_as_transformers_adds_it(server, client, hf):
    prompt = "t5 t6 t7"
    expected = hf(prompt)["input_ids"]
    assert expected[0] == BOS and len(expected) == 4, "the fixture's tokenizer must add BOS"
    r = client.completions.create(model="bos", prompt=prompt, max_tokens=6, temperature=0)
    assert r.usage.prompt_tokens == len(expected)
    # The same greedy continuation as the ids transformers makes, sent as token ids.
    by_ids = client.completions.create(model="bos", prompt=expected, max_tokens=6, temperature=0)
    assert r.choices[0].text == by_ids.choices[0].text
    # Without: as vLLM's add_special_tokens=false.
    bare = client.completions.create(
        model="bos",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        extra_body={"add_special_tokens": False},
    )
    assert bare.usage.prompt_tokens == len(hf(prompt, add_special_tokens=False)["input_ids"]) == 3
    tokenized = httpx.post(f"{server.url}/tokenize", json={"prompt": prompt}, timeout=30).json()
    assert tokenized["tokens"] == expected, "/tokenize disagrees with generation"


def test_a_chat_is_its_template_and_nothing_more(client, hf):
    messages = [{"role": "user", "content": "t5 t6"}]
    expected = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert expected.count(BOS) == 1, "the template writes BOS once"
    r = client.chat.completions.create(model="bos", messages=messages, max_tokens=2)
    assert r.usage.prompt_tokens == len(expected)
    doubled = client.chat.completions.create(
        model="bos", messages=messages, max_tokens=2, extra_body={"add_special_tokens": True}
    )
    assert doubled.usage.prompt_tokens == len(expected) + 1, "vLLM's add_special_tokens=true"


def test_offline_generate_tokenizes_a_text_prompt_as_transformers_does(bos_model, hf):
    llm = LLM(str(bos_model), policy="incremental")
    (out,) = llm.generate(["t5 t6"], SamplingParams(max_tokens=2, temperature=0))
    assert out.prompt_token_ids == hf("t5 t6")["input_ids"]


def test_generation_config_end_ids_stop_generation(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "gen", "llama")
    prompt = [5, 6, 7]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    (ref,) = LLM(str(path), policy="incremental").generate([prompt], greedy)
    tokens = ref.outputs[0].token_ids
    # An end id the tokenizer does not know as eos: the first one the model emits after the
    # first token (not t1, the tokenizer's own eos).
    k = next(i for i, t in enumerate(tokens) if i > 0 and t != 1 and t not in tokens[:i])
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, tokens[k]]}))
    llm = LLM(str(path), policy="incremental")
    (out,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0))
    assert out.outputs[0].token_ids == tokens[: k + 1]
    assert out.outputs[0].finish_reason == "stop"
    (ignored,) = llm.generate([prompt], greedy)
    assert ignored.outputs[0].token_ids == tokens, "ignore_eos must ignore them too"
