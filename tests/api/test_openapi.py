"""The published OpenAPI document describes the completion bodies, and schemathesis fuzzes
the live server from it: no 5xx, every 4xx in OpenAI's error format."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from adaserve.api.server import build_app
from adaserve.config import ServerConfig
from tests.e2e.harness import ThreadServer


@pytest.fixture(scope="module")
def server(tiny_llama):
    from adaserve import LLMEngine
    from adaserve.config import CacheConfig, ModelConfig, SchedulerConfig

    # A short model length keeps fuzzed max_tokens cheap.
    engine = LLMEngine(
        ModelConfig(model=str(tiny_llama), max_model_len=48),
        CacheConfig(num_blocks=64),
        SchedulerConfig(policy="incremental", max_waiting=64),
    )
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        yield srv


def test_the_openapi_document_lists_the_request_bodies(server) -> None:
    doc = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    for path, model in (
        ("/v1/completions", "CompletionRequest"),
        ("/v1/chat/completions", "ChatCompletionRequest"),
    ):
        body = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"] == {"$ref": f"#/components/schemas/{model}"}
        props = doc["components"]["schemas"][model]["properties"]
        assert "slo_tpot_ms" in props and "description" in props["slo_tpot_ms"], props.keys()
        assert {"400", "429", "503"} <= set(doc["paths"][path]["post"]["responses"])
        headers = {p["name"] for p in doc["paths"][path]["post"]["parameters"]}
        assert headers == {"x-slo-tpot-ms", "x-slo-ttft-ms"}, f"SLO headers undocumented: {headers}"
    assert "prompt" in doc["components"]["schemas"]["CompletionRequest"]["required"]
    assert "messages" in doc["components"]["schemas"]["ChatCompletionRequest"]["required"]


def test_fuzzed_requests_get_no_5xx_and_openai_errors(server) -> None:
    api = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    seen: dict[str, int] = {}  # path -> fuzzed requests sent
    for result in api.get_all_operations():
        op = result.ok()
        if op.method.upper() != "POST":
            continue  # the GET routes take no input

        @given(case=op.as_strategy())
        @settings(
            max_examples=60,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
        )
        def fuzz(case) -> None:
            response = case.call(timeout=60)
            seen[case.path] = seen.get(case.path, 0) + 1
            assert response.status_code < 500, (
                f"{case.method} {case.path} {case.body!r} -> {response.status_code} {response.text}"
            )
            if response.status_code >= 400:
                err = response.json().get("error")
                assert isinstance(err, dict) and isinstance(err.get("message"), str), response.text
                assert {"message", "type", "param", "code"} <= set(err), response.text

        fuzz()
    assert set(seen) == {
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
    }, seen
    assert min(seen.values()) >= 30, f"too few fuzzed requests: {seen}"
