"""The resolution plot of ``vitflow bench resolution``: top-1 and images/s against the input size."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure  # no pyplot, as vitflow.viz.curves

COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def _label(result: dict) -> str:
    """The run directory's name (or the checkpoint file's) and the trained size."""
    p = Path(result["checkpoint"])
    name = p.parent.parent.name if p.parent.name == "checkpoints" else p.stem
    return f"{name} (trained at {result['trained_size']} px)"


def plot_resolution(results: Sequence[dict], path: str | Path, title: str | None = None) -> Path:
    """One PNG of :func:`vitflow.infer.bench.resolution.bench_resolution` results: top-1 (%, solid lines,
    left axis) and images/s (dashed lines, right axis) against the input size in pixels, one colour
    per checkpoint, a dotted vertical line at each checkpoint's trained size and a marker on its
    row. Returns ``path``.

    Raises:
        ValueError: no result with a measured row.
    """
    results = [r for r in results if r["rows"]]
    if not results:
        raise ValueError("no measured sizes to plot")
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    ax2 = ax.twinx()
    for color, r in zip(COLORS * len(results), results):
        sizes = [row["size"] for row in r["rows"]]
        ax.plot(sizes, [row["top1"] * 100 for row in r["rows"]], "o-", color=color, label=f"top-1, {_label(r)}")
        ax2.plot(sizes, [row["images_per_s"] for row in r["rows"]], "s--", color=color, alpha=0.6, markersize=4,
                 label=f"images/s, {_label(r)}")
        ax.axvline(r["trained_size"], color=color, linestyle=":", alpha=0.7)
        own = [row for row in r["rows"] if row["size"] == r["trained_size"]]
        if own:
            ax.plot([own[0]["size"]], [own[0]["top1"] * 100], "*", color=color, markersize=13)
    first = results[0]
    ax.set(xlabel="input size (pixels, square)", ylabel=f"top-1 on {first['split_expr']} (%)",
           title=title or f"{first['model']}: accuracy and speed against input size")
    ax2.set_ylabel(f"images/s (batch {first['batch_size']}, {first['device']}, {first['precision']})")
    ax2.set_ylim(bottom=0)
    ax.set_xticks(sorted({row["size"] for r in results for row in r["rows"]}))
    ax.grid(alpha=0.3)
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, loc="best", fontsize=7, framealpha=0.85)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return Path(path)
