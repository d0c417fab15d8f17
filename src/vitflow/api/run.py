"""``vitflow.train(...)`` and the :class:`Run` it returns: a run folder with its figures and
checkpoints, and what the command line does with one (``eval``, ``predict``, ``export``,
``quantize``, ``report``, ``resume``)."""

from __future__ import annotations

import html
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import torch
import yaml

from vitflow import config as schema
from vitflow.api.classifier import TTA_FLAG, Classifier, check_tta, load
from vitflow.api.config import build, data_items, yaml_value
from vitflow.api.display import Report, figures_html
from vitflow.checkpoint import choose_checkpoint, latest_checkpoint
from vitflow.evaluation import split_results
from vitflow.infer.tta import check_export_tta
from vitflow.rundir import CONFIG, EVAL, METRICS, is_run_dir, read_metrics
from vitflow.training.callbacks import Callback
from vitflow.training.race import train as train_loop

log = logging.getLogger("vitflow")


class Run:
    """A training run's folder (``vitflow.Run("runs/my-run")`` opens one from disk).

    Attributes:
        folder: the run directory.
        summary: the run's summary (what ``vitflow train --json`` prints: ``step``, ``checkpoint``,
            ``val_top1``, ``test_top1``, ...; ``interrupted`` / ``stopped`` when it ended early), read
            from ``metrics.jsonl`` for a folder; ``{}`` for a run without one (still running, or
            killed).
    Raises:
        FileNotFoundError: ``folder`` is not a vitflow run directory.
    """

    def __init__(self, folder: str | os.PathLike, summary: dict[str, Any] | None = None):
        self.folder = Path(folder)
        if not is_run_dir(self.folder):
            raise FileNotFoundError(f"{self.folder} is not a vitflow run directory (no run.json)")
        if summary is None and (self.folder / METRICS).is_file():
            summary = next((r for r in reversed(read_metrics(self.folder)) if r.get("kind") == "summary"), None)
        self.summary = summary or {}

    def __fspath__(self) -> str:
        return str(self.folder)

    @property
    def figures(self) -> dict[str, dict[str, Any]]:
        """The final figures by split, ``{"val": {"top1": 0.93, "loss": ...}, "test": {...}}``
        (fractions; see :mod:`vitflow.metrics`), from the summary; a run without a summary gives
        the latest evaluation's (``eval.json``)."""
        if self.summary:
            return split_results(self.summary)
        last = self.folder / EVAL
        if not last.is_file():
            return {}
        ev = yaml.safe_load(last.read_text())  # JSON is YAML
        return {ev["split"]: {k: v for k, v in ev.items() if isinstance(v, (int, float))}}

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved configuration (``config.yaml``) as nested dicts."""
        return yaml.safe_load((self.folder / CONFIG).read_text())

    @property
    def checkpoint(self) -> Path | None:
        """The newest checkpoint (``checkpoints/step-XXXXXXXX.pt``), or ``None``."""
        return latest_checkpoint(self.folder)

    @property
    def best_checkpoint(self) -> Path | None:
        """``checkpoints/best.pt`` (kept with ``train.keep_best``), or ``None``."""
        best = self.folder / "checkpoints" / "best.pt"
        return best if best.is_file() else None

    @property
    def step(self) -> int | None:
        return self.summary.get("step")

    def _checkpoint(self, which: str) -> Path:
        """The checkpoint ``which`` names. Raises FileNotFoundError in Python's terms (``which=...``)."""
        try:
            return choose_checkpoint(self.folder, None if which in ("newest", "last") else which)
        except FileNotFoundError as e:
            names = sorted(p.name for p in (self.folder / "checkpoints").glob("*.pt"))
            raise FileNotFoundError(str(e).replace(f"--checkpoint {which}:", f"which={which!r}:", 1)
                                    + f" (which= takes 'newest', 'best' or one of {names})") from None

    def load(self, which: str = "newest", **kwargs: Any) -> Classifier:
        """The run's model as a :class:`~vitflow.api.classifier.Classifier` (:func:`vitflow.load`):
        ``which`` is ``newest``, ``best`` or a checkpoint file name; ``kwargs`` as :func:`vitflow.load`."""
        return load(self._checkpoint(which), **kwargs)

    def predict(self, images: Any, topk: int = 5, which: str = "newest", tta: str | None = None
                ) -> dict | list[dict]:
        """``self.load(which, tta=tta).predict(images, topk)``: see
        :meth:`~vitflow.api.classifier.Classifier.predict`."""
        return self.load(which, tta=tta).predict(images, topk)

    def evaluate(self, data: Any = None, tta: str | None = None, which: str = "newest", weights: str = "auto",
                 **overrides: Any) -> dict[str, Any]:
        """``vitflow eval``: the checkpoint on the run's test split (its validation split when the
        data has none) or on ``data``.

        Args:
            data: other data: a path (``data.path``; its ``test`` split, else ``val``), or Python
                data (a Dataset, iterable or DataFrame) evaluated whole.
            tta: test-time augmentation (``flip``, ``flip,crops5``).
            which: ``newest``, ``best`` or a checkpoint file name.
            overrides: data keys, e.g. ``data__test_split="test[:500]"``.
        Returns:
            the split's figures (``top1``, ``top5``, ``loss``, ``f1``, ``confusion``, ...: fractions)
            with ``split``, ``images``, ``checkpoint``, ``weights``, ``tta``, ``images_per_s``.
        Raises:
            FileNotFoundError, ValueError, ConfigError, DataError: as ``vitflow eval``.
        """
        from vitflow.infer.evaluate import evaluate_checkpoint

        check_tta(tta)  # a typo fails before any work, named as Python spells it
        items = {} if data is None else data_items(data)
        if data is not None and not isinstance(data, (str, os.PathLike)):  # Python data: evaluated whole
            items.update({"data.test_split": "train", "data.val_split": "none"})
        items.update({k.replace("__", "."): v for k, v in overrides.items()})
        r = evaluate_checkpoint(self._checkpoint(which), [f"{k}={yaml_value(v)}" for k, v in items.items()],
                                weights=weights, tta=tta)
        info = {k: r[k] for k in ("split", "split_expr", "checkpoint", "step", "weights", "tta", "images_per_s")}
        return {**split_results(r)[r["split"]], **info}

    def export(self, path: str | os.PathLike, format: str = "onnx", which: str = "newest", tta: str | None = None,
               optimize: bool = False, verify_data: str | None = None) -> Path:
        """``vitflow export``: the checkpoint as ``format`` (``onnx``, ``torchscript``,
        ``exported-program``, ``tensorrt``, or ``hub`` for a hub-style folder), verified against the
        PyTorch model on real images; returns the written path.

        Raises:
            ValueError: a bad format or a verification that failed (naming the difference).
        """
        from vitflow.infer.export.formats import export_checkpoint
        from vitflow.infer.export.hub_folder import save_hub_folder

        ckpt = self._checkpoint(which)
        check_export_tta(tta, format, TTA_FLAG)
        if format == "hub":
            return Path(save_hub_folder(ckpt, path)["path"])
        target = "gpu" if torch.cuda.is_available() else "cpu"  # as vitflow export: fused for this machine
        r = export_checkpoint(ckpt, path, format, optimize, target, verify_data=verify_data, tta=tta, log=log.info)
        if not r["ok"]:
            raise ValueError(f"{r['path']}: the exported model differs from the checkpoint: {r['summary']}")
        return Path(r["path"])

    def quantize(self, path: str | os.PathLike, backend: str = "onnxruntime", data: str | None = None,
                 max_drop: float = 1.0, which: str = "newest") -> Path:
        """``vitflow quantize``: INT8 (``onnxruntime``: an ``.onnx`` file; ``torch``: a ``.pt``
        checkpoint), refused (AccuracyDropError) when top-1 on ``data`` drops more than ``max_drop``
        points; returns the written path."""
        from vitflow.infer.quantize.dynamic import quantize_file

        return Path(quantize_file(self._checkpoint(which), path, backend, "int8", data, max_drop=max_drop,
                                  log=log.info)["path"])

    def report(self, which: str | None = None) -> Report:
        """``vitflow report``: writes ``report.html`` (curves, per-class figures, confusion matrix,
        attention maps) and returns it as a :class:`~vitflow.api.display.Report` (shown inline in
        Jupyter; ``.path`` is the file)."""
        from vitflow.viz.report import write_report

        return Report(write_report(self.folder, None, None if which is None else self._checkpoint(which)))

    def resume(self, callbacks: Sequence[Callback] = (), **overrides: Any) -> "Run":
        """``vitflow resume``: continue from the newest checkpoint with the saved config and
        ``overrides`` (e.g. ``train__total_steps=2000`` to train longer). A run on Python data
        resumes in the process that registered the data (else: DataError naming ``data.path``)."""
        return train(callbacks=callbacks, train__resume="auto", train__run_dir=str(self.folder), **overrides)

    def __repr__(self) -> str:
        shown = "; ".join(f"{split} {_headline(f)}" for split, f in self.figures.items())
        return f"vitflow.Run({str(self.folder)!r}, step {self.step}{': ' + shown if shown else ''})"

    def _repr_html_(self) -> str:
        status = ("interrupted" if "interrupted" in self.summary else "stopped early" if
                  self.summary.get("stopped") or self.summary.get("early_stopped") else
                  "finished" if self.summary else "no summary (running, or killed)")
        best = self.best_checkpoint
        rows = [("folder", self.folder), ("status", f"{status}, step {self.step}"),
                ("newest checkpoint", self.checkpoint), *([("best checkpoint", best)] if best else [])]
        head = "".join(f"<tr><th style='text-align:left'>{k}</th><td>{html.escape(str(v))}</td></tr>"
                       for k, v in rows)
        return f"<div><b>vitflow run</b><table>{head}</table>{figures_html(self.figures)}</div>"


def _headline(figures: dict[str, Any]) -> str:
    from vitflow.metrics import headline

    return headline(figures)


def train(data: Any = None, model: Any = None, preset: str | os.PathLike | None = None,
          callbacks: Sequence[Callback] = (), *, config: schema.Config | None = None, val: Any = None,
          test: Any = None, **overrides: Any) -> Run:
    """``vitflow train`` from Python; returns the finished :class:`Run`.

    Args:
        data: a path (image folder, tar, label file, Hugging Face dataset, packed dataset, URL:
            ``data.path``), or the user's own data: a ``torch.utils.data.Dataset`` of ``(image,
            label)`` items (PIL images, ``uint8`` arrays / tensors or paths; class indices or
            names), an iterable of them, or a pandas DataFrame of image paths and labels
            (:mod:`vitflow.data.sources.pyobjects`); or a :class:`~vitflow.api.config.Config`
            (as ``config=``). Default: the preset's data.
        model: a model name (``vit_tiny_patch16_224``; ``vitflow models``), weights to fine-tune
            (a file, a hub snapshot folder, ``hf-hub:ORG/NAME``) or a vitflow run / checkpoint to
            continue from (its architecture and weights).
        preset: a preset name (``vitflow presets``) or a YAML config file; without one, the
            command line's choice: the photo plan for a ``data`` path or Python data, ``finetune``
            for weights, else the default preset.
        callbacks: :class:`vitflow.Callback` objects, called after the built-in ones.
        config: a :class:`~vitflow.api.config.Config` to start from (then ``preset`` is ignored).
        val: held-out Python data (as ``data``), or a split expression (``"train[90%:]"``).
        test: the same, for the test split.
        overrides: config keys, ``train__total_steps=300`` or ``**{"train.total_steps": 300}`` or
            ``optim={"lr": 1e-3}``.
    Returns:
        the :class:`Run` (``run.figures``, ``run.checkpoint``, ...). A run stopped by Ctrl-C
        (a notebook's interrupt) returns too, with ``summary["interrupted"]``: ``run.resume()``.
    Raises:
        ConfigError: a bad key or value (named, with the nearest valid key); DataError: unusable
            data; NonFiniteError: a loss that stayed non-finite.
    """
    if isinstance(data, schema.Config) and config is None:
        config, data = data, None
    cfg = build(data, model, preset, val, test, base=config, **overrides)
    on_eval = None
    if cfg.train.live_report:
        from vitflow.viz.report import write_live_report as on_eval
    summary = train_loop(cfg, on_eval=on_eval, callbacks=callbacks)
    if on_eval is not None and os.environ.get("RANK", "0") == "0" and "interrupted" not in summary:
        on_eval(summary["run_dir"])  # the final evaluation's page (run.report() adds the model's panels)
    return Run(summary["run_dir"], summary)
