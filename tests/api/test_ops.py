"""Operations: the access and stats log lines, X-Request-Id, CORS, /version, /tokenize and
/detokenize, and the metrics (model_name label, KV ratio, request phases, vLLM's names), on
the real server over the tiny model, through the official openai client and httpx."""

from __future__ import annotations

import logging
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

import adaserve
from adaserve.api.logs import stats_line
from adaserve.api.metrics import MetricsSnapshot
from adaserve.api.server import build_app
from adaserve.cli import main
from adaserve.config import ServerConfig
from tests.api.test_server_tiny import make_engine
from tests.e2e.harness import ThreadServer, free_port, metric, read_metrics, wait_for, wait_healthy

MODEL = "tiny-ops"
KEY = "sk-ops"
ORIGIN = "https://ui.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "t5 t6 t7 t8"


@pytest.fixture(scope="module")
def server(tiny_llama) -> Iterator[ThreadServer]:
    engine = make_engine(tiny_llama)
    cfg = ServerConfig(
        served_model_name=MODEL,
        api_keys=(KEY,),
        admission="queue",
        allowed_origins=(ORIGIN,),
        vllm_metrics=True,
        log_stats_interval_s=0.2,
    )
    with ThreadServer(build_app(engine, cfg)) as srv:
        yield srv


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.app.state.async_engine.engine.tokenizer


@pytest.fixture
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server: ThreadServer, path: str, body: object, **headers: str) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={**AUTH, **headers}, timeout=60)


# ---------------------------------------------------------------------------- log lines
ACCESS = re.compile(
    r"request id=(?P<id>\S+) prompt_tokens=(?P<prompt>\d+) output_tokens=(?P<output>\d+) "
    r"ttft_ms=(?P<ttft>[\d.]+) tpot_ms=(?P<tpot>[\d.]+|none) slo_tpot_ms=(?P<slo>\S+) "
    r"slo_met=(?P<met>true|false|none) finish=(?P<finish>\w+)$"
)


def access_lines(caplog, id_part: str) -> list[re.Match]:
    lines = [r.getMessage() for r in caplog.records if r.name == "adaserve.api.access"]
    return [m for m in map(ACCESS.match, lines) if m is not None and id_part in m["id"]]


def test_one_access_line_per_request_with_its_tokens_latencies_and_slo(client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="adaserve.api")
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True, "slo_tpot_ms": 60000},
        extra_headers={"X-Request-Id": "ops-access-1"},
    )
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=3,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "ops-access-2"},
    )
    (line,) = access_lines(caplog, "ops-access-1")
    assert line["id"] == r.id, "the access line names another id than the response"
    assert int(line["prompt"]) == r.usage.prompt_tokens == 4, line.group(0)
    assert int(line["output"]) == r.usage.completion_tokens == 5, line.group(0)
    assert line["finish"] == "length" and line["slo"] == "60000" and line["met"] == "true"
    assert float(line["ttft"]) == pytest.approx(r.model_extra["adaserve"]["ttft_ms"], abs=0.1)
    assert float(line["tpot"]) == pytest.approx(r.model_extra["adaserve"]["tpot_ms"], abs=0.1)
    (line,) = access_lines(caplog, "ops-access-2")
    assert int(line["output"]) == chat.usage.completion_tokens == 3, line.group(0)
    assert line["slo"] == "none" and line["met"] == "none", "no SLO was asked for"


def test_the_stats_line_counts_generation_while_requests_run(client, caplog) -> None:
    caplog.set_level(logging.INFO, logger="adaserve.api")
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=24, extra_body={"ignore_eos": True}
    )
    stat = re.compile(
        r"stats running=\d+ waiting=\d+ kv_usage=[\d.]+% generation_tok_s=(?P<tok_s>[\d.]+) "
        r"slo_attainment=(\S+) slo_met=\d+/\d+$"
    )

    def lines() -> list[re.Match]:
        msgs = [r.getMessage() for r in caplog.records if r.name == "adaserve.api.stats"]
        return [m for m in map(stat.match, msgs) if m is not None]

    wait_for(lambda: any(float(m["tok_s"]) > 0 for m in lines()), 5, "a stats line with tok/s")


def test_stats_line_arithmetic() -> None:
    before = MetricsSnapshot(0, 0, 0, 64, 100, 3, 2, 1)
    now = MetricsSnapshot(2, 1, 16, 64, 150, 4, 3, 1)
    assert stats_line(now, before, 2.0) == (
        "stats running=2 waiting=1 kv_usage=25.0% generation_tok_s=25.0 "
        "slo_attainment=75.0% slo_met=3/4"
    )


def test_serve_logs_timestamped_access_and_stats_lines(tiny_llama) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "adaserve.cli", "serve", str(tiny_llama), "--policy",
           "incremental", "--num-blocks", "64", "--port", str(port), "--log-stats-interval",
           "0.3", "--served-model-name", MODEL]  # fmt: skip
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, 120, alive=lambda: proc.poll() is None)
            body = {"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True}
            r = httpx.post(f"{url}/v1/completions", json=body, headers={"X-Request-Id": "sub-1"})
            assert r.status_code == 200 and r.headers["x-request-id"] == "sub-1", r.text
            time.sleep(0.8)  # a stats line after the request
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
        log.seek(0)
        text = log.read()
    stamp = r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO "
    access = rf"{stamp}adaserve\.api\.access: request id=cmpl-sub-1-\w+ prompt_tokens=4 "
    assert re.search(access + r"output_tokens=3 ", text, re.M), text[-3000:]
    assert re.search(rf"{stamp}adaserve\.api\.stats: stats running=", text, re.M), text[-3000:]
    # uvicorn's own lines get the same timestamped format.
    assert re.search(rf"{stamp}uvicorn\.error: ", text, re.M), text[-3000:]
    assert proc.returncode == 0


# ---------------------------------------------------------------------------- X-Request-Id
def test_a_client_request_id_is_echoed_and_names_the_request(client) -> None:
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, extra_headers={"X-Request-Id": "abc-123"}
    )
    assert raw.headers["x-request-id"] == "abc-123", "the client's X-Request-Id is not echoed"
    assert raw.parse().id.startswith("cmpl-abc-123-"), raw.parse().id
    with client.chat.completions.with_streaming_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=2,
        stream=True,
        extra_headers={"X-Request-Id": "abc-stream"},
    ) as stream:
        assert stream.headers["x-request-id"] == "abc-stream", "a stream does not echo the id"
        ids = {chunk.id for chunk in stream.parse()}
    assert len(ids) == 1 and ids.pop().startswith("chatcmpl-abc-stream-"), ids


def test_without_a_client_id_the_header_carries_the_servers(server, client) -> None:
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert raw.headers["x-request-id"] == raw.parse().id, "X-Request-Id is not the server's id"
    with client.completions.with_streaming_response.create(
        model=MODEL, prompt=PROMPT, max_tokens=2, stream=True
    ) as stream:
        chunk_ids = {chunk.id for chunk in stream.parse()}
        assert chunk_ids == {stream.headers["x-request-id"]}, chunk_ids


def test_errors_echo_the_client_id_and_a_bad_id_is_a_400(server) -> None:
    r = post(
        server, "/v1/completions", {"prompt": PROMPT, "max_tokens": -1}, **{"X-Request-Id": "e-1"}
    )
    assert r.status_code == 400 and r.headers["x-request-id"] == "e-1", r.headers
    r = post(server, "/v1/completions", {"prompt": PROMPT}, **{"X-Request-Id": "has space"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x-request-id", r.text


# ---------------------------------------------------------------------------- CORS, version
def test_cors_lets_the_allowed_origin_call_the_api(server) -> None:
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    }
    r = httpx.options(f"{server.url}/v1/chat/completions", headers=preflight, timeout=10)
    assert r.status_code == 200, f"preflight refused (it must not need the API key): {r.text}"
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    other = httpx.options(
        f"{server.url}/v1/models", headers={**preflight, "Origin": "https://evil.example"}
    )
    assert "access-control-allow-origin" not in other.headers, "a foreign origin was allowed"
    r = httpx.get(f"{server.url}/v1/models", headers={**AUTH, "Origin": ORIGIN}, timeout=10)
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_version_route_and_flag(server, capsys) -> None:
    r = httpx.get(f"{server.url}/version", timeout=10)
    assert r.status_code == 200 and r.json() == {"version": adaserve.__version__}, r.text
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"adaserve {adaserve.__version__}"


# ---------------------------------------------------------------------------- tokenize
def test_tokenize_counts_what_generation_uses(server, client, tokenizer) -> None:
    prompt = "t5 t6 t7 t8 t9"
    r = post(server, "/tokenize", {"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    got = r.json()
    engine = server.app.state.async_engine.engine
    assert got["tokens"] == tokenizer(prompt)["input_ids"], got
    assert got["count"] == len(got["tokens"]) == 5 and got["max_model_len"] == engine.max_model_len
    used = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
    assert used.usage.prompt_tokens == got["count"], "/tokenize disagrees with generation"
    plain = post(server, "/tokenize", {"prompt": prompt, "add_special_tokens": False}).json()
    assert plain["tokens"] == tokenizer.encode(prompt, add_special_tokens=False)

    messages = [{"role": "user", "content": "t5 t6"}, {"role": "assistant", "content": "t7"}]
    chat = post(server, "/tokenize", {"messages": messages}).json()
    expected = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert chat["tokens"] == list(expected), chat
    used = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert used.usage.prompt_tokens == chat["count"], "/tokenize disagrees with chat"


def test_detokenize_reads_token_ids_back(server, tokenizer) -> None:
    ids = post(server, "/tokenize", {"prompt": "t7 t8 t9"}).json()["tokens"]
    r = post(server, "/detokenize", {"tokens": ids})
    assert r.status_code == 200 and r.json() == {"prompt": tokenizer.decode(ids)}, r.text
    assert r.json()["prompt"] == "t7 t8 t9"


USER = [{"role": "user", "content": "t5"}]
BAD_BODIES = [
    ("/tokenize", {}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": "t5", "messages": USER}, "prompt", "exactly one"),
    ("/tokenize", {"prompt": 5}, "prompt", "string"),
    ("/tokenize", {"prompt": "t5", "add_special_tokens": "yes"}, "add_special_tokens", "bool"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "t5"}]}, "messages[0].role", "role"),
    ("/detokenize", {"tokens": [5, 96]}, "tokens", "tokens[1] = 96"),
    ("/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
    ("/detokenize", {"tokens": "t5"}, "tokens", "list"),
    ("/detokenize", {}, "tokens", "required"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param", "says"), BAD_BODIES)
def test_bad_tokenize_input_is_an_openai_400_naming_the_field(server, path, body, param, says):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert says in err["message"], err


def test_tokenize_needs_the_key_and_the_served_model(server) -> None:
    r = httpx.post(f"{server.url}/tokenize", json={"prompt": "t5"}, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    r = post(server, "/detokenize", {"model": "other", "tokens": [5]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model", r.text


# ---------------------------------------------------------------------------- metrics
def test_request_metrics_carry_the_model_and_vllm_names_count_the_same(server, client) -> None:
    before = read_metrics(server.url)
    n, max_tokens = 3, 4
    for _ in range(n):
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
    wait_for(
        lambda: metric(read_metrics(server.url), "adaserve_num_requests_running") == 0, 5, "idle"
    )
    after = read_metrics(server.url)

    def delta(name: str, **labels: str) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    finished = delta("adaserve_requests_total", finish_reason="length", model_name=MODEL)
    assert finished == n, "adaserve_requests_total{model_name} did not count the requests"
    for phase in ("queue", "prefill", "decode"):
        name = f"adaserve_request_{phase}_time_seconds"
        assert delta(f"{name}_count", model_name=MODEL) == n, f"{name} did not count"
        assert delta(f"{name}_sum", model_name=MODEL) >= 0
    phases = sum(
        delta(f"adaserve_request_{p}_time_seconds_sum") for p in ("queue", "prefill", "decode")
    )
    e2e = delta("adaserve_e2e_request_latency_seconds_sum")
    assert 0 < phases <= e2e + 1e-6, f"queue + prefill + decode ({phases}) exceed e2e ({e2e})"
    used, total = (
        metric(after, "adaserve_kv_blocks_used"),
        metric(after, "adaserve_kv_blocks_total"),
    )
    assert metric(after, "adaserve_kv_cache_usage_ratio") == pytest.approx(used / total)

    # --vllm-metrics: vLLM's names count what adaserve's count, labelled with the model.
    # (vLLM's sample, its extra labels, ours, our labels)
    pairs = [
        ("vllm:request_success_total", {"finished_reason": "length"},
         "adaserve_requests_total", {"finish_reason": "length"}),
        ("vllm:prompt_tokens_total", {}, "adaserve_prompt_tokens_total", {}),
        ("vllm:generation_tokens_total", {}, "adaserve_emitted_tokens_total", {}),
    ] + [
        (f"vllm:{name}_count", {}, f"adaserve_{name}_count", {})
        for name in ("time_to_first_token_seconds", "time_per_output_token_seconds",
                     "e2e_request_latency_seconds", "request_queue_time_seconds",
                     "request_prefill_time_seconds", "request_decode_time_seconds")
    ]  # fmt: skip
    for vllm_name, vllm_labels, ours, our_labels in pairs:
        got = delta(vllm_name, model_name=MODEL, **vllm_labels)
        assert got == delta(ours, **our_labels) and got > 0, f"{vllm_name}: {got}"
    assert delta("vllm:generation_tokens_total", model_name=MODEL) == n * max_tokens
    assert ("vllm:gpu_cache_usage_perc", (("model_name", MODEL),)) in after


def test_without_the_flags_no_cors_no_vllm_aliases_no_stats_line(tiny_llama) -> None:
    cfg = ServerConfig(log_stats_interval_s=0, served_model_name=MODEL)
    with ThreadServer(build_app(make_engine(tiny_llama), cfg)) as srv:
        r = httpx.get(f"{srv.url}/v1/models", headers={"Origin": ORIGIN}, timeout=10)
        assert "access-control-allow-origin" not in r.headers, "CORS without --allowed-origins"
        names = {name for name, _ in read_metrics(srv.url)}
        assert "vllm:num_requests_running" in names, "the Gateway API gauges are always on"
        assert not names & {"vllm:time_to_first_token_seconds_count", "vllm:prompt_tokens_total"}
        assert srv.app.state.stats_logger is None, "--log-stats-interval 0 still logs stats"


def test_cors_stats_and_vllm_flags_parse() -> None:
    from adaserve.cli import build_parser

    a = build_parser().parse_args(
        ["serve", "--allowed-origins", "https://a.example,https://b.example",
         "--allowed-origins", "https://c.example", "--allowed-methods", "GET,POST",
         "--vllm-metrics", "--log-stats-interval", "2.5"]
    )  # fmt: skip
    # The namespace holds each ServerConfig field under its own name, as the field takes it.
    assert a.allowed_origins == ("https://a.example", "https://b.example", "https://c.example")
    assert a.allowed_methods == ("GET", "POST") and a.allowed_headers == ("*",)
    assert a.vllm_metrics and a.log_stats_interval_s == 2.5
    with pytest.raises(ValueError, match="log_stats_interval_s must be >= 0"):
        ServerConfig(log_stats_interval_s=-1)
