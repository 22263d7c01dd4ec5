"""The server over a tiny random model, in-thread uvicorn on 127.0.0.1: every policy, overload,
engine failures, client disconnects and graceful shutdown, made deterministic by gating the
engine's `step` from the test."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from adaserve import LLM, LLMEngine, SamplingParams
from adaserve.api.server import build_app
from adaserve.config import POLICIES, CacheConfig, ModelConfig, SchedulerConfig, ServerConfig
from tests.conftest import make_tiny_checkpoint
from tests.e2e.harness import ThreadServer, metric, read_metrics, wait_for

PROMPT = "t5 t6 t7 t8"


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_draft"), "llama", num_layers=1, seed=1
    )


def make_engine(
    target: Path, draft: Path | None = None, policy: str = "incremental", **sched: object
) -> LLMEngine:
    return LLMEngine(
        ModelConfig(model=str(target), draft_model=str(draft) if draft else None),
        CacheConfig(num_blocks=64),
        SchedulerConfig(policy=policy, **sched),
    )


def complete(url: str, **body: object) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", json={"prompt": PROMPT, **body}, timeout=60)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_serves_the_targets_greedy_output(tiny_llama, tiny_draft, policy) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    expected = LLM(str(tiny_llama)).generate(PROMPT, params)[0].outputs[0].token_ids
    engine = make_engine(tiny_llama, tiny_draft, policy)
    # Admission queues (never refuses): the point here is the output, and `--admission slo`
    # refused this urgent request on a loaded CI machine (18 ms per token predicted).
    with ThreadServer(build_app(engine, ServerConfig(admission="queue"))) as srv:
        r = complete(
            srv.url,
            max_tokens=24,
            temperature=0,
            ignore_eos=True,
            return_token_ids=True,
            slo_tpot_ms=20,
        )
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["choices"][0]["token_ids"] == expected, f"{policy}: HTTP output differs"
        info = got["adaserve"]
        assert info["slo_class"] == "urgent" and isinstance(info["slo_attained"], bool), info
        m = read_metrics(srv.url)
        drafted = metric(m, "adaserve_spec_decode_num_draft_tokens_total")
        accepted = metric(m, "adaserve_spec_decode_num_accepted_tokens_total")
        if policy == "incremental":
            assert drafted == 0, "incremental must not speculate"
        elif policy == "adaserve":
            # Control may rightly refuse a draft that costs as much as this tiny target; it
            # must then say so in /metrics.
            skipped = metric(m, "adaserve_speculation_skipped_drafts_total")
            assert drafted > 0 or skipped > 0, "adaserve neither speculated nor skipped a draft"
        else:
            assert drafted > 0 and info["spec_tree_tokens"] > 0, f"{policy} did not speculate"
            assert 0 <= accepted <= drafted, f"accepted {accepted} > drafted {drafted}"


def test_prompt_that_can_never_fit_the_kv_cache_is_a_400(tiny_llama) -> None:
    engine = LLMEngine(
        ModelConfig(model=str(tiny_llama)),
        CacheConfig(num_blocks=2, block_size=4),
        SchedulerConfig(policy="incremental"),
    )
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        r = complete(srv.url, prompt=list(range(2, 22)), max_tokens=2)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "KV blocks" in r.json()["error"]["message"], r.text
        assert complete(srv.url, prompt=[5, 6], max_tokens=2).status_code == 200


class Gate:
    """Wraps engine.step: the engine thread blocks while the gate is closed; can fail once."""

    def __init__(self, engine: LLMEngine) -> None:
        self.open = threading.Event()
        self.open.set()
        self.fail_next = False
        step = engine.step

        def gated_step():
            self.open.wait()
            if self.fail_next:
                self.fail_next = False
                raise RuntimeError("injected failure")
            return step()

        engine.step = gated_step  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def gated(tiny_llama) -> Iterator[tuple[ThreadServer, Gate]]:
    engine = make_engine(tiny_llama, max_num_seqs=1, max_waiting=2)
    gate = Gate(engine)
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        yield srv, gate


def kv_used(url: str) -> float:
    return metric(read_metrics(url), "adaserve_kv_blocks_used")


def test_queue_full_is_429_with_retry_after_and_serving_goes_on(gated) -> None:
    srv, gate = gated
    engine = srv.app.state.async_engine

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as client:
            body = {"prompt": PROMPT, "max_tokens": 4}
            gate.open.clear()
            queued = [
                asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)
            ]
            while engine.num_waiting < 2:
                await asyncio.sleep(0.01)
            r = await client.post("/v1/completions", json=body)
            assert r.status_code == 429, r.text
            assert int(r.headers["retry-after"]) >= 1, "429 without Retry-After"
            assert r.json()["error"]["code"] == "queue_full", r.text
            gate.open.set()
            for done in await asyncio.gather(*queued):
                assert done.status_code == 200, done.text
            again = await client.post("/v1/completions", json=body)
            assert again.status_code == 200, "server stopped serving after a 429"

    try:
        asyncio.run(scenario())
    finally:
        gate.open.set()
    assert (
        metric(read_metrics(srv.url), "adaserve_requests_rejected_total", reason="queue_full") >= 1
    )


def test_engine_failure_is_a_500_and_the_next_request_works(gated) -> None:
    srv, gate = gated
    gate.fail_next = True
    r = complete(srv.url, max_tokens=4)
    assert r.status_code == 500 and "injected failure" in r.json()["error"]["message"], r.text
    gate.fail_next = True
    with httpx.stream(
        "POST",
        f"{srv.url}/v1/completions",
        timeout=60,
        json={"prompt": PROMPT, "max_tokens": 4, "stream": True},
    ) as s:
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert "injected failure" in events[-2] and events[-1] == "data: [DONE]", events
    assert complete(srv.url, max_tokens=4).status_code == 200
    wait_for(lambda: kv_used(srv.url) == 0, 10, "KV blocks freed after the engine failure")


def test_non_streaming_client_that_disconnects_is_aborted(gated) -> None:
    srv, gate = gated
    before = metric(read_metrics(srv.url), "adaserve_requests_total", finish_reason="abort")
    body = json.dumps({"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}).encode()
    gate.open.clear()
    try:
        with socket.create_connection(("127.0.0.1", srv.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for(lambda: srv.app.state.async_engine.num_waiting == 1, 10, "request queued")
    finally:
        gate.open.set()
    wait_for(
        lambda: (
            metric(read_metrics(srv.url), "adaserve_requests_total", finish_reason="abort")
            == before + 1
        ),
        10,
        "the abort",
    )
    wait_for(lambda: kv_used(srv.url) == 0, 10, "KV blocks freed after the disconnect")


@pytest.mark.parametrize(
    "extreme",
    [
        {"temperature": 1e-300},
        {"temperature": 1e300},
        {"top_p": 1e-300},
        {"top_k": 10**9},
        {"seed": -5},
        {"max_tokens": 2**70},
        {"stop": ["x" * 1000]},
        {"stop_token_ids": [-1, 10**30]},
        {"prompt": "\x00 \u2603 t5"},
    ],
)
def test_extreme_but_valid_values_are_served(gated, extreme: dict) -> None:
    r = complete(gated[0].url, **{"max_tokens": 3, **extreme})
    assert r.status_code == 200, f"{extreme}: {r.status_code} {r.text}"


def test_draining_server_answers_503_with_retry_after(gated) -> None:
    srv, _ = gated
    serving = srv.app.state.serving
    serving.draining = True
    try:
        r = complete(srv.url, max_tokens=2)
        assert r.status_code == 503 and "retry-after" in r.headers, r.text
        assert httpx.get(f"{srv.url}/health").status_code == 503, "health must fail while draining"
    finally:
        serving.draining = False
    assert complete(srv.url, max_tokens=2).status_code == 200


def test_shutdown_finishes_running_streams_then_stops_the_engine(tiny_llama) -> None:
    engine = make_engine(tiny_llama)
    gate = Gate(engine)
    srv = ThreadServer(build_app(engine, ServerConfig())).__enter__()
    lines: list[str] = []

    def read_stream() -> None:
        with httpx.stream(
            "POST",
            f"{srv.url}/v1/completions",
            timeout=60,
            json={"prompt": PROMPT, "max_tokens": 50, "ignore_eos": True, "stream": True},
        ) as s:
            lines.extend(line for line in s.iter_lines() if line.startswith("data: "))

    gate.open.clear()
    reader = threading.Thread(target=read_stream)
    reader.start()
    wait_for(lambda: engine.has_unfinished(), 10, "the stream to reach the engine")
    stopper = threading.Thread(target=srv.stop)
    stopper.start()  # SIGTERM while the stream runs
    wait_for(lambda: srv.app.state.serving.draining, 10, "draining to start")
    try:
        late = complete(srv.url, max_tokens=2).status_code
    except httpx.TransportError:
        late = None  # listener already closed: also a refusal
    assert late in (None, 503), f"a request during shutdown got {late}"
    gate.open.set()
    reader.join(30)
    stopper.join(30)
    final = json.loads(lines[-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "length", "running stream was not finished"
    assert lines[-1] == "data: [DONE]"
    assert not srv.thread.is_alive(), "server did not exit"
    assert not srv.app.state.async_engine.alive, "engine thread still running after shutdown"
    assert engine.engine.target.cache.allocator.num_used == 0, "KV blocks leaked at shutdown"


def test_drain_timeout_ends_running_streams_with_finish_reason_abort(tiny_llama) -> None:
    engine = make_engine(tiny_llama)
    gate = Gate(engine)
    srv = ThreadServer(build_app(engine, ServerConfig()), shutdown_timeout_s=1.0).__enter__()
    lines: list[str] = []

    def read_stream() -> None:
        body = {"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{srv.url}/v1/completions", timeout=60, json=body) as s:
            lines.extend(line for line in s.iter_lines() if line.startswith("data: "))

    reader = threading.Thread(target=read_stream)
    reader.start()
    wait_for(lambda: engine.has_unfinished(), 10, "the stream to reach the engine")
    gate.open.clear()  # the stream cannot finish on its own while the drain runs
    started = time.monotonic()
    stopper = threading.Thread(target=srv.stop)
    stopper.start()  # SIGTERM
    wait_for(lambda: srv.app.state.serving.draining, 10, "draining to start")
    # The socket stays open while the stream runs: a load balancer reads 503 + Retry-After,
    # not connection-refused.
    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    late = complete(srv.url, max_tokens=4)
    assert late.status_code == 503 and "retry-after" in late.headers, late.text
    timer = srv.server._drain_timer
    wait_for(lambda: timer is not None and not timer.is_alive(), 10, "the drain timeout")
    gate.open.set()  # one more step, then the engine applies the abort
    reader.join(30)
    stopper.join(30)
    took = time.monotonic() - started
    final = json.loads(lines[-2].removeprefix("data: "))
    assert final["choices"][0]["finish_reason"] == "abort", final
    assert len(lines) < 300, "the stream ran to its end instead of being aborted"
    assert lines[-1] == "data: [DONE]", "the aborted stream did not end cleanly"
    assert took < 6, f"SIGTERM to exit took {took:.1f} s with a 1 s drain timeout"
    assert not srv.thread.is_alive(), "server did not exit"
    assert engine.engine.target.cache.allocator.num_used == 0, "KV blocks leaked at shutdown"


def test_a_fault_in_one_request_is_its_own_500_and_the_others_finish(
    tiny_llama, monkeypatch
) -> None:
    from adaserve.request_manager.output import OutputProcessor

    engine = make_engine(tiny_llama, max_num_seqs=8)
    bad = engine.tokenize("t9 t9 t9")
    real_commit = OutputProcessor.commit

    def commit(self, req, tokens, now):
        if req.prompt_token_ids == bad and len(req.output_token_ids) >= 2:
            raise RuntimeError("injected fault")
        return real_commit(self, req, tokens, now)

    monkeypatch.setattr(OutputProcessor, "commit", commit)
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        want = complete(srv.url, max_tokens=12, temperature=0, ignore_eos=True).json()
        results: dict[str, httpx.Response] = {}

        def send(name: str, prompt: str) -> None:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            results[name] = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)

        threads = [threading.Thread(target=send, args=(f"ok{i}", PROMPT)) for i in range(3)]
        threads.append(threading.Thread(target=send, args=("bad", "t9 t9 t9")))
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        err = results["bad"]
        assert err.status_code == 500, err.text
        assert "error id" in err.json()["error"]["message"], err.text
        for i in range(3):
            r = results[f"ok{i}"]
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == want["choices"][0]["text"]
        assert complete(srv.url, max_tokens=2).status_code == 200, "server stopped serving"
        wait_for(lambda: engine.engine.target.cache.allocator.num_used == 0, 10, "KV freed")


def test_slo_admission_refuses_an_slo_the_load_cannot_meet(tiny_llama) -> None:
    from tests.virtual_time import slow_forwards

    # The target's forwards cost 50 ms + 2 ms per token (on the engine's clock).
    engine = slow_forwards(make_engine(tiny_llama, max_num_seqs=8), lambda n: 0.05 + 0.002 * n)
    assert ServerConfig().admission == "slo", "the default server refuses what it cannot serve"
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        tight = complete(srv.url, max_tokens=4, slo_tpot_ms=10)
        assert tight.status_code == 429, tight.text
        assert tight.json()["error"]["code"] == "slo_unattainable", tight.text
        assert "retry-after" in tight.headers and "slo_tpot_ms 10" in tight.text
        assert complete(srv.url, max_tokens=4, slo_tpot_ms=1000).status_code == 200
        assert complete(srv.url, max_tokens=4).status_code == 200, "no SLO: nothing to refuse"
        m = read_metrics(srv.url)
        assert metric(m, "adaserve_requests_rejected_total", reason="slo_unattainable") == 1
    with ThreadServer(build_app(engine, ServerConfig(admission="queue"))) as srv:  # admitted
        assert complete(srv.url, max_tokens=4, slo_tpot_ms=10).status_code == 200


def test_slo_admission_protects_the_slos_of_admitted_requests(tiny_llama) -> None:
    from tests.virtual_time import slow_forwards

    # A decode iteration over n requests costs 50 ms + 20 ms per request.
    engine = slow_forwards(make_engine(tiny_llama, max_num_seqs=8), lambda n: 0.05 + 0.02 * n)
    assert engine.admission.refusal(100) is None, "alone: about 70 ms per token"
    held = engine.add_request(PROMPT, SamplingParams(max_tokens=64, slo_tpot_ms=80))
    # A second request would make every token about 90 ms: it would break the admitted 80 ms
    # SLO, so it is refused however lenient its own SLO (or without one).
    for slo in (1000, None):
        why = engine.admission.refusal(slo)
        assert why is not None and "past their slo_tpot_ms 80" in why, why
    why = engine.admission.refusal(85)
    assert why is not None and "slo_tpot_ms 85 cannot be met" in why, why
    engine.abort(held.request_id)
    assert engine.admission.refusal(1000) is None, "the tight request left: room again"


@contextlib.contextmanager
def _tight_stream(engine: LLMEngine, metrics: dict | None = None) -> Iterator[str]:
    """A server on `engine` (its URL) while a 100 ms stream of 400 tokens decodes on it; on
    leaving, that stream has been served and its KV freed, and the server's /metrics then are
    in `metrics`."""
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        first: dict = {}
        body = dict(max_tokens=400, ignore_eos=True, slo_tpot_ms=100)
        t = threading.Thread(target=lambda: first.update(r=complete(srv.url, **body)))
        t.start()
        wait_for(lambda: engine.scheduler.running, 10, "the 100 ms stream decodes")
        yield srv.url
        t.join(60)
        assert first["r"].status_code == 200, first["r"].text
        wait_for(lambda: engine.engine.target.cache.allocator.num_used == 0, 10, "KV freed")
        if metrics is not None:
            metrics.update(read_metrics(srv.url))


def _behind_a_tight_stream(
    tiny_llama,
    hold: float,
    second: dict,
    best_effort: int = 0,
    metrics: dict | None = None,
    max_tokens: int = 400,
) -> tuple[httpx.Response, float]:
    """A request with `second`'s fields and `max_tokens` (by default as long as the stream, so
    it would slow every token the stream has left) sent while a 100 ms stream decodes, on an
    engine whose decode iteration costs 50 ms + 30 ms per request (so a second stream would
    make it 110 ms): its response and the seconds it took; the server's /metrics at the end
    into `metrics`."""
    from tests.virtual_time import slow_forwards

    engine = slow_forwards(
        make_engine(
            tiny_llama, max_num_seqs=8, admission_hold=hold, admission_best_effort=best_effort
        ),
        lambda n: 0.05 + 0.03 * n,
    )
    with _tight_stream(engine, metrics) as url:
        start = time.monotonic()
        r = complete(url, max_tokens=max_tokens, ignore_eos=True, **second)
        took = time.monotonic() - start
    return r, took


def test_slo_admission_holds_a_request_until_a_stream_makes_room(tiny_llama) -> None:
    """Refused for its TPOT only because a 100 ms stream decodes, a request is held (no KV,
    not scheduled) and served once that stream ends, within its hold (half its 30 s TTFT
    objective); with --admission-hold 0 the same request is refused at arrival."""
    served, _ = _behind_a_tight_stream(
        tiny_llama, 0.5, {"slo_tpot_ms": 1000, "slo_ttft_ms": 30_000}
    )
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 400
    refused, _ = _behind_a_tight_stream(
        tiny_llama, 0.0, {"slo_tpot_ms": 1000, "slo_ttft_ms": 30_000}
    )
    assert refused.status_code == 429, refused.text
    assert "past their slo_tpot_ms 100" in refused.text, refused.text


def test_a_request_the_load_cannot_promise_is_served_best_effort_and_told_so(tiny_llama) -> None:
    """The same request, not held (--admission-hold 0), with --admission-best-effort 1: its
    SLO could be met alone, so it is served best effort instead of refused (its row sits out
    whenever the 100 ms stream's pace needs it to), and the response says so before any token;
    the 100 ms stream keeps its SLO and the counter counts one."""
    m: dict = {}
    second = {"slo_tpot_ms": 1000, "slo_ttft_ms": 30_000}
    served, _ = _behind_a_tight_stream(tiny_llama, 0.0, second, best_effort=1, metrics=m)
    assert served.status_code == 200, served.text
    assert served.headers.get("x-slo-admission") == "best-effort", served.headers
    assert served.json()["usage"]["completion_tokens"] == 400
    assert metric(m, "adaserve_requests_best_effort_total") == 1
    assert metric(m, "adaserve_tpot_slo_violated_total") == 0, "an SLO was missed"
    assert metric(m, "adaserve_tpot_slo_attained_total") == 2
    # One whose SLO no load can meet (10 ms against 80 ms alone) is refused all the same.
    impossible, _ = _behind_a_tight_stream(tiny_llama, 0.0, {"slo_tpot_ms": 10}, best_effort=1)
    assert impossible.status_code == 429, impossible.text


def test_a_short_request_beside_a_long_tight_stream_is_admitted_with_its_promise(
    tiny_llama,
) -> None:
    """Four tokens beside the 100 ms stream's ~400 make its iterations 110 ms for four of
    them (80 ms alone): its mean moves by well under a millisecond, so admission, pricing
    the stream over what it has left, admits the request at once with its SLO (the batch of
    now alone said 110 ms, over 100, and refused it), and both SLOs are met."""
    m: dict = {}
    second = {"slo_tpot_ms": 1000, "slo_ttft_ms": 30_000}
    r, _ = _behind_a_tight_stream(tiny_llama, 0.0, second, best_effort=1, metrics=m, max_tokens=4)
    assert r.status_code == 200, r.text
    assert r.headers.get("x-slo-admission") is None, "served with its promise, not best effort"
    assert r.json()["usage"]["completion_tokens"] == 4
    assert metric(m, "adaserve_requests_best_effort_total") == 0
    assert metric(m, "adaserve_tpot_slo_violated_total") == 0, "an SLO was missed"
    assert metric(m, "adaserve_tpot_slo_attained_total") == 2


@pytest.mark.parametrize("share", [0.85, 0.0])
def test_under_overload_the_most_expensive_request_gets_429_for_its_work(
    tiny_llama, share: float
) -> None:
    """A 100 ms stream decodes 400 tokens (~32 s of work on these 50 ms + 30 ms per request
    forwards), more than the 5-s window's budget: the server is overloaded; a cheap request
    (refused for its own SLO) sets the limit, and one needing ~12 s (400 tokens beside the
    stream) is refused at arrival for its work (429 with Retry-After, the reason said), where
    without the rule (share 0) it is refused for the stream's SLO."""
    from tests.virtual_time import slow_forwards

    engine = slow_forwards(
        make_engine(
            tiny_llama,
            max_num_seqs=8,
            admission_hold=0.0,
            admission_work_window_s=5.0,
            admission_work_share=share,
            admission_best_effort=0,  # refused for the stream's SLO, not served best effort
        ),
        lambda n: 0.05 + 0.03 * n,
    )
    with _tight_stream(engine) as url:
        tight = complete(url, max_tokens=4, ignore_eos=True, slo_tpot_ms=1)
        assert tight.status_code == 429 and "slo_tpot_ms 1 cannot" in tight.text, tight.text
        big = complete(url, max_tokens=400, ignore_eos=True)
    assert big.status_code == 429 and "retry-after" in big.headers, big.text
    if share:
        assert "least compute first" in big.text and "400 tokens" in big.text, big.text
    else:
        assert "past their slo_tpot_ms 100" in big.text, big.text


def test_slo_admission_refuses_a_held_request_when_its_hold_runs_out(tiny_llama) -> None:
    """Held for half its 400 ms TTFT objective while the 100 ms stream still has hundreds of
    tokens to go: then refused with the reason (429), not queued behind it."""
    r, took = _behind_a_tight_stream(tiny_llama, 0.5, {"slo_tpot_ms": 1000, "slo_ttft_ms": 400})
    assert r.status_code == 429 and "retry-after" in r.headers, r.text
    assert "past their slo_tpot_ms 100" in r.text, r.text
    assert took >= 0.2, f"refused after {took:.3f} s: not held for its 0.2 s"


def test_slo_admission_counts_the_prefill_a_ttft_objective_forces(tiny_llama) -> None:
    from tests.virtual_time import slow_forwards

    # Forwards cost 10 ms + 1 ms per token. A 450-token prompt must have its first token
    # within 550 ms: about 60 prompt tokens ride in every forward whatever the streams' SLOs
    # allow, so a stream admitted now would see ~70 ms iterations, not ~12 ms.
    engine = slow_forwards(make_engine(tiny_llama, max_num_seqs=8), lambda n: 0.01 + 0.001 * n)
    engine.add_request(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.admission.refusal(50) is None, "decoding alone: room for a 50 ms SLO"
    engine.add_request(" ".join(["t5"] * 450), SamplingParams(max_tokens=4, slo_ttft_ms=550))
    engine.step()
    assert engine.scheduler.last_stats.prefill_tokens >= 40, "the objective sets the chunk"
    why = engine.admission.refusal(50)
    assert why is not None and "slo_tpot_ms 50 cannot be met" in why, why


def test_slo_admission_is_not_fooled_by_a_prompt_that_yields_to_the_slos(tiny_llama) -> None:
    """A long prompt whose TTFT objective is still far rides in the time the streams' SLOs
    leave: its big chunks stretch iterations while nobody tight decodes, but a 50 ms request
    admitted now would shrink them, so it is admitted (refusing it at a tenth of the
    capacity was the measured cost of counting those iterations)."""
    from tests.virtual_time import slow_forwards

    engine = slow_forwards(
        make_engine(tiny_llama, max_num_seqs=8, max_prefill_chunk=100),
        lambda n: 0.01 + 0.001 * n,
    )
    engine.add_request(PROMPT, SamplingParams(max_tokens=64, ignore_eos=True))
    for _ in range(3):
        engine.step()
    engine.add_request(" ".join(["t5"] * 450), SamplingParams(max_tokens=4, slo_ttft_ms=60_000))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.last_stats.prefill_tokens == 100, "big chunks while nobody is tight"
    assert engine.admission.refusal(50) is None, "the chunks would yield to a 50 ms stream"


def test_slo_admission_refuses_a_request_whose_first_token_would_come_too_late(tiny_llama) -> None:
    """Behind a backlog of prompts due before it, a new request's first token would come
    seconds past its objective: refused now (429), not queued; one whose objective leaves
    room, or that arrives once the backlog has drained, is admitted."""
    from tests.virtual_time import slow_forwards

    # Forwards cost 10 ms + 2 ms per token: a 400-token prompt alone takes ~0.8 s, so its
    # default objective is 1 s + 4 x 0.8 s. Twelve of them queued are ~10 s of prefill, all
    # due before a thirteenth that arrives later (prompts are prefilled in deadline order).
    engine = slow_forwards(
        make_engine(tiny_llama, max_num_seqs=16, max_num_batched_tokens=256),
        lambda n: 0.01 + 0.002 * n,
    )
    document = " ".join(["t6"] * 400)
    assert engine.admission.refusal(None, 400) is None, "an idle server serves it at once"
    for _ in range(12):
        engine.add_request(" ".join(["t5"] * 400), SamplingParams(max_tokens=2))
    for _ in range(2):
        engine.step()
    why = engine.admission.refusal(None, 400)
    assert why is not None and "time-to-first-token objective of 4.2 s" in why, why
    assert engine.admission.refusal(None, 400, slo_ttft_ms=60_000) is None, "room in 60 s"
    # The server asks with each request's prompt length, TTFT SLO and the max_tokens it set
    # (its life, over which it pays for prompts prefilled after it; the engine thread runs
    # freely on the virtual clock here, so the backlog drains before the request arrives).
    asked = []
    judge = engine.admission.judge
    engine.admission.judge = lambda *a, **k: asked.append(a[:4]) or judge(*a, **k)
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        r = complete(srv.url, prompt=document, max_tokens=2, slo_ttft_ms=9000)
        assert r.status_code == 200, r.text
    assert asked == [(None, 400, 9000, 2)], asked


def test_slo_admission_prices_a_prompt_by_what_the_prefix_cache_leaves(tiny_llama) -> None:
    """The server tells admission how much of a prompt the prefix cache holds: nothing the
    first time, every full block but the last token's the second (its first token costs only
    the rest; docs/scheduling.md)."""
    engine = make_engine(tiny_llama)
    block = engine.engine.target.cache.block_size
    cached = []
    judge = engine.admission.judge
    engine.admission.judge = lambda *a, **k: cached.append(k["cached_tokens"]) or judge(*a, **k)
    document = " ".join(["t6"] * 100)
    with ThreadServer(build_app(engine, ServerConfig())) as srv:
        for _ in range(2):
            r = complete(srv.url, prompt=document, max_tokens=2)
            assert r.status_code == 200, r.text
    n = r.json()["usage"]["prompt_tokens"]
    assert cached == [0, (n - 1) // block * block], (cached, n)
