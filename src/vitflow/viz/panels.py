"""Small report panels: the run's status line (running / finished / interrupted), the race of a
planned run (what each candidate reached, the winner and why), the data fixes it trained with, the attention maps of one of the
run's held-out sample images, labelled with what they show, and the samples themselves with what
the newest checkpoint predicts for them."""

from __future__ import annotations

import base64
import html
import json
import logging
from pathlib import Path
from typing import Any

from vitflow.rundir import RACE

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


def race_panel(run: Path) -> str:
    """An HTML section: each candidate of the run's race with its validation top-1 (and 95%
    interval), steps and training seconds after each rung, then the winner and why; empty text for
    a run without a race."""
    try:
        r = json.loads((Path(run) / RACE).read_text())
    except (OSError, ValueError):
        return ""
    rungs = max(len(v) for v in r["candidates"].values())
    head = "".join(f"<th>rung {k + 1}</th>" for k in range(rungs))
    rows = []
    for name, done in r["candidates"].items():
        cells = "".join(f"<td>dropped: {html.escape(x['error'])}</td>" if "error" in x else
                        f"<td>{100 * x['top1']:.1f}% [{100 * x['top1_ci95'][0]:.1f}-{100 * x['top1_ci95'][1]:.1f}]"
                        f"<br><span class=sub>{x['steps']} steps, {x['seconds']:.0f} s</span></td>" for x in done)
        mark = " (winner)" if name == r["winner"] else ""
        rows.append(f"<tr><td>{html.escape(name)}{mark}</td>{cells}{'<td>-</td>' * (rungs - len(done))}</tr>")
    return (f"<h2>Race</h2><p>Candidates trained on this data and halved by validation top-1 in "
            f"{r['race_s']:.0f} s of the {r['budget_s']:.0f} s budget: {html.escape(r['why'])}.</p>"
            f"<table><tr><th>model</th>{head}</tr>{''.join(rows)}</table>")


def fixes_panel(run: Path) -> str:
    """An HTML section naming the fix files the run trained with (``data.exclude``, ``data.relabel``,
    as ``vitflow inspect`` writes them) and how many images each lists; empty text without them."""
    import yaml

    from vitflow.data.fixes import read_exclude, read_relabel
    from vitflow.data.sources.base import DataError

    try:
        data = (yaml.safe_load((Path(run) / "config.yaml").read_text()) or {}).get("data") or {}
    except (OSError, ValueError, yaml.YAMLError):
        return ""
    items = []
    for key, what, read in (("exclude", "listed to drop", read_exclude), ("relabel", "listed to relabel", read_relabel)):
        if data.get(key):
            try:
                count = f"{len(read(data[key]))} image(s) {what}"
            except DataError:
                count = "the file is no longer there or cannot be read"
            items.append(f"<li><code>data.{key}={html.escape(str(data[key]))}</code>: {count} in every split</li>")
    return f"<h2>Data fixes</h2><ul>{''.join(items)}</ul>" if items else ""


def attention_panel(run: Path, out: Path, checkpoint: str | Path | None = None) -> str:
    """The attention maps (per head of the last block, and the rollout) of ``checkpoint`` (default:
    the run's newest) on the first image of ``RUN_DIR/samples``, as an HTML section whose heading says
    whether they are class-token attention or the mean attention over patch tokens
    (:func:`vitflow.infer.features.attention.attention_kind`); empty when the run has no samples or
    checkpoint yet, or the maps cannot be drawn (logged)."""
    samples = sample_files(run)
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


def sample_files(run: Path) -> list[Path]:
    """The run's held-out sample images (``RUN_DIR/samples``, ``NN_<class>.EXT``), sorted."""
    folder = run / "samples"
    return sorted(p for p in folder.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES) if folder.is_dir() else []


def samples_panel(run: Path, checkpoint: str | Path | None = None, predict: bool = True) -> str:
    """The held-out samples as thumbnails, each with its class (from its name) and, with
    ``predict`` once the run has a checkpoint, the class ``checkpoint`` (default: the newest)
    predicts and its probability; empty without samples. A checkpoint that cannot be read leaves
    the predictions out (logged)."""
    samples = sample_files(run)
    if not samples:
        return ""
    has_checkpoint = any((run / "checkpoints").glob("*.pt"))
    predicted = _predictions(checkpoint or run, samples) if predict and has_checkpoint else {}
    cells = []
    for p in samples:
        truth = p.stem.split("_", 1)[-1]
        data = base64.b64encode(p.read_bytes()).decode("ascii")
        mime = "png" if p.suffix.lower() == ".png" else "jpeg" if p.suffix.lower() in (".jpg", ".jpeg") else "webp"
        guess = predicted.get(p.name)
        mark = "" if guess is None else (f"<br>predicted <b>{html.escape(guess[0])}</b> ({guess[1]:.0%})"
                                        f"{' &#10003;' if guess[0] == truth else ' &#10007;'}")
        cells.append(f'<figure><img alt="{html.escape(p.name)}" src="data:image/{mime};base64,{data}">'
                     f"<figcaption>{html.escape(truth)}{mark}</figcaption></figure>")
    return (f"<h2>Held-out samples ({len(samples)} images of RUN_DIR/samples)</h2><div class=samples>{''.join(cells)}"
            "</div><p class=note>True class from the file name; "
            + ("predictions of the newest checkpoint" if predicted else "the newest checkpoint's predictions and "
               "attention maps are drawn by the report written at the end, or by <code>vitflow report RUN_DIR</code>")
            + "; try <code>vitflow predict RUN_DIR RUN_DIR/samples</code>.</p>")


def _predictions(checkpoint: str | Path, samples: list[Path]) -> dict[str, tuple[str, float]]:
    """``{sample file name: (class, probability)}`` of ``checkpoint``'s top prediction, or ``{}`` (logged)."""
    from vitflow.infer import Predictor
    from vitflow.infer.predict import collect_images

    try:
        predictor = Predictor.from_checkpoint(checkpoint, device="cpu", precision="fp32")
        rows = predictor.predict_refs(collect_images([str(p) for p in samples]), topk=1)
    except (ValueError, RuntimeError, FileNotFoundError, KeyError) as e:
        log.info("report: no sample predictions (%s)", e)
        return {}
    return {Path(r["path"]).name: (r["top"][0]["class"], r["top"][0]["prob"]) for r in rows if r.get("top")}
