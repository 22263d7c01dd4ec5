"""Structured output through the HTTP server and the official `openai` client: OpenAI's
response_format (json_object, json_schema, and the client's own `parse` with a pydantic
model), vLLM's structured_outputs and guided_* fields, on the default model with speculation
on; bad constraints are a 400 naming the field."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import jsonschema
import openai
import pytest
from pydantic import BaseModel

from adaserve import LLMEngine
from adaserve.api.server import build_app
from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from tests.e2e.harness import ThreadServer

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer"},
        "languages": {
            "type": "array",
            "items": {"type": "string", "maxLength": 12},
            "maxItems": 3,
        },
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


class City(BaseModel):
    name: str
    country: str
    population: int


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    # The default server's policy and drafter: drafts are cut to what the grammar allows.
    engine = LLMEngine(ModelConfig(), CacheConfig(), SchedulerConfig(policy="adaserve", budget=16))
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        yield openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)


def chat(client: openai.OpenAI, content: str, **kw):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": content}],
        temperature=0,
        **kw,
    )


def test_json_schema_output_validates(client: openai.OpenAI) -> None:
    r = chat(
        client,
        "Describe a programmer named Ada as JSON.",
        max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    )
    choice = r.choices[0]
    assert choice.finish_reason == "stop", f"the JSON did not complete: {choice.message.content}"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_the_clients_parse_gets_its_pydantic_model(client: openai.OpenAI) -> None:
    r = client.chat.completions.parse(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "Tell me about Paris in JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=120,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City), r.choices[0].message.content


def test_json_object_streams_one_object(client: openai.OpenAI) -> None:
    stream = chat(
        client,
        "Give a JSON object with a colour and its hex code.",
        max_tokens=80,
        stream=True,
        response_format={"type": "json_object"},
    )
    text, reasons = "", []
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            reasons.append(c.finish_reason)
    assert "stop" in reasons, f"the object did not complete: {text!r}"
    assert isinstance(json.loads(text), dict), text


def test_vllm_choice_and_regex_on_completions(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Is the sky blue? Answer:",
        max_tokens=8,
        temperature=0.8,
        seed=3,
        n=4,
        extra_body={"structured_outputs": {"choice": [" yes", " no", " maybe"]}},
    )
    assert {c.text for c in r.choices} <= {" yes", " no", " maybe"}, r.choices
    r = client.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="The year the first moon landing happened:",
        max_tokens=12,
        temperature=0,
        extra_body={"guided_regex": r" (19|20)\d\d\."},
    )
    assert re.fullmatch(r" (19|20)\d\d\.", r.choices[0].text), r.choices[0].text


@pytest.mark.parametrize(
    "extra, param, says",
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format", "needs json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}}, "response_format", "json schema"),
        ({"guided_regex": "(unclosed"}, "guided_regex", "invalid regex"),
        ({"structured_outputs": {"grammar": "root ::= "}}, "structured_outputs", "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "one of"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
         "guided_choice", "one structured output"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True},
         "ignore_eos", "cannot be combined"),
        ({"structured_outputs": {"whitespace_pattern": " "}},
         "structured_outputs.whitespace_pattern", "not supported"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend", "xgrammar"),
    ],
)  # fmt: skip
def test_a_bad_constraint_is_a_400_naming_its_field(
    client: openai.OpenAI, extra: dict, param: str, says: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        chat(client, "Hi", max_tokens=4, extra_body=extra)
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == param, body
    assert says in body["message"], body
