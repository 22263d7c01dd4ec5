"""Soak: a long mixed load against a real `adaserve serve`, with the server's resources sampled.

    python -m adaserve.bench.soak [--duration-s 1800] [--interval-s 10] [--clients 6]
        [--out soak.jsonl] [--plot docs/soak.png] [--server-args "--max-num-seqs 8"] [MODEL]

Starts `adaserve serve MODEL` (default: the default model) on a free port, then `--clients`
threads each loop until the deadline over a mix of requests: streamed completions (35%),
non-streamed completions (25%), chats with a TPOT SLO drawn from 50/150/1000 ms or none
(15%), streams the client drops after two chunks (15%) and invalid bodies that must get a
400 (10%). Every `--interval-s` it samples the server process's RSS, open file
descriptors and threads (from /proc) and KV blocks in use and requests running (from
/metrics), one JSON line each; at the end it sends SIGTERM and checks the exit code.
Reports, per resource, the mean of the first quarter after warm-up against the maximum of
the last quarter ("flat": within 10% or a few units), and every unexpected outcome.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how vaccines train the immune system.",
    "List three uses of a binary search tree.",
    "def fibonacci(n):",
    "Summarize the causes of the French Revolution.",
]
SLOS = [50.0, 150.0, 1000.0, None]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_stats(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status if ":" in line)
    return {
        "rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def _client(url: str, deadline: float, seed: int, outcomes: Counter, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=300) as http:
        while time.monotonic() < deadline:
            kind = rng.choices(
                ["stream", "plain", "chat", "drop", "bad"], weights=[35, 25, 15, 15, 10]
            )[0]
            body = {
                "prompt": rng.choice(PROMPTS),
                "max_tokens": rng.randint(8, 64),
                "temperature": rng.choice([0.0, 0.8]),
            }
            try:
                result = _one(http, kind, body, rng)
            except httpx.HTTPError as exc:
                result = f"{kind}: {type(exc).__name__}"
            with lock:
                outcomes[result] += 1


def _one(http: httpx.Client, kind: str, body: dict, rng: random.Random) -> str:
    if kind == "bad":
        r = http.post("/v1/completions", json={**body, "max_tokens": -rng.randint(1, 9)})
        ok = r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        return "bad: 400" if ok else f"bad: unexpected {r.status_code}"
    if kind == "chat":
        msgs = [{"role": "user", "content": body.pop("prompt")}]
        slo = rng.choice(SLOS)
        r = http.post("/v1/chat/completions", json={**body, "messages": msgs, "slo_tpot_ms": slo})
        return f"chat: {r.status_code}"
    if kind == "plain":
        return f"plain: {http.post('/v1/completions', json=body).status_code}"
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        if s.status_code != 200:
            return f"{kind}: {s.status_code}"
        chunks = 0
        for line in s.iter_lines():
            if not line.startswith("data: "):
                continue
            chunks += 1
            if kind == "drop" and chunks >= 2:
                return "drop: dropped"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                return "stream: 200"
        return "stream: ended without [DONE]"


def summarize(samples: list[dict], warmup_s: float) -> dict[str, dict[str, float]]:
    """Per resource: first-quarter mean after warm-up vs last-quarter max, and flat or not."""
    kept = [s for s in samples if s["t_s"] >= warmup_s]
    q = max(1, len(kept) // 4)
    out = {}
    for key, slack in (("rss_mib", 0.10), ("fds", 0.10), ("threads", 0.10), ("kv_used", 0.10)):
        first = [s[key] for s in kept[:q] if s.get(key) is not None]
        last = [s[key] for s in kept[-q:] if s.get(key) is not None]
        if not first or not last:
            continue
        base, peak = sum(first) / len(first), max(last)
        limit = base * (1 + slack) + (0 if key == "rss_mib" else 4)
        if key == "kv_used":  # in use rises and falls with the load: compare with the pool
            limit = max(limit, max(s[key] for s in kept))
        out[key] = {"first_quarter_mean": base, "last_quarter_max": peak, "flat": peak <= limit}
    return out


def plot(samples: list[dict], path: Path) -> None:
    from adaserve.bench.plot import pyplot

    plt = pyplot()

    t = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6), sharex=True)
    for ax, (key, label) in zip(
        axes.flat,
        [
            ("rss_mib", "RSS (MiB)"),
            ("kv_used", "KV blocks in use"),
            ("fds", "open file descriptors"),
            ("threads", "threads"),
        ],
    ):
        ax.plot(t, [s.get(key) for s in samples], marker=".", linewidth=1)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.suptitle("adaserve soak: server resources under a mixed load")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default=None)
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--warmup-s", type=float, default=None, help="default: 10%% of the run")
    ap.add_argument("--clients", type=int, default=6)
    ap.add_argument("--out", default="soak.jsonl")
    ap.add_argument("--plot", default=None)
    ap.add_argument("--server-args", default="", help="extra `adaserve serve` flags, one string")
    a = ap.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "adaserve.cli", "serve"] + ([a.model] if a.model else [])
    cmd += shlex.split(a.server_args) + ["--port", str(port), "--log-level", "warning"]
    log = tempfile.NamedTemporaryFile("w+", prefix="adaserve-soak-", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    started = time.monotonic()
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() - started > 600:
            log.seek(0)
            print(f"server did not start:\n{log.read()[-2000:]}", file=sys.stderr)
            return 1
        time.sleep(0.5)
    t0 = time.monotonic()
    deadline = t0 + a.duration_s
    outcomes: Counter = Counter()
    lock = threading.Lock()
    clients = [
        threading.Thread(target=_client, args=(url, deadline, i, outcomes, lock), daemon=True)
        for i in range(a.clients)
    ]
    for c in clients:
        c.start()
    samples: list[dict] = []
    with open(a.out, "w") as out:
        while time.monotonic() < deadline:
            text = httpx.get(f"{url}/metrics", timeout=30).text
            with lock:
                done = sum(outcomes.values())
            s = {
                "t_s": round(time.monotonic() - t0, 1),
                **_proc_stats(proc.pid),
                "kv_used": _metric(text, "adaserve_kv_blocks_used"),
                "running": _metric(text, "adaserve_num_requests_running"),
                "requests_done": done,
            }
            samples.append(s)
            out.write(json.dumps(s) + "\n")
            out.flush()
            time.sleep(a.interval_s)
    for c in clients:
        c.join(330)
    idle = httpx.get(f"{url}/metrics", timeout=30).text
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(120)
    warm = a.warmup_s if a.warmup_s is not None else 0.1 * a.duration_s
    report = {
        "duration_s": a.duration_s,
        "outcomes": dict(sorted(outcomes.items())),
        "kv_used_after": _metric(idle, "adaserve_kv_blocks_used"),
        "exit_code": code,
        "resources": summarize(samples, warm),
    }
    print(json.dumps(report, indent=2))
    if a.plot:
        plot(samples, Path(a.plot))
    # A 429 is the slo admission's documented answer when the machine is too slow for a
    # request's SLO (or for the SLOs already admitted): expected, not a fault.
    expected = {"stream: 200", "plain: 200", "chat: 200", "drop: dropped", "bad: 400"}
    expected |= {f"{kind}: 429" for kind in ("stream", "plain", "chat", "drop")}
    bad = {k: v for k, v in outcomes.items() if k not in expected}
    flat = all(r["flat"] for r in report["resources"].values())
    return 0 if code == 0 and not bad and flat and report["kv_used_after"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
