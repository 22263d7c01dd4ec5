"""Prompts are tokenized and chat-templated off the engine thread (a long prompt must not stall
the streams in the batch), by a tokenizer copy only the tokenizer thread uses."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import openai
import pytest

from adaserve.api.server import build_app
from adaserve.config import ServerConfig
from tests.api.test_server_tiny import make_engine
from tests.e2e.harness import ThreadServer


@pytest.fixture(scope="module")
def server(tiny_llama) -> Iterator[ThreadServer]:
    cfg = ServerConfig(served_model_name="tiny", admission="queue")
    with ThreadServer(build_app(make_engine(tiny_llama), cfg)) as srv:
        yield srv


def record_threads(tokenizer, calls: list[tuple[str, str]]) -> None:
    """Record (method, thread name) of every encode and chat template call on `tokenizer`."""
    for name in ("encode", "apply_chat_template"):
        real = getattr(tokenizer, name)

        def wrapped(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, threading.current_thread().name))
            return _real(*args, **kwargs)

        setattr(tokenizer, name, wrapped)


def test_prompts_are_tokenized_on_the_tokenizer_thread_never_the_engine_thread(server):
    front = server.app.state.async_engine
    own, engines = [], []
    record_threads(front._tokenizer, own)
    record_threads(front.engine.tokenizer, engines)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    r = client.completions.create(model="tiny", prompt="t5 t6 t7", max_tokens=4, temperature=0)
    assert r.usage.prompt_tokens == 3
    c = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "t5 t6"}], max_tokens=4
    )
    assert c.choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(
        model="tiny", prompt="t9 t10", max_tokens=3, temperature=0, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices)
    assert engines == [], f"the engine's own tokenizer encoded prompts: {engines}"
    assert {m for m, _ in own} == {"encode", "apply_chat_template"}
    threads = {t for _, t in own}
    assert all(t.startswith("adaserve-tokenizer") for t in threads), threads
    assert front._tokenizer is not front.engine.tokenizer


def test_a_prompt_the_chat_template_refuses_is_a_400_and_the_server_keeps_serving(server):
    front = server.app.state.async_engine
    real = front._tokenizer.apply_chat_template

    def refuse(*args, **kwargs):
        raise ValueError("this template takes no such message")

    front._tokenizer.apply_chat_template = refuse
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=60)
    try:
        with pytest.raises(openai.BadRequestError, match="no such message"):
            client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "t5"}], max_tokens=2
            )
    finally:
        front._tokenizer.apply_chat_template = real
    assert front.num_open == 0, "the refused request's stream stayed open"
    r = client.completions.create(model="tiny", prompt="t5 t6", max_tokens=2, temperature=0)
    assert len(r.choices[0].text.split()) == 2
