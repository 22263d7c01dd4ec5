"""Plot an iteration timeline (`adaserve serve --record-iterations FILE`): per iteration, the
forward's tokens by kind (roots, tree nodes, prompt chunks), its measured and predicted
forward time, and host and draft time, so where the time goes is seen, not guessed.

    python -m adaserve.bench.timeline iterations.jsonl --out timeline.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

from adaserve.bench.report import load_results


def summarize_timeline(rows: list[dict]) -> dict[str, float]:
    """Medians and shares over the recorded iterations (what the plot's title says)."""
    if not rows:
        raise ValueError("the timeline has no iterations")
    total = sum(r["total_s"] for r in rows)
    host = sum(r["host_s"] or 0.0 for r in rows)
    errors = [
        r["forward_s"] / r["predicted_forward_s"] - 1.0 for r in rows if r["predicted_forward_s"]
    ]
    return {
        "iterations": len(rows),
        "forward_ms_p50": 1000 * statistics.median(r["forward_s"] for r in rows),
        "host_share": host / max(total + host, 1e-12),
        "prediction_error_p50": statistics.median(errors) if errors else float("nan"),
        "prompt_tokens": sum(sum(r["prompt_tokens"].values()) for r in rows),
        "behind_pace_iterations": sum(1 for r in rows if r["behind_pace"]),
    }


def plot_timeline(rows: list[dict], out: str | Path, title: str | None = None) -> Path:
    from adaserve.bench.plot import pyplot

    plt = pyplot()

    t = [r["t"] - rows[0]["t"] for r in rows]
    roots = [r["decode_rows"] for r in rows]
    tree = [r["tree_tokens"] for r in rows]
    prompt = [sum(r["prompt_tokens"].values()) for r in rows]
    fig, (ax_tok, ax_ms) = plt.subplots(2, 1, figsize=(11, 6), sharex=True)
    ax_tok.stackplot(t, roots, tree, prompt, labels=["roots", "tree nodes", "prompt chunks"])
    ax_tok.set_ylabel("tokens in the forward")
    ax_tok.legend(loc="upper right", fontsize=8)
    ax_ms.plot(t, [1000 * r["forward_s"] for r in rows], lw=0.8, label="forward (measured)")
    predicted = [(x, 1000 * r["predicted_forward_s"]) for x, r in zip(t, rows)]
    predicted = [(x, y) for x, (_, y) in zip(t, predicted) if y]
    if predicted:
        ax_ms.plot(*zip(*predicted), lw=0.8, ls="--", label="forward (predicted)")
    ax_ms.plot(t, [1000 * (r["host_s"] or 0.0) for r in rows], lw=0.8, label="host")
    ax_ms.plot(t, [1000 * r["draft_s"] for r in rows], lw=0.8, label="draft")
    late = [x for x, r in zip(t, rows) if r["behind_pace"]]
    if late:
        ax_ms.plot(late, [0] * len(late), "|", color="red", label="a stream behind its pace")
    ax_ms.set_xlabel("seconds")
    ax_ms.set_ylabel("ms")
    ax_ms.legend(loc="upper right", fontsize=8)
    s = summarize_timeline(rows)
    fig.suptitle(
        title
        or f"{s['iterations']} iterations, forward p50 {s['forward_ms_p50']:.1f} ms, "
        f"host {100 * s['host_share']:.1f}% of the time, forward vs prediction p50 "
        f"{100 * s['prediction_error_p50']:+.1f}%"
    )
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.timeline", description=__doc__)
    p.add_argument("timeline", help="JSONL from --record-iterations")
    p.add_argument("--out", default="timeline.png", help="PNG to write")
    a = p.parse_args(argv)
    rows = load_results(a.timeline)
    print(summarize_timeline(rows))
    print(f"wrote {plot_timeline(rows, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
