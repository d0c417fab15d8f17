"""Report panels of a single-label evaluation (``eval.json``): the per-class precision / recall /
F1 / support table with macro and weighted averages, and the reliability diagram of the
calibration bins (Guo et al. 2017, fig. 1: accuracy per confidence bin against the diagonal)."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # no pyplot: any backend, and a notebook's own backend left as it is


def plot_reliability(reliability: dict[str, Any], ece: float, path: str | Path, title: str = "") -> Path:
    """A reliability diagram as a PNG: per equal-width confidence bin, the fraction correct (bars)
    and the gap to the mean confidence (red), the diagonal of perfect calibration, and the image
    count per bin below. Returns ``path``.

    Args:
        reliability: ``{"bins": M + 1 edges, "accuracy": M values or None, "confidence": ...,
            "count": M ints}`` (:func:`vitflow.metrics.classification.calibration`).
        ece: the expected calibration error, shown in the title.
    """
    edges, acc, conf, count = (reliability[k] for k in ("bins", "accuracy", "confidence", "count"))
    width = edges[1] - edges[0]
    lefts = edges[:-1]
    fig = Figure(figsize=(5.2, 5.6), dpi=100)
    ax, low = fig.add_gridspec(2, 1, height_ratios=(3, 1)).subplots(sharex=True)
    filled = [i for i, a in enumerate(acc) if a is not None]
    ax.bar([lefts[i] for i in filled], [acc[i] for i in filled], width=width, align="edge", color="#1f77b4",
           edgecolor="black", label="accuracy (fraction correct)")
    ax.bar([lefts[i] for i in filled], [conf[i] - acc[i] for i in filled], bottom=[acc[i] for i in filled],
           width=width, align="edge", color="tab:red", alpha=0.35, label="gap to mean confidence")
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy",
           title=title or f"reliability diagram: ECE {ece:.4f} ({len(count)} bins)")
    ax.legend(loc="upper left", fontsize=8)
    low.bar(lefts, count, width=width, align="edge", color="gray", edgecolor="black")
    low.set(xlabel="confidence (largest softmax probability)", ylabel="images")
    fig.tight_layout()
    fig.savefig(path)
    return Path(path)


def prf_table(ev: dict[str, Any]) -> str:
    """The per-class precision / recall / F1 / support table of ``ev`` (an ``eval.json``) with
    its macro and weighted averages and the balanced accuracy, as HTML."""
    rows = []
    for i, name in enumerate(ev["classes"]):
        rows.append(f"<tr><td>{html.escape(str(name))}</td><td class=num>{ev['precision'][i]:.1%}</td>"
                    f"<td class=num>{ev['recall'][i]:.1%}</td><td class=num>{ev['f1'][i]:.1%}</td>"
                    f"<td class=num>{ev['support'][i]}</td></tr>")
    total = sum(ev["support"])
    for avg in ("macro", "weighted"):
        rows.append(f"<tr><th>{avg} average</th><td class=num>{ev[f'{avg}_precision']:.1%}</td>"
                    f"<td class=num>{ev[f'{avg}_recall']:.1%}</td><td class=num>{ev[f'{avg}_f1']:.1%}</td>"
                    f"<td class=num>{total}</td></tr>")
    return ("<table><tr><th>class</th><th>precision</th><th>recall</th><th>F1</th><th>support</th></tr>"
            + "".join(rows) + "</table>"
            f"<p>Balanced accuracy (mean recall over the classes present) {ev['balanced_accuracy']:.2%}. "
            "Precision: correct / predicted as the class; recall: correct / images of the class; "
            "support: images of the class; 0 where nothing was predicted or present.</p>")


def calibration_html(ev: dict[str, Any], out: Path) -> str:
    """The reliability diagram of ``ev`` written to ``out/reliability.png``, as an HTML section
    with the PNG embedded; empty for an evaluation without calibration bins (multi-label)."""
    import base64

    if "reliability" not in ev:
        return ""
    out.mkdir(parents=True, exist_ok=True)
    png = plot_reliability(ev["reliability"], ev["ece"], out / "reliability.png")
    data = base64.b64encode(png.read_bytes()).decode("ascii")
    return (f"<h3>Calibration: expected calibration error {ev['ece']:.4f}</h3>"
            f'<img alt="reliability diagram" style="max-width:520px" src="data:image/png;base64,{data}">'
            "<p class=note>Reliability diagram (Guo et al. 2017): images grouped by their confidence into "
            f"{len(ev['reliability']['count'])} equal-width bins; bars: the fraction correct per bin; the "
            "dashed diagonal is perfect calibration; ECE = the image-weighted mean |accuracy - confidence|.</p>")
