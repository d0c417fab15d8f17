"""Pieces of the commands' input and output: the ``--json`` result line, checkpoint selection and the live report:
``--checkpoint best|last|PATH``, the training epilogue (early stopping, the best checkpoint, the
final report) and the live-report hook training calls after each evaluation."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable


def print_json(args: argparse.Namespace, obj) -> None:
    """The ``--json`` result line, on the real stdout (:func:`main` sends every other line of a
    ``--json`` command to stderr, so that ``vitflow eval RUN --json | jq`` works)."""
    print(json.dumps(obj), file=getattr(args, "json_stdout", None) or sys.stdout)


def chosen(args: argparse.Namespace) -> str:
    """The checkpoint ``--checkpoint best|last|PATH`` (``args.which``) picks of ``args.checkpoint``
    (a checkpoint file or run directory); see :func:`vitflow.checkpoint.choose_checkpoint`.

    Raises:
        FileNotFoundError: no best checkpoint, or no such PATH.
    """
    from vitflow.checkpoint import choose_checkpoint

    return str(choose_checkpoint(args.checkpoint, getattr(args, "which", None)))


def train_epilogue(r: dict, live_report: bool) -> None:
    """The end of ``vitflow train``'s output: why it stopped early, the best checkpoint, the final
    report (written once more, now with the attention maps of a sample image), the sample images."""
    if r.get("early_stopped"):
        print(r["early_stopped"])
    if r.get("best_step") is not None:
        print(f"best checkpoint: {r['run_dir']}/checkpoints/best.pt ({r['best_metric']} {r['best_value']:.6g} at step "
              f"{r['best_step']}; use it with --checkpoint best)")
    if live_report:
        from vitflow.viz.report import write_report

        write_report(r["run_dir"])  # now with the samples' predictions and the attention maps
        print(f"report: {r['run_dir']}/report.html")
    if "samples" in r:
        print(f"sample held-out images: {r['samples']}  (try: vitflow predict {r['run_dir']} {r['samples']})")


def live_report_hook(on: bool) -> Callable | None:
    """``train.live_report``: the hook that rewrites ``RUN_DIR/report.html`` after each evaluation
    (:func:`vitflow.viz.report.write_live_report`), or ``None``."""
    from vitflow.viz.report import write_live_report

    return write_live_report if on else None
