"""SLO attainment and goodput vs request rate, one line per policy (the paper's Figures 4-5).

    python -m adaserve.bench.plot bench-results.jsonl --out figure.png

Reads result lines written by `adaserve bench` / `adaserve bench sweep`. When a label was run
at the same RPS more than once, the latest run counts.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from adaserve.bench.report import load_results

# A point per (label, RPS): the x of a result, or None when the run has no rate.
Point = tuple[float, dict]


def pyplot():
    """matplotlib's pyplot drawing to files only (no display assumed); a clear error when the
    `plot` extra is not installed."""
    try:
        import matplotlib
    except ImportError as exc:
        raise ImportError(
            "figures need matplotlib: pip install 'adaserve[plot]' (or leave out --plot)"
        ) from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series(results: Sequence[dict]) -> dict[str, list[Point]]:
    """Per label, its results sorted by RPS (the last result per RPS wins)."""
    by_label: dict[str, dict[float, dict]] = {}
    for r in results:
        if r.get("rps") is None:
            continue
        by_label.setdefault(str(r.get("label")), {})[float(r["rps"])] = r
    return {label: sorted(points.items()) for label, points in sorted(by_label.items())}


def plot_results(results: Sequence[dict], out: str | Path, title: str | None = None) -> Path:
    """Draw the two panels to a PNG; returns its path."""
    plt = pyplot()

    data = series(results)
    if not data:
        raise ValueError("no result with an RPS to plot")
    fig, (ax_att, ax_good) = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for label, points in data.items():
        xs = [x for x, _ in points]
        att = [100 * (r["slo_attainment"] or 0.0) for _, r in points]
        good = [r["goodput_tok_s"] or 0.0 for _, r in points]
        ax_att.plot(xs, att, marker="o", label=label)
        ax_good.plot(xs, good, marker="o", label=label)
    ax_att.set(xlabel="requests per second", ylabel="SLO attainment (%)", ylim=(0, 102))
    ax_good.set(xlabel="requests per second", ylabel="goodput (tokens/s)")
    ax_good.set_ylim(bottom=0)
    for ax in (ax_att, ax_good):
        ax.grid(True, alpha=0.3)
    ax_att.legend(fontsize="small")
    notes = sorted({n for r in results for n in r.get("notes", []) if "rescaled" not in n})
    fig.suptitle(title or _default_title(results), fontsize="medium")
    if notes:
        # The shrinking options change what the numbers mean: keep them on the figure.
        fig.text(0.01, -0.02, "; ".join(notes), fontsize="x-small", va="top", wrap=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return out


def _default_title(results: Sequence[dict]) -> str:
    models = sorted({str(r.get("model")) for r in results})
    traces = sorted({Path(str(r.get("trace"))).name for r in results})
    return f"{', '.join(models)} — {', '.join(traces)}"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", help="results file (JSON lines) from adaserve bench")
    p.add_argument("--out", default="bench-results.png", help="PNG to write")
    p.add_argument("--title", default=None, help="figure title (default: model and trace)")


def run(args: argparse.Namespace) -> int:
    path = plot_results(load_results(args.results), args.out, args.title)
    print(f"wrote {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m adaserve.bench.plot", description=__doc__)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
