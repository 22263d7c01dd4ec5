"""What the server writes to its log: timestamped lines, one access line per finished request
(logger `adaserve.api.access`), and a periodic stats line (logger `adaserve.api.stats`).

Both are `key=value` pairs after a fixed word, so `grep` and log pipelines (Loki, Vector) can
split them without a parser of their own.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Awaitable, Callable

from adaserve.api.metrics import FinishedRequest, MetricsSnapshot, snapshot

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

access_logger = logging.getLogger("adaserve.api.access")
stats_logger = logging.getLogger("adaserve.api.stats")


def configure_logging(level: str) -> None:
    """Timestamped lines on stderr for every logger, uvicorn's included (`make_server` lets
    uvicorn's loggers propagate here instead of installing its own handlers)."""
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT)


def _num(value: float | None, digits: int = 1) -> str:
    return "none" if value is None else f"{value:.{digits}f}"


def access_line(request_id: str, r: FinishedRequest) -> str:
    """One finished request: its tokens, latencies, SLO and how it ended."""
    met = "none" if r.slo_attained is None else str(r.slo_attained).lower()
    ttft_ms = None if r.ttft_s is None else 1000.0 * r.ttft_s
    slo = "none" if r.slo_tpot_ms is None else f"{r.slo_tpot_ms:g}"
    return (
        f"request id={request_id} prompt_tokens={r.num_prompt_tokens} "
        f"output_tokens={r.num_output_tokens} ttft_ms={_num(ttft_ms)} "
        f"tpot_ms={_num(r.tpot_ms)} slo_tpot_ms={slo} slo_met={met} "
        f"finish={r.finish_reason}"
    )


def log_finished(request_id: str, r: FinishedRequest) -> None:
    access_logger.info("%s", access_line(request_id, r))


def stats_line(now: MetricsSnapshot, before: MetricsSnapshot, elapsed_s: float) -> str:
    """Engine state now, generation speed since `before`, SLO attainment since start."""
    kv = 100.0 * now.kv_used / now.kv_total if now.kv_total > 0 else 0.0
    tok_s = (now.generated_tokens - before.generated_tokens) / max(elapsed_s, 1e-9)
    judged = now.slo_attained + now.slo_violated
    attainment = f"{100.0 * now.slo_attained / judged:.1f}%" if judged else "none"
    return (
        f"stats running={now.running:.0f} waiting={now.waiting:.0f} kv_usage={kv:.1f}% "
        f"generation_tok_s={tok_s:.1f} slo_attainment={attainment} "
        f"slo_met={now.slo_attained:.0f}/{judged:.0f}"
    )


class StatsLogger:
    """Every `interval_s`, a stats line read from the /metrics exposition (under Ray Serve
    that is every replica's, so the line speaks for the cluster). Quiet while idle."""

    def __init__(
        self, render_metrics: Callable[[], bytes | Awaitable[bytes]], interval_s: float
    ) -> None:
        self.render_metrics = render_metrics
        self.interval_s = interval_s

    async def read(self) -> MetricsSnapshot:
        text = self.render_metrics()
        if inspect.isawaitable(text):
            text = await text
        return snapshot(text)

    async def run(self) -> None:
        before, at = await self.read(), time.monotonic()
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                now, t = await self.read(), time.monotonic()
            except Exception as exc:  # a replica unreachable for a moment: skip this line
                stats_logger.warning("stats unavailable: %s", exc)
                continue
            busy = now.running or now.waiting or now.generated_tokens != before.generated_tokens
            if busy or now.finished != before.finished:
                stats_logger.info("%s", stats_line(now, before, t - at))
            before, at = now, t
