"""Replay prepared requests against an OpenAI-compatible endpoint at their arrival times.

Every request is a streamed POST {url}/v1/completions (temperature 0, ignore_eos, the
request's slo_tpot_ms when it has one); each SSE chunk's arrival time is recorded for every
token it carries. One shared httpx client without a connection cap: a capped pool would
hold requests back in the client and bend the arrival pattern being measured.

With `retries` > 0 the client behaves as the official `openai` client does by default (two
retries): a refused request (408, 409, 429, 5xx) is sent again after the server's
`retry-after-ms` / `Retry-After` (when 0-60 s), else after an exponential backoff. The record
keeps the first send time, so the wait counts in its TTFT, and says how many sends it took.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence

import httpx
from tqdm import tqdm

from adaserve.bench.report import RequestRecord
from adaserve.bench.server_metrics import delta_summary, scrape
from adaserve.bench.trace import BenchRequest

# Seconds a stream may stay silent before the request counts as failed (a CPU server under
# overload can take minutes per request; a hung one must not hang the benchmark forever).
DEFAULT_REQUEST_TIMEOUT_S = 1800.0
CONNECT_TIMEOUT_S = 30.0
# Error texts are kept short in the records; the first words say what happened.
MAX_ERROR_CHARS = 300
# The openai client's retry rules: which statuses it retries, the longest server-given wait it
# honours, and its own backoff when the server gives none (0.5 s doubling, at most 8 s).
RETRIED_STATUSES = frozenset({408, 409, 429})
MAX_RETRY_AFTER_S = 60.0
BACKOFF_START_S = 0.5
BACKOFF_MAX_S = 8.0


def retry_delay_s(headers: httpx.Headers, retries_taken: int) -> float:
    """Seconds to wait before the next send: the server's hint, else the backoff."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        try:
            hint = float(headers.get(name, "")) * scale
        except ValueError:
            continue
        if 0 < hint <= MAX_RETRY_AFTER_S:
            return hint
    return min(BACKOFF_START_S * 2**retries_taken, BACKOFF_MAX_S)


def _retried(status: int) -> bool:
    return status in RETRIED_STATUSES or status >= 500


def request_body(req: BenchRequest, model: str) -> dict:
    """The completion request for one trace request."""
    body: dict = {
        "model": model,
        "prompt": req.trace.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        # Usage gives the exact token count; token_ids (an extension ours and vLLM's
        # servers know) gives it per chunk. Servers that know neither ignore them.
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if req.slo_tpot_ms is not None:
        body["slo_tpot_ms"] = req.slo_tpot_ms
    return body


def _apply_chunk(rec: RequestRecord, obj: dict, now: float) -> None:
    """Fold one streamed JSON chunk into the record."""
    if "error" in obj:
        err = obj["error"]
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
        return
    for choice in obj.get("choices") or []:
        ids = choice.get("token_ids")
        # Without token ids, a chunk with text is one token; usage corrects the total later.
        n = len(ids) if isinstance(ids, list) else (1 if choice.get("text") else 0)
        rec.token_times_s.extend([now] * n)
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
    usage = obj.get("usage")
    if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
        rec.output_tokens = int(usage["completion_tokens"])
        rec.prompt_tokens = usage.get("prompt_tokens")
    info = obj.get("adaserve")
    if isinstance(info, dict) and info.get("tpot_ms") is not None:
        rec.server_tpot_ms = float(info["tpot_ms"])


async def send_one(
    client: httpx.AsyncClient,
    url: str,
    req: BenchRequest,
    model: str,
    rec: RequestRecord,
    t0: float,
    headers: dict[str, str],
    retries: int = 0,
) -> None:
    """Send one streamed request and fill `rec`; never raises (failures go to rec.error).
    A refusal is sent again up to `retries` times (module doc)."""
    rec.sent_s = time.perf_counter() - t0
    for attempt in range(retries + 1):
        rec.attempts = attempt + 1
        rec.error = None
        delay = await _send_once(
            client, f"{url}/v1/completions", request_body(req, model), headers, rec, t0
        )
        if delay is None or attempt == retries:
            return
        await asyncio.sleep(delay)


async def _send_once(
    client: httpx.AsyncClient,
    endpoint: str,
    body: dict,
    headers: dict[str, str],
    rec: RequestRecord,
    t0: float,
) -> float | None:
    """One send; the seconds to wait before sending again when the server refused it
    in a way a client retries, else None."""
    usage_seen = False
    retry_in: float | None = None
    try:
        async with client.stream("POST", endpoint, json=body, headers=headers) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                rec.error = f"HTTP {r.status_code}: {_error_message(text)}"
                if _retried(r.status_code):
                    retry_in = retry_delay_s(r.headers, rec.attempts - 1)
                return retry_in
            rec.best_effort = r.headers.get("x-slo-admission") == "best-effort"
            done = False
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    done = True
                    break
                obj = json.loads(payload)
                if not isinstance(obj, dict):
                    rec.error = f"unexpected stream data: {payload[:80]}"
                    return None
                _apply_chunk(rec, obj, time.perf_counter() - t0)
                usage_seen = usage_seen or bool(obj.get("usage"))
                if rec.error is not None:
                    return None
            if not done:
                rec.error = "the stream ended before data: [DONE]"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
    finally:
        rec.end_s = time.perf_counter() - t0
        if not usage_seen:
            rec.output_tokens = len(rec.token_times_s)
        if rec.error is not None:
            rec.error = rec.error[:MAX_ERROR_CHARS]
    return None


def _error_message(text: str) -> str:
    try:
        err = json.loads(text).get("error", {})
        return str(err.get("message", text) if isinstance(err, dict) else err)
    except (ValueError, AttributeError):
        return text.strip()[:MAX_ERROR_CHARS]


async def discover_model(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> str:
    """The first model GET /v1/models lists; says what to do when there is no server."""
    try:
        r = await client.get(f"{url}/v1/models", headers=headers, timeout=CONNECT_TIMEOUT_S)
        r.raise_for_status()
        return str(r.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(
            f"could not list the models of {url} ({type(exc).__name__}: {exc}); is an "
            "OpenAI-compatible server running there? (or pass --model NAME)"
        ) from None


def new_records(
    reqs: Sequence[BenchRequest], prefill_ms_per_token: float | None = None
) -> list[RequestRecord]:
    """Empty records; `prefill_ms_per_token` (the machine's) sets default TTFT objectives."""
    return [
        RequestRecord(
            index=r.trace.index,
            slo_category=r.slo_category,
            slo_tpot_ms=r.slo_tpot_ms,
            max_tokens=r.max_tokens,
            scheduled_s=r.send_time_s,
            prefill_ms_per_token=prefill_ms_per_token,
        )
        for r in reqs
    ]


async def measure_prefill_ms_per_token(
    client: httpx.AsyncClient, url: str, model: str, prompt: str, headers: dict[str, str]
) -> float:
    """The server's prefill speed alone: a one-token completion of `prompt`, timed end to end
    over its prompt tokens (best of two; the first also warms the server up). Each try starts
    with its own line, so no server can answer the second from the first's cached prompt."""
    best = float("inf")
    for i in range(2):
        body = {"model": model, "prompt": f"{i}: {prompt}", "max_tokens": 1, "temperature": 0}
        start = time.perf_counter()
        r = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        r.raise_for_status()
        elapsed_ms = 1000.0 * (time.perf_counter() - start)
        tokens = int(r.json()["usage"]["prompt_tokens"])
        best = min(best, elapsed_ms / max(1, tokens))
    return best


async def replay(
    url: str,
    reqs: Sequence[BenchRequest],
    model: str | None = None,
    *,
    api_key: str | None = None,
    timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
    progress: bool = True,
    desc: str = "replay",
    transport: httpx.AsyncBaseTransport | None = None,
    prefill_ms_per_token: float | None = None,
    measure_prefill: str | None = None,
    retries: int = 0,
) -> tuple[str, list[RequestRecord], dict | None]:
    """(model, one record per request in send order, server counter deltas or None).

    `prefill_ms_per_token` gives the records default TTFT objectives; without it, a
    `measure_prefill` prompt measures the speed on this server first (before the replay).
    `transport` replaces the network (tests hand in an httpx.MockTransport); `retries`: how
    many times a refused request is sent again (module doc).
    """
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:
        model = model or await discover_model(client, url, headers)
        if prefill_ms_per_token is None and measure_prefill is not None:
            prefill_ms_per_token = await measure_prefill_ms_per_token(
                client, url, model, measure_prefill, headers
            )
        records = new_records(reqs, prefill_ms_per_token)
        before = await scrape(client, url)
        bar = tqdm(total=len(reqs), desc=desc, unit="req", disable=not progress, leave=False)
        attained = 0

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            nonlocal attained
            await send_one(client, url, req, model, rec, t0, headers, retries)
            attained += rec.slo_attained
            bar.set_postfix(attained=f"{attained}/{bar.n + 1}", refresh=False)
            bar.update()

        t0 = time.perf_counter()
        tasks = []
        for req, rec in zip(reqs, records):
            delay = t0 + req.send_time_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, rec)))
        await asyncio.gather(*tasks)
        bar.close()
        after = await scrape(client, url)
    return model, records, delta_summary(before, after)
