"""Small report panels: the run's status line (running / finished / interrupted) and the
attention maps of one of the run's sample images, labelled with what they show."""

from __future__ import annotations

import base64
import html
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


def status_line(final: dict[str, Any]) -> str:
    """One HTML line saying whether the page shows a finished run or the run so far."""
    status = final.get("status")
    if status is None:
        return "<p class=sub>Finished run.</p>"
    step = final.get("step")
    what = ("Run in progress (or stopped without a summary)" if status == "incomplete" else f"Run {status}")
    return (f"<p class=sub><b>{html.escape(what)}</b>: figures so far, up to step {step}. This page is rewritten "
            "after every evaluation; refresh to update.</p>")


def attention_panel(run: Path, out: Path, checkpoint: str | Path | None = None) -> str:
    """The attention maps (per head of the last block, and the rollout) of ``checkpoint`` (default:
    the run's newest) on the first image of ``RUN_DIR/samples``, as an HTML section whose heading says
    whether they are class-token attention or the mean attention over patch tokens
    (:func:`vitflow.viz.attention.attention_kind`); empty when the run has no samples or
    checkpoint yet, or the maps cannot be drawn (logged)."""
    samples = sorted(p for p in (run / "samples").rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES) \
        if (run / "samples").is_dir() else []
    if not samples or not any((run / "checkpoints").glob("step-*.pt")):
        return ""
    from vitflow.viz.attention import attention_figure

    try:
        r = attention_figure(checkpoint or run, samples[0], out / "attention.png")
    except (ValueError, RuntimeError, AttributeError, FileNotFoundError) as e:
        log.info("report: no attention panel (%s)", e)
        return ""
    data = base64.b64encode(Path(r["output"]).read_bytes()).decode("ascii")
    which = f"checkpoint {Path(checkpoint).name}" if checkpoint else "the newest checkpoint"
    return (f"<h2>Attention maps: {html.escape(r['maps'])}</h2>"
            f"<p class=note>{html.escape(which)}; {html.escape(Path(r['image']).name)}, predicted {html.escape(r['class'])} "
            f"({r['prob']:.1%}); each head of block {r['layer']} and the rollout over all blocks, showing the "
            f"{html.escape(r['maps'])} to each patch.</p>"
            f'<img alt="attention maps" style="max-width:100%" src="data:image/png;base64,{data}">')
