"""Report panels about a run's progress: when its first evaluation comes (instead of empty axes
before it), and the figures ``vitflow eval`` measured on its checkpoints afterwards
(``RUN_DIR/evals``, :func:`vitflow.rundir.write_eval_record`)."""

from __future__ import annotations

import datetime as dt
import html
from typing import Any

import yaml

from vitflow.config import parse_duration
from vitflow.metrics import headline


def _train_setting(config_text: str, key: str) -> Any:
    try:
        tree = yaml.safe_load(config_text) or {}
    except yaml.YAMLError:
        return None
    return (tree.get("train") or {}).get(key) if isinstance(tree, dict) else None


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def first_evaluation(records: list[dict], config_text: str) -> tuple[int | None, float | None]:
    """``(step, seconds after the start)`` of a run's first evaluation, from its config
    (``train.eval_every``, ``train.eval_interval``, else the end: ``train.total_steps``) and its
    speed so far (the ``train`` records' steps over their times); either may be ``None`` when the
    records cannot tell yet."""
    start = next((r for r in records if r.get("kind") == "start"), None)
    train = [r for r in records if r.get("kind") == "train" and "step" in r]
    rate = None
    if start and train and train[-1]["time"] > start["time"]:
        rate = (train[-1]["step"] - start.get("step", 0)) / (train[-1]["time"] - start["time"])  # steps / s
    interval, every = _train_setting(config_text, "eval_interval"), _train_setting(config_text, "eval_every")
    if interval:
        seconds = parse_duration(interval)
        return (int(rate * seconds) if rate else None), seconds
    step = every or _train_setting(config_text, "total_steps")
    return step, (step / rate if step and rate else None)


def pending_evaluation(records: list[dict], config_text: str, split: str) -> str:
    """The HTML box shown in place of the accuracy panel before a run's first evaluation: ``No
    evaluation yet, first at step N (~M min after the start)``."""
    step, seconds = first_evaluation(records, config_text)
    parts = ([f"step {'~' if _train_setting(config_text, 'eval_interval') else ''}{step}"] if step is not None else [])
    parts += [f"~{_minutes(seconds)} after the start"] if seconds is not None else []
    first = (f", first at {parts[0]}" + (f" ({parts[1]})" if len(parts) > 1 else "")) if parts else ""
    return (f'<div class="pending"><b>No evaluation yet{html.escape(first)}.</b> The {html.escape(split)} accuracy '
            "curve appears with it.</div>")


def later_evaluations(evals: list[dict]) -> str:
    """A table of the ``vitflow eval`` results kept in ``RUN_DIR/evals`` (empty without any)."""
    if not evals:
        return ""
    rows = []
    for r in evals:
        when = dt.datetime.fromtimestamp(r["time"]).strftime("%Y-%m-%d %H:%M") if r.get("time") else "?"
        rows.append(f"<tr><td>{r.get('step')}</td><td>{html.escape(str(r.get('split')))} "
                    f"({html.escape(str(r.get('split_expr')))})</td><td class=num>{r.get('images', '?')}</td>"
                    f"<td>{html.escape(headline(r))}</td><td>{html.escape(str(r.get('weights')))}"
                    f"{'' if r.get('tta', 'none') == 'none' else ', TTA ' + html.escape(str(r['tta']))}</td>"
                    f"<td>{when}</td></tr>")
    return ("<h2>Evaluations by <code>vitflow eval</code></h2><table><tr><th>step</th><th>split</th><th>images</th>"
            f"<th>figures</th><th>weights</th><th>when</th></tr>{''.join(rows)}</table>")


def newest_evaluation(run_eval: dict | None, evals: list[dict]) -> dict | None:
    """The evaluation the report details: the run's own ``eval.json`` (``run_eval``), or a later
    ``vitflow eval`` result of a newer checkpoint (an interrupted run has none of its own)."""
    later = evals[-1] if evals else None
    if run_eval is None or (later is not None and later.get("step", 0) > run_eval.get("step", 0)):
        return later
    return run_eval
