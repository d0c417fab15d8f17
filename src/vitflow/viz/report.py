"""``vitflow report RUN_DIR``: a run's curves as PNG files and one self-contained HTML page.

Reads what a run writes (``metrics.jsonl``, ``config.yaml``, ``eval.json``, ``samples/``) and what
``vitflow eval`` recorded of its checkpoints (``evals/``), and writes::

    RUN_DIR/report/loss.png         the training batches' loss (and the evaluated split's loss at each
                                    evaluation, labelled val or test), grad norm
    RUN_DIR/report/accuracy.png     top-1 / top-5 (top-5 only with 6 classes or more; multi-label: mAP /
                                    micro-F1; and the EMA's) at each evaluation of the split evaluated
                                    during training (val, else test); before the first evaluation the
                                    page says instead when it comes (step, minutes)
    RUN_DIR/report/lr.png           learning rate per logged step
    RUN_DIR/report/throughput.png   training images/s and the data-stall fraction
    RUN_DIR/report/reliability.png  the reliability diagram of the last evaluation (single-label)
    RUN_DIR/report.html             the PNGs embedded as base64, the final metrics (or, during a
                                    run, the metrics so far), the last evaluation's (the run's, or
                                    a later ``vitflow eval``'s) per-class precision / recall / F1,
                                    calibration, per-class top-1 and confusion matrix, the
                                    ``vitflow eval`` results, the held-out samples with the newest
                                    checkpoint's predictions and the attention maps of one, and
                                    the config: one file, no external resources, replaced
                                    atomically (training rewrites it at its first records and after
                                    every evaluation: ``train.live_report``)

A resumed run's records are merged by step (the latest record of a step wins).
"""

from __future__ import annotations

import base64
import datetime as dt
import html
import json
import os
import re
from pathlib import Path
from typing import Any

from vitflow.metrics import headline, headline_metrics, interval_names, split_metric, summary_names, task_of
from vitflow.metrics.table import CI
from vitflow.rundir import read_eval_records, read_metrics
from vitflow.viz.classmetrics import calibration_html, prf_table
from vitflow.viz.curves import line_plot
from vitflow.viz.distribution import distribution_panel
from vitflow.viz.panels import attention_panel, fixes_panel, race_panel, samples_panel, status_line
from vitflow.viz.progress import later_evaluations, newest_evaluation, pending_evaluation

MAX_MATRIX_CLASSES = 40  # larger confusion matrices are summarised as the most frequent confusions


def _by_step(records: list[dict], kind: str) -> list[dict]:
    latest = {r["step"]: r for r in records if r.get("kind") == kind and "step" in r}
    return [latest[s] for s in sorted(latest)]


def _xy(records: list[dict], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pts], [p[1] for p in pts]


def monitored_evals(records: list[dict]) -> tuple[str, list[dict]]:
    """``(split, eval records by step)`` of the split evaluated during training: ``val`` when the
    run has a validation split (its evaluations say so, or before the first one its ``start``
    record counts validation images), else ``test``."""
    evals = [r for r in records if r.get("kind") == "eval"]
    start = next((r for r in reversed(records) if r.get("kind") == "start"), {})
    has_val = any(r.get("split") == "val" for r in evals) or (not evals and bool(start.get("val_images")))
    split = "val" if has_val else "test"
    return split, _by_step([r for r in evals if r.get("split", "test") == split], "eval")


def write_curves(records: list[dict], out: Path) -> dict[str, Path]:
    """The PNGs of the module docstring into folder ``out``; returns ``{name: path}``. Every curve
    is labelled with its split; the accuracy PNG is not drawn before the first evaluation (the
    report says when it comes instead), nor a curve without a point."""
    out.mkdir(parents=True, exist_ok=True)
    train, (split, evals) = _by_step(records, "train"), monitored_evals(records)
    marker = {"marker": "o", "markersize": 4}
    loss = [("train loss (training batches)", *_xy(train, "loss"), {}), (f"{split} loss", *_xy(evals, "loss"), marker)]
    if any("ema_loss" in e for e in evals):
        loss.append((f"EMA {split} loss", *_xy(evals, "ema_loss"), marker))
    shown = [m for m in headline_metrics(_task(evals)) if m.format == "percent"][:2]  # top-1 / top-5, mAP / micro-F1
    shown = [m for m in shown if any(e.get(m.name) is not None for e in evals)]  # no top-5 under 6 classes
    acc = [(f"{split} {m.label}", *_xy(evals, m.name), {**marker, "alpha": 1.0 if i == 0 else 0.6})
           for i, m in enumerate(shown)]
    if shown and any(f"ema_{shown[0].name}" in e for e in evals):
        acc.append((f"EMA {split} {shown[0].label}", *_xy(evals, f"ema_{shown[0].name}"),
                    {**marker, "linestyle": "--"}))
    acc = [(label, xs, [100 * y for y in ys], kw) for label, xs, ys, kw in acc]
    stall_x, stall_y = _xy(train, "data_stall")
    pngs = {
        "loss": line_plot(out / "loss.png", f"loss: training batches and the {split} split",
                          [c for c in loss if c[1]], "cross-entropy",
                          right=[("grad norm", *_xy(train, "grad_norm"), {"color": "gray", "alpha": 0.4,
                                                                          "linewidth": 0.8})],
                          right_label="gradient L2 norm"),
        "lr": line_plot(out / "lr.png", "learning rate", [("lr", *_xy(train, "lr"), {})], "learning rate"),
        "throughput": line_plot(out / "throughput.png", "training throughput",
                                [("training images/s", *_xy(train, "images_per_s"), {})], "images/s",
                                right=[("data stall", stall_x, [100 * y for y in stall_y],
                                        {"color": "tab:red", "alpha": 0.6})], right_label="data stall, % of time"),
    }
    if evals:
        labels = " / ".join(m.label for m in shown)
        pngs["accuracy"] = line_plot(out / "accuracy.png", f"{split} {labels} at each evaluation", acc, "%",
                                     note=_count_note(len(evals)))
    else:
        (out / "accuracy.png").unlink(missing_ok=True)  # an earlier report's, of a run that starts over
    return pngs


def _task(evals: list[dict]) -> str:
    """The task of a run's evaluations (``multiclass`` before the first)."""
    return task_of(evals[-1]) if evals else "multiclass"


def _count_note(n: int) -> str:
    """What the accuracy panel says about its points: one point reads as one point."""
    return "no evaluation yet" if n == 0 else ("1 evaluation so far" if n == 1 else f"{n} evaluations")


def final_metrics(records: list[dict]) -> dict[str, Any]:
    """The headline numbers: the ``summary`` record when the run finished, else what the last
    ``eval`` / ``train`` / ``interrupted`` records say, plus device, precision, ranks and the
    peak memory logged."""
    start = next((r for r in reversed(records) if r.get("kind") == "start"), {})
    summary = next((r for r in reversed(records) if r.get("kind") in ("summary", "interrupted")), None)
    train, (split, evals) = _by_step(records, "train"), monitored_evals(records)
    out: dict[str, Any] = {}
    figures = (*summary_names(), *interval_names(), "skipped")  # per split
    if summary and summary["kind"] == "summary":
        pattern = r"(raw_)?(val|test)_(" + "|".join(map(re.escape, figures)) + ")"
        out.update({k: v for k, v in summary.items() if re.fullmatch(pattern, k)})
        out.update({k: summary[k] for k in ("step", "elapsed_s", "train_images_per_s", "skipped_steps",
                                            "skipped_images") if k in summary})
    else:
        if evals:
            out.update({f"{split}_{k}": evals[-1][k] for k in figures if k in evals[-1]})
        out["step"] = (summary or max(train + evals, key=lambda r: r["step"], default={})).get("step")
        out["status"] = f"interrupted ({summary['interrupted']})" if summary else "incomplete"
    if train:
        epochs = _epochs(start, out.get("step") or train[-1].get("step", 0))
        out["epochs"] = epochs if epochs is not None else train[-1].get("epoch", 0) + 1
        mem = [r["memory_mb"] for r in train if r.get("memory_mb") is not None]
        if mem:
            out["peak_memory_mb"] = max(mem)
    out.update({k: start[k] for k in ("device", "precision", "world_size", "micro_batch", "train_images",
                                      "val_images", "test_images") if k in start})
    return out


def _epochs(start: dict, step: int) -> float | None:
    """Epochs trained after ``step`` optimizer steps, from the run's batch geometry (each step
    takes ``accum_steps`` micro-batches per rank; an epoch has ``train_images // world_size //
    micro_batch`` of them, the tail dropped); ``None`` when the start record lacks it."""
    try:
        per_epoch = start["train_images"] // start.get("world_size", 1) // start["micro_batch"]
        return round(step * start.get("accum_steps", 1) / per_epoch, 2) if per_epoch else None
    except (KeyError, TypeError):
        return None


def _img(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img alt="{path.stem}" src="data:image/png;base64,{data}">'


def _fmt(key: str, v: Any) -> str:
    """``v`` in its metric's format when ``key`` is a metric's (``val_top1``: ``97.77%``)."""
    found = split_metric(key.removesuffix(CI))
    if isinstance(v, float) and found and found[0] in ("val", "test", "raw_val", "raw_test"):
        return found[1].text(v)
    if key.endswith(CI) and isinstance(v, list) and found:
        return found[1].interval_text(v)
    if isinstance(v, float):
        return f"{v:,.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    return html.escape(str(v))


def _kpi_interval(key: str, final: dict[str, Any]) -> str:
    """The 95% interval under a headline box's figure, where the summary has one."""
    interval = final.get(key + CI)
    return f"<small>95% CI {_fmt(key + CI, interval)}</small>" if interval else ""


def _bar_table(heads: list[str], rows) -> str:
    """A per-class table: ``heads`` (the class column first, the fraction's last), and per row
    ``(class name, [cells between], fraction or None)``; the fraction as a percentage and a bar."""
    out = []
    for name, cells, frac in rows:
        middle = "".join(f"<td class=num>{c}</td>" for c in cells)
        pct, width = ("n/a", 0) if frac is None else (f"{frac:.1%}", round(200 * frac))
        out.append(f"<tr><td>{html.escape(name)}</td>{middle}<td class=num>{pct}</td>"
                   f'<td><div class=bar style="width:{width}px"></div></td></tr>')
    return "<table><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "<th></th></tr>" + "".join(out) + "</table>"


def _per_class_table(ev: dict) -> str:
    rows = zip(ev["classes"], ([sum(row)] for row in ev["confusion"]), ev["per_class_top1"])
    return _bar_table(["class", "images", "top-1"], rows)


def _per_class_ap_table(ev: dict) -> str:
    return _bar_table(["class", "AP"], ((name, [], ap) for name, ap in zip(ev["classes"], ev["per_class_ap"])))


def _confusion_html(ev: dict) -> str:
    classes, m = ev["classes"], ev["confusion"]
    if len(classes) > MAX_MATRIX_CLASSES:
        pairs = sorted(((m[i][j], i, j) for i in range(len(m)) for j in range(len(m)) if i != j and m[i][j]),
                       reverse=True)[:25]
        rows = "".join(f"<tr><td>{html.escape(classes[i])}</td><td>{html.escape(classes[j])}</td>"
                       f"<td class=num>{n}</td></tr>" for n, i, j in pairs)
        return ("<p>Too many classes for a matrix; the most frequent confusions:</p>"
                f"<table><tr><th>true</th><th>predicted</th><th>images</th></tr>{rows}</table>")
    head = "".join(f"<th class=rot><div>{html.escape(c)}</div></th>" for c in classes)
    body = []
    for i, (name, row) in enumerate(zip(classes, m)):
        total = max(sum(row), 1)
        cells = []
        for j, n in enumerate(row):
            frac = n / total
            color = f"rgba(31,119,180,{frac:.3f})" if i == j else f"rgba(214,39,40,{min(1, 3 * frac):.3f})"
            cells.append(f'<td class=num style="background:{color}">{n}</td>')
        body.append(f"<tr><th>{html.escape(name)}</th>{''.join(cells)}</tr>")
    return (f"<table class=cm><tr><th>true \\ predicted</th>{head}</tr>{''.join(body)}</table>"
            "<p class=note>Rows: true class; columns: predicted class. Blue: correct (shade = the row's "
            "fraction); red: confusions (shade = 3 x the row's fraction).</p>")


_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:22px;margin-bottom:4px} h2{font-size:17px;margin-top:28px;border-bottom:1px solid #ddd}
.sub{color:#666;font-size:13px} table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 7px;text-align:left} .num{text-align:right}
.grid{display:grid;grid-template-columns:repeat(2,minmax(0,1fr));gap:12px} .grid img{width:100%}
.bar{height:10px;background:#1f77b4} pre{background:#f6f6f6;padding:10px;font-size:12px;overflow:auto}
.cm td{min-width:34px} .rot div{writing-mode:vertical-rl;transform:rotate(180deg);max-height:110px}
.note{color:#666;font-size:12px} .kpi{display:flex;gap:16px;flex-wrap:wrap}
.kpi div{border:1px solid #ddd;border-radius:6px;padding:8px 14px} .kpi b{font-size:20px;display:block} .kpi small{color:#666;display:block}
.pending{border:1px dashed #bbb;border-radius:6px;padding:24px;color:#555;font-size:15px;display:flex;align-items:center}
.samples{display:flex;flex-wrap:wrap;gap:10px} .samples figure{margin:0;font-size:12px;text-align:center;width:120px}
.samples img{width:112px;height:112px;object-fit:cover;image-rendering:auto}
"""


def write_report(run_dir: str | Path, output: str | Path | None = None, checkpoint: str | Path | None = None,
                 model_panels: bool = True) -> Path:
    """Write the PNGs and the HTML page of the module docstring; returns the HTML path.
    ``checkpoint``: the one whose attention maps and sample predictions are drawn (default: the
    run's newest); ``model_panels=False`` leaves those two out (they load the model: the live
    report during training skips them).

    Raises:
        FileNotFoundError: ``run_dir`` has no ``metrics.jsonl``.
    """
    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run} does not exist" if not run.exists() else
                                f"{run} is not a run directory: no metrics.jsonl")
    records = read_metrics(run / "metrics.jsonl")
    html_path = Path(output) if output else run / "report.html"
    pngs = write_curves(records, html_path.parent / "report")
    final = final_metrics(records)
    config = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else "(no config.yaml)"
    ev = json.loads((run / "eval.json").read_text()) if (run / "eval.json").is_file() else None

    split, evals = monitored_evals(records)
    kpi_keys = [(f"{role}_{m.name}", f"{role} {m.label}") for role in ("val", "test")
                for m in headline_metrics(_task(evals)) if m.better]  # the summary line's scores
    kpi_keys += [("step", "steps"), ("epochs", "epochs"), ("train_images_per_s", "train images/s")]
    kpis = "".join(f"<div>{label}<b>{_fmt(k, final[k])}</b>{_kpi_interval(k, final)}</div>" for k, label in kpi_keys
                   if final.get(k) is not None)
    table = "".join(f"<tr><td>{html.escape(k)}</td><td class=num>{_fmt(k, v)}</td></tr>" for k, v in final.items()
                    if v is not None)
    images = "".join(_img(pngs[k]) if k in pngs else pending_evaluation(records, config, split)
                     for k in ("loss", "accuracy", "lr", "throughput"))
    later = read_eval_records(run)
    last = _last_evaluation(newest_evaluation(ev, later), pngs["loss"].parent)
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>vitflow report: {html.escape(run.name)}</title><style>{_CSS}</style></head>
<body><h1>vitflow run {html.escape(run.name)}</h1>
<div class=sub>{html.escape(str(run.resolve()))} &middot; report written {dt.datetime.now():%Y-%m-%d %H:%M}</div>
{status_line(final)}
<h2>{"Final metrics" if "status" not in final else "Metrics so far"}</h2><div class=kpi>{kpis}</div><p></p><table>{table}</table>
<h2>Curves</h2><div class=grid>{images}</div>
{last}
{later_evaluations(later)}
{samples_panel(run, checkpoint, model_panels)}
{attention_panel(run, html_path.parent / "report", checkpoint) if model_panels else ""}
{distribution_panel(run)}
{race_panel(run)}
{fixes_panel(run)}
<h2>Config</h2><pre>{html.escape(config)}</pre>
</body></html>
"""
    tmp = html_path.with_name(f".{html_path.name}.tmp")  # replaced atomically: a browser never reads half a page
    tmp.write_text(page)
    os.replace(tmp, html_path)
    return html_path


def _last_evaluation(ev: dict | None, folder: Path) -> str:
    """The section of the evaluation the report details (``eval.json``, or a later ``vitflow eval``
    result): its figures, per-class tables, calibration and confusion matrix."""
    if not ev:
        return ("<h2>Last evaluation</h2><p>None yet: the run writes eval.json at each evaluation, and <code>vitflow "
                "eval</code> of one of its checkpoints records its figures here too.</p>")
    by = " by <code>vitflow eval</code>" if ev.get("source") == "vitflow eval" else ""
    title = (f"<h2>Last evaluation{by}: step {ev['step']}, {html.escape(str(ev['split']))} split "
             f"({html.escape(str(ev.get('split_expr') or ev['split']))}), {ev['images']} images, "
             f"{ev['weights']} weights</h2><p>{html.escape(headline(ev))}</p>")
    if "map" in ev:
        return (f"{title}<p class=note>threshold {ev['threshold']:.2f} (chosen on the validation split)</p>"
                f"<h3>Per-class average precision</h3>{_per_class_ap_table(ev)}")
    ev = {**ev, "per_class_top1": ev.get("per_class_top1") or ev.get("recall")}  # vitflow eval keeps it as recall
    return (title + (f"<h3>Per-class precision, recall, F1</h3>{prf_table(ev)}" if "f1" in ev else "")
            + calibration_html(ev, folder)
            + f"<h3>Per-class top-1</h3>{_per_class_table(ev)}<h3>Confusion matrix</h3>{_confusion_html(ev)}")


def write_live_report(run_dir: str | Path) -> Path:
    """:func:`write_report` into ``RUN_DIR/report.html`` without the panels that load the model:
    what training calls at its first records and after each evaluation (``train.live_report``), so
    that a browser refresh shows the run so far (the report written at the end, or ``vitflow report
    RUN_DIR`` meanwhile, adds the attention maps and the samples' predictions)."""
    return write_report(run_dir, model_panels=False)
