"""Curves as PNG files: a learning-rate schedule, and a run's metrics over steps."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from matplotlib.figure import Figure  # no pyplot: any backend, and a notebook's own backend left as it is


def plot_schedule(lrs: Sequence[float], path: str | Path, title: str, lowest_scale: float | None = None) -> Path:
    """Plot a learning rate per optimizer step (``lrs``) to a PNG; with ``lowest_scale`` (layer-wise
    decay) also the embeddings' rate, ``lowest_scale`` times it. See
    :func:`vitflow.training.optim.schedules.lr_curve` for the values. Returns ``path``."""
    steps = list(range(len(lrs)))
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    ax.plot(steps, lrs, label="head / top layer" if lowest_scale else "lr")
    if lowest_scale:
        ax.plot(steps, [lr * lowest_scale for lr in lrs], label=f"embeddings (x{lowest_scale:.3g})")
        ax.legend()
    ax.set(xlabel="optimizer step", ylabel="learning rate", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return Path(path)


def _visible(xs: Sequence[float], kw: dict) -> dict:
    return {"marker": "o", **kw} if len(xs) == 1 else kw


def line_plot(path: str | Path, title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float], dict]],
              ylabel: str, logy: bool = False, right: Sequence[tuple[str, Sequence[float], Sequence[float], dict]] = (),
              right_label: str = "", note: str = "") -> Path:
    """One PNG of ``(label, xs, ys, matplotlib kwargs)`` series over optimizer steps, with an
    optional second y axis (``right``). A series of a single point (one evaluation) is drawn as a
    marker, since a line through one point is invisible; ``note`` is written inside the axes (e.g.
    "1 evaluation so far")."""
    fig = Figure(figsize=(7, 3.6))
    ax = fig.add_subplot()
    for label, xs, ys, kw in series:
        ax.plot(xs, ys, label=label, **_visible(xs, kw))
    if logy:
        ax.set_yscale("log")
    ax.set(xlabel="step", ylabel=ylabel, title=title)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if right:
        ax2 = ax.twinx()
        for label, xs, ys, kw in right:
            ax2.plot(xs, ys, label=label, **_visible(xs, kw))
        ax2.set_ylabel(right_label)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="best", fontsize=8)
    if note:
        ax.text(0.5, 0.08, note, transform=ax.transAxes, ha="center", fontsize=10, color="dimgray")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    return Path(path)
