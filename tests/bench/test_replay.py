"""The replay client against a scripted OpenAI-style server (httpx.MockTransport, no network):
arrival times honoured, tokens counted per chunk, every failure recorded, counters read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from adaserve.bench.replay import replay, request_body
from adaserve.bench.trace import BenchRequest, TraceRequest


def bench_request(i: int, prompt: str, send_s: float, slo: float | None = 50.0) -> BenchRequest:
    trace = TraceRequest(i, 1000 * send_s, prompt, None, 4, -slo if slo else 0.0)
    return BenchRequest(trace, send_s, max_tokens=4, slo_tpot_ms=slo)


def chunk(**fields: object) -> bytes:
    return f"data: {json.dumps(fields)}\n\n".encode()


async def sse(prompt: str) -> AsyncIterator[bytes]:
    """The scripted stream of each prompt."""
    if prompt == "multi":  # speculative decoding: several tokens in one chunk
        yield chunk(choices=[{"text": "a", "token_ids": [5], "finish_reason": None}])
        await asyncio.sleep(0.05)
        yield chunk(choices=[{"text": "bcd", "token_ids": [6, 7, 8], "finish_reason": "length"}])
        yield chunk(choices=[], usage={"prompt_tokens": 2, "completion_tokens": 4})
    elif prompt == "plain":  # a server without token_ids: one chunk per token, usage at the end
        for _ in range(4):
            yield chunk(choices=[{"text": "x", "finish_reason": None}])
            await asyncio.sleep(0.01)
        yield chunk(choices=[], usage={"prompt_tokens": 2, "completion_tokens": 4})
    elif prompt == "cut":  # the server died mid-stream
        yield chunk(choices=[{"text": "a", "token_ids": [5], "finish_reason": None}])
        return
    elif prompt == "engine-error":
        yield chunk(error={"message": "engine error: boom", "type": "internal_error"})
    yield b"data: [DONE]\n\n"


class ScriptedServer:
    def __init__(self, metrics: list[str] | None = None) -> None:
        self.bodies: list[dict] = []
        self.metrics = metrics or []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "m"}]})
        if path == "/metrics":
            if not self.metrics:
                return httpx.Response(404)
            return httpx.Response(200, text=self.metrics.pop(0))
        body = json.loads(request.content)
        self.bodies.append(body)
        if not body.get("stream"):  # the prefill-speed probe: one token, 50 prompt tokens
            await asyncio.sleep(0.05)
            return httpx.Response(200, json={"usage": {"prompt_tokens": 50}})
        if body["prompt"] == "full":
            return httpx.Response(429, json={"error": {"message": "the waiting queue is full"}})
        return httpx.Response(200, content=sse(body["prompt"]))


def run(server: ScriptedServer, reqs: list[BenchRequest]):
    transport = httpx.MockTransport(server)
    return asyncio.run(replay("http://x", reqs, progress=False, transport=transport))


def test_tokens_per_chunk_and_arrival_times() -> None:
    reqs = [bench_request(0, "multi", 0.0), bench_request(1, "plain", 0.3, slo=None)]
    model, (multi, plain), counters = run(ScriptedServer(), reqs)
    assert model == "m", "the model is discovered from /v1/models"
    assert counters is None, "a server without /metrics gives no counters, not an error"
    assert multi.output_tokens == 4 and len(multi.token_times_s) == 4
    assert multi.token_times_s[1] == multi.token_times_s[3], "one chunk, one arrival time"
    assert multi.tpot_ms == pytest.approx(
        1000 * (multi.token_times_s[3] - multi.token_times_s[0]) / 3
    )
    assert plain.output_tokens == 4 and plain.completed and plain.finish_reason is None
    for r in (multi, plain):
        assert r.sent_s is not None and 0 <= r.sent_s - r.scheduled_s < 0.15, (
            f"request {r.index} sent at {r.sent_s}, scheduled at {r.scheduled_s}"
        )


def test_every_failure_is_recorded_not_raised() -> None:
    reqs = [
        bench_request(0, "full", 0.0),
        bench_request(1, "cut", 0.0),
        bench_request(2, "engine-error", 0.0),
    ]
    _, records, _ = run(ScriptedServer(), reqs)
    errors = [r.error for r in records]
    assert errors[0] == "HTTP 429: the waiting queue is full", errors
    assert errors[1] is not None and "[DONE]" in errors[1], errors
    assert errors[2] == "engine error: boom", errors
    assert not any(r.slo_attained for r in records), "a failed request never attains its SLO"
    assert all(r.end_s is not None for r in records)


def test_request_body_is_a_streamed_greedy_completion() -> None:
    server = ScriptedServer()
    run(server, [bench_request(0, "multi", 0.0, slo=75.0), bench_request(1, "plain", 0.0, None)])
    with_slo, without = sorted(server.bodies, key=lambda b: b["prompt"])
    for b in (with_slo, without):
        assert b["stream"] is True and b["temperature"] == 0 and b["ignore_eos"] is True
        assert b["max_tokens"] == 4 and b["model"] == "m"
    assert with_slo["slo_tpot_ms"] == 75.0
    assert "slo_tpot_ms" not in without, "a request without an SLO must not send one"
    assert request_body(bench_request(0, "p", 0.0), "m")["stream_options"]["include_usage"]


def test_counters_are_the_difference_over_the_replay() -> None:
    def text(accepted: int, iters: int, drafts: int) -> str:
        return (
            f"adaserve_spec_decode_num_accepted_tokens_total {accepted}\n"
            f"adaserve_spec_decode_num_draft_tokens_total {2 * accepted}\n"
            f"adaserve_spec_decode_num_drafts_total {drafts}\n"
            f'adaserve_iterations_total{{kind="decode"}} {iters}\n'
            f'adaserve_iterations_total{{kind="prefill"}} 99\n'
        )

    server = ScriptedServer(metrics=[text(10, 5, 5), text(40, 15, 25)])
    _, _, counters = run(server, [bench_request(0, "multi", 0.0)])
    assert counters is not None
    assert counters["accepted_tokens"] == 30 and counters["decode_iterations"] == 10
    assert counters["mean_accepted_tokens_per_iteration"] == pytest.approx(3.0)
    assert counters["mean_accepted_tokens_per_request_step"] == pytest.approx(1.5)
    assert counters["acceptance_rate"] == pytest.approx(0.5)


def test_the_prefill_probe_sets_every_records_ttft_objective() -> None:
    server = ScriptedServer()
    transport = httpx.MockTransport(server)
    reqs = [bench_request(0, "plain", 0.0)]
    _, records, _ = asyncio.run(
        replay("http://x", reqs, progress=False, transport=transport, measure_prefill="probe")
    )
    probes = [b for b in server.bodies if b["prompt"].endswith("probe")]
    assert len(probes) == 2 and all(b["max_tokens"] == 1 for b in probes)
    assert probes[0]["prompt"][:3] != probes[1]["prompt"][:3], "a cached prompt would be timed"
    speed = records[0].prefill_ms_per_token
    assert speed is not None and 1.0 <= speed < 10.0, f"50 ms over 50 tokens measured {speed}"
    # prompt_tokens 2 (usage): objective = floor + factor x 2 x speed
    assert records[0].ttft_objective_ms == pytest.approx(1000.0 + 4.0 * 2 * speed)
    _, given, _ = asyncio.run(
        replay("http://x", reqs, progress=False, transport=transport, prefill_ms_per_token=3.0)
    )
    assert given[0].prefill_ms_per_token == 3.0, "a given speed is used, not measured"


class RefusingServer(ScriptedServer):
    """Refuses each streamed request `refusals` times (429 with the given hint headers, or a
    400 when `status` says so), then streams it."""

    def __init__(self, refusals: int, hint: dict[str, str], status: int = 429) -> None:
        super().__init__()
        self.refusals, self.hint, self.status = refusals, hint, status
        self.sends: list[float] = []

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/completions" and json.loads(request.content).get("stream"):
            self.sends.append(asyncio.get_running_loop().time())
            if len(self.sends) <= self.refusals:
                err = {"error": {"message": "the load cannot meet slo_tpot_ms"}}
                return httpx.Response(self.status, json=err, headers=self.hint)
        return await super().__call__(request)


def retried(server: RefusingServer, retries: int):
    transport = httpx.MockTransport(server)
    reqs = [bench_request(0, "multi", 0.0)]
    _, (rec,), _ = asyncio.run(
        replay("http://x", reqs, progress=False, transport=transport, retries=retries)
    )
    return rec


def test_a_refused_request_is_sent_again_after_the_servers_hint() -> None:
    server = RefusingServer(refusals=2, hint={"retry-after-ms": "150", "Retry-After": "1"})
    rec = retried(server, retries=2)
    assert rec.completed and rec.error is None and rec.attempts == 3
    gaps = [b - a for a, b in zip(server.sends, server.sends[1:])]
    assert all(0.14 <= g < 0.5 for g in gaps), f"retry-after-ms (150 ms) not honoured: {gaps}"
    assert rec.sent_s is not None and rec.ttft_s is not None and rec.ttft_s >= 0.28, (
        "the TTFT counts from the first send, so the waits are in it"
    )


def test_retries_run_out_and_the_last_refusal_is_recorded() -> None:
    server = RefusingServer(refusals=5, hint={"Retry-After": "0.05"})
    rec = retried(server, retries=1)
    assert rec.attempts == 2 and len(server.sends) == 2, "one send and one retry, no more"
    assert rec.error == "HTTP 429: the load cannot meet slo_tpot_ms" and not rec.completed
    assert retried(RefusingServer(refusals=1, hint={}), retries=0).attempts == 1, (
        "without retries a refusal is final"
    )


def test_a_client_error_is_not_retried_and_a_missing_hint_backs_off() -> None:
    bad = RefusingServer(refusals=1, hint={}, status=400)
    rec = retried(bad, retries=2)
    assert len(bad.sends) == 1 and rec.error is not None and rec.error.startswith("HTTP 400")
    server = RefusingServer(refusals=1, hint={"Retry-After": "3600"})  # over 60 s: ignored
    rec = retried(server, retries=1)
    assert rec.completed and 0.45 <= server.sends[1] - server.sends[0] < 2.0, (
        "without a usable hint the first retry waits the 0.5 s backoff"
    )
