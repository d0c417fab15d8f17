"""Pieces of the commands' input and output: the ``--json`` result line, checkpoint selection and the live report:
``--checkpoint best|last|PATH``, the training epilogue (early stopping, the best checkpoint, the
final report) and the live-report hook training calls after each evaluation."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from vitflow.data.sources.readers import display_name


def print_json(args: argparse.Namespace, obj) -> None:
    """The ``--json`` result line, on the real stdout (:func:`main` sends every other line of a
    ``--json`` command to stderr, so that ``vitflow eval RUN --json | jq`` works); every string
    valid UTF-8 (:func:`escaped`)."""
    print(json.dumps(escaped(obj)), file=getattr(args, "json_stdout", None) or sys.stdout)


def escaped(obj: Any) -> Any:
    """``obj`` (JSON-like: dicts, lists, strings, numbers) with every string valid UTF-8, as strict
    JSON tools and CSV readers need: the bytes of a file name that are not UTF-8 (carried in a
    ``str`` as surrogate escapes, ``os.fsdecode``) written as ``\\xNN`` (byte ``0xNN``:
    ``caf\\xe9.jpg``; :func:`~vitflow.data.sources.readers.display_name`). A dict's ``path`` so
    escaped is followed by ``path_bytes``, the name's exact bytes in hex (``bytes.fromhex``). Other
    strings are unchanged."""
    if isinstance(obj, str):
        return display_name(obj) if _has_surrogates(obj) else obj
    if isinstance(obj, (list, tuple)):
        return [escaped(v) for v in obj]
    if not isinstance(obj, dict):
        return obj
    out = {}
    for k, v in obj.items():
        out[escaped(k)] = escaped(v)
        if k == "path" and isinstance(v, str) and _has_surrogates(v):
            out["path_bytes"] = os.fsencode(v).hex()
    return out


def _has_surrogates(text: str) -> bool:
    return any("\udc80" <= ch <= "\udcff" for ch in text)


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
