"""What the HTTP server costs: streamed output tokens/s and TTFT through `adaserve serve` vs
`LLM.generate` in-process, at 1 and 16 concurrent clients, in one run; prints a markdown table.

    python -m adaserve.bench.http_overhead [MODEL] [--policy incremental] [--max-tokens 64]

Each client sends `--requests-per-client` requests one after another (closed loop). In-process,
the C clients' requests of one round are one `LLM.generate` call (they arrive together, as
over HTTP). TTFT over HTTP is measured by the client: from sending the request to the first
streamed token; in-process it is the engine's arrival-to-first-token time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx
import numpy as np

from adaserve import LLM, SamplingParams
from adaserve.bench.prompts import prompts


@dataclass
class Result:
    mode: str
    clients: int
    requests: int
    output_tokens: int
    wall_s: float
    ttft_s: list[float]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    def row(self) -> str:
        p50, p99 = np.percentile(np.array(self.ttft_s) * 1000, [50, 99])
        return (
            f"| {self.mode} | {self.clients} | {self.requests} | {self.output_tokens} | "
            f"{self.tokens_per_s:.1f} | {p50:.0f} | {p99:.0f} |"
        )


def run_in_process(llm: LLM, clients: int, rounds: int, max_tokens: int) -> Result:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ttft, tokens = [], 0
    start = time.monotonic()
    for r in range(rounds):
        for out in llm.generate(prompts(clients * (r + 1))[clients * r :], params):
            assert out.metrics.ttft_s is not None  # a finished request has had a first token
            ttft.append(out.metrics.ttft_s)
            tokens += len(out.outputs[0].token_ids)
    return Result("LLM.generate", clients, clients * rounds, tokens, time.monotonic() - start, ttft)


async def _stream_one(
    client: httpx.AsyncClient,
    prompt: str,
    max_tokens: int,
) -> tuple[float, int]:
    """(TTFT s, output tokens) of one streamed completion."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    sent, first, tokens = time.monotonic(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            n = len(json.loads(line[6:])["choices"][0].get("token_ids") or ())
            if n and first is None:
                first = time.monotonic()
            tokens += n
    assert first is not None, "stream ended without a token"
    return first - sent, tokens


async def run_http(url: str, clients: int, rounds: int, max_tokens: int) -> Result:
    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one_client(c: int) -> list[tuple[float, int]]:
            return [
                await _stream_one(client, prompts(clients * rounds)[r * clients + c], max_tokens)
                for r in range(rounds)
            ]

        start = time.monotonic()
        per_client = await asyncio.gather(*(one_client(c) for c in range(clients)))
        wall = time.monotonic() - start
    done = [x for results in per_client for x in results]
    return Result(
        "HTTP (stream)",
        clients,
        len(done),
        sum(t for _, t in done),
        wall,
        [ttft for ttft, _ in done],
    )


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "adaserve.cli",
        "serve",
        *([args.model] if args.model else []),
        "--policy",
        args.policy,
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start: {' '.join(cmd)}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", nargs="?", default=None, help="default: SmolLM2-135M-Instruct")
    p.add_argument("--policy", default="incremental")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--concurrency", default="1,16", help="comma-separated client counts")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]

    proc, url = start_server(args)
    try:
        llm = LLM(args.model, policy=args.policy)
        # Warm both paths (first-call allocations, tokenizer caches) outside the measurement.
        run_in_process(llm, 1, 1, 4)
        asyncio.run(run_http(url, 1, 1, 4))
        results = []
        for clients in levels:
            results.append(run_in_process(llm, clients, args.requests_per_client, args.max_tokens))
            results.append(
                asyncio.run(run_http(url, clients, args.requests_per_client, args.max_tokens))
            )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    model = args.model or "SmolLM2-135M-Instruct"
    print(
        f"\n{model}, policy {args.policy}, {args.max_tokens} output tokens per request "
        f"(ignore_eos, greedy), {args.requests_per_client} requests per client\n"
    )
    print(
        "| path | clients | requests | output tokens | output tok/s | TTFT p50 ms | TTFT p99 ms |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(r.row())


if __name__ == "__main__":
    main()
