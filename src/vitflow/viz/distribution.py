"""The report's class-distribution panel: images per class in each split of a run (imbalanced data),
read from ``RUN_DIR/class_counts.json`` (written by training, see
:func:`vitflow.training.objectives.class_weights.write_distribution`)."""

from __future__ import annotations

import html
import json
from pathlib import Path

from vitflow.data.loader import DISTRIBUTION_FILE

MAX_ROWS = 60  # more classes: the rarest and the most frequent 30 of the training split


def imbalance_ratio(counts: list[int]) -> float | None:
    """Largest over smallest non-zero class count (``None`` without two non-empty classes)."""
    nonzero = [c for c in counts if c > 0]
    return max(nonzero) / min(nonzero) if len(nonzero) > 1 else None


def distribution_panel(run_dir: str | Path) -> str:
    """An HTML section: per class, the image count of each split (train, val, test) with a bar of its
    share of the split, and each split's imbalance ratio (largest / smallest class). Empty text when
    the run has no ``class_counts.json`` (runs of older versions)."""
    path = Path(run_dir) / DISTRIBUTION_FILE
    try:
        d = json.loads(path.read_text())
        classes, splits = d["classes"], d["splits"]
    except (OSError, ValueError, KeyError):
        return ""
    roles = list(splits)
    totals = {r: max(sum(splits[r]["counts"]), 1) for r in roles}
    order = list(range(len(classes)))
    if len(order) > MAX_ROWS and "train" in splits:
        ranked = sorted(order, key=lambda i: splits["train"]["counts"][i])
        order = sorted(ranked[:MAX_ROWS // 2] + ranked[-MAX_ROWS // 2:])
    head = "".join(f"<th>{html.escape(r)}</th><th>share</th>" for r in roles)
    rows = []
    for i in order:
        cells = []
        for r in roles:
            n = splits[r]["counts"][i]
            cells.append(f"<td class=num>{n}</td><td><div class=bar style=\"width:{round(200 * n / totals[r])}px\">"
                         "</div></td>")
        rows.append(f"<tr><td>{html.escape(classes[i])}</td>{''.join(cells)}</tr>")
    ratios = ", ".join(f"{html.escape(r)} {imbalance_ratio(splits[r]['counts']) or 1:.1f}:1 "
                       f"({sum(splits[r]['counts'])} images)" for r in roles)
    shown = "" if len(order) == len(classes) else f" (the {len(order)} rarest and most frequent training classes)"
    return (f"<h2>Class distribution</h2><p>Images per class in each split{shown}; bars: the class's share of "
            f"the split. Imbalance (largest / smallest class): {ratios}.</p>"
            f"<table><tr><th>class</th>{head}</tr>{''.join(rows)}</table>")
