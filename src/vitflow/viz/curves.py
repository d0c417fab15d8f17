"""Curves as PNG files: the learning-rate schedule of a config, and a run's metrics over steps."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from vitflow.config import Config  # noqa: E402


def plot_schedule(cfg: Config, path: str | Path) -> list[tuple[int, float]]:
    """Plot the learning rate of every step of ``cfg``'s schedule (``optim.lr`` times
    :class:`vitflow.train.schedules.Schedule`) over ``train.total_steps`` to a PNG; with
    ``optim.layer_decay`` also the lowest layer's rate. A ``train.time_budget`` refits the
    length at run time: the plot then shows the shape over ``total_steps``.

    Returns:
        ``(step, lr)`` at a few landmarks: 0, the end of warmup, 25/50/75 % and the last step.
    """
    from vitflow.train.schedules import schedule_from_config

    o, total = cfg.optim, cfg.train.total_steps
    fn = schedule_from_config(o, total)
    steps = list(range(total))
    lrs = [o.lr * fn(s) for s in steps]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(steps, lrs, label="head / top layer" if o.layer_decay else "lr")
    if o.layer_decay:
        depth = _depth(cfg)
        low = o.layer_decay ** (depth + 1)
        ax.plot(steps, [lr * low for lr in lrs], label=f"embeddings (x{low:.3g})")
        ax.legend()
    shape = {"step": f"step x{o.gamma:g} at {list(fn.milestone_steps())}",
             "restarts": f"restarts: {o.cycles} cycles, mult {o.cycle_mult:g}, decay {o.cycle_decay:g}"}
    title = f"{o.name}, peak lr {o.lr:g}, warmup {o.warmup_steps}, {shape.get(o.schedule, o.schedule)}"
    if cfg.train.time_budget:
        title += f"\n(train.time_budget={cfg.train.time_budget}: length fitted at run time)"
    ax.set(xlabel="optimizer step", ylabel="learning rate", title=title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    marks = sorted({0, min(o.warmup_steps, total - 1), total // 4, total // 2, 3 * total // 4, total - 1})
    return [(s, lrs[s]) for s in marks]


def _depth(cfg: Config) -> int:
    from vitflow.models import MODELS

    return int(MODELS[cfg.model.name]["depth"])


def _visible(xs: Sequence[float], kw: dict) -> dict:
    return {"marker": "o", **kw} if len(xs) == 1 else kw


def line_plot(path: str | Path, title: str, series: Sequence[tuple[str, Sequence[float], Sequence[float], dict]],
              ylabel: str, logy: bool = False, right: Sequence[tuple[str, Sequence[float], Sequence[float], dict]] = (),
              right_label: str = "") -> Path:
    """One PNG of ``(label, xs, ys, matplotlib kwargs)`` series over optimizer steps, with an
    optional second y axis (``right``). A series of a single point (one evaluation) is drawn as a
    marker, since a line through one point is invisible."""
    fig, ax = plt.subplots(figsize=(7, 3.6))
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)
