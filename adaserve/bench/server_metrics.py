"""Speculation counters read from a server's Prometheus `/metrics`, before and after a replay.

The names are those `adaserve/api/metrics.py` defines (a test checks they still do). Other
servers may expose none of them, or the same vLLM-style `spec_decode_*` counters under another
prefix (`vllm:`): every value is matched by its suffix and is None when absent, never an error.
"""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

# Sample names as exposed (a Counter named `x` is exposed as `x_total`).
ACCEPTED_TOKENS = "adaserve_spec_decode_num_accepted_tokens_total"
DRAFT_TOKENS = "adaserve_spec_decode_num_draft_tokens_total"
DRAFTS = "adaserve_spec_decode_num_drafts_total"
ITERATIONS = "adaserve_iterations_total"  # label kind = prefill | decode
DECODE_KIND = "decode"
HOST_SECONDS = "adaserve_iteration_host_seconds"  # histogram, label kind

# Suffixes shared with vLLM's names, so its counters are found too.
_SUFFIXES = {
    "accepted_tokens": "spec_decode_num_accepted_tokens_total",
    "draft_tokens": "spec_decode_num_draft_tokens_total",
    "drafts": "spec_decode_num_drafts_total",
}


def parse_counters(text: str) -> dict[str, float]:
    """The speculation counters and the decode-iteration count found in exposition text."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == ITERATIONS and s.labels.get("kind") == DECODE_KIND:
                found["decode_iterations"] = found.get("decode_iterations", 0.0) + s.value
                continue
            if s.name in (f"{HOST_SECONDS}_sum", f"{HOST_SECONDS}_count"):
                key = "host_seconds" if s.name.endswith("_sum") else "host_iterations"
                found[key] = found.get(key, 0.0) + s.value
                continue
            for key, suffix in _SUFFIXES.items():
                # Exact name first; a foreign prefix only if ours is absent.
                if s.name == f"adaserve_{suffix}" or (s.name.endswith(suffix) and key not in found):
                    found[key] = s.value
    return found


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float] | None:
    """Counters from GET {url}/metrics; None when the server has no such endpoint."""
    try:
        r = await client.get(f"{url}/metrics", timeout=10.0)
        if r.status_code != 200:
            return None
        return parse_counters(r.text)
    except (httpx.HTTPError, ValueError):
        return None


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def delta_summary(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float | None] | None:
    """What the replay added to the counters, and the means derived from them."""
    if before is None or after is None:
        return None
    keys = (
        "decode_iterations",
        "accepted_tokens",
        "draft_tokens",
        "drafts",
        "host_seconds",
        "host_iterations",
    )
    d = {k: (after[k] - before.get(k, 0.0)) if k in after else None for k in keys}
    return {
        **d,
        # Speculated tokens accepted per decode iteration, summed over the batch.
        "mean_accepted_tokens_per_iteration": _ratio(d["accepted_tokens"], d["decode_iterations"]),
        # Per request and iteration; +1 (the bonus token) gives tokens emitted per step.
        "mean_accepted_tokens_per_request_step": _ratio(d["accepted_tokens"], d["drafts"]),
        "acceptance_rate": _ratio(d["accepted_tokens"], d["draft_tokens"]),
        # Wall time per iteration outside model forwards (what `adaserve simulate
        # --host-overhead-ms` adds to simulate this server), in ms.
        "mean_host_overhead_ms": _ratio(
            None if d["host_seconds"] is None else 1000.0 * d["host_seconds"],
            d["host_iterations"],
        ),
    }
