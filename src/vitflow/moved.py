"""Modules that moved, and the one line an import of an old name fails with.

The training layer was the package ``vitflow.train`` until the layers were given rooms; since then
``vitflow.train`` is the Python API's training function (:func:`vitflow.api.run.train`) and the layer
is :mod:`vitflow.training`, with the inference layer's modules grouped in sub-packages too.
``import vitflow.train.loop`` or ``from vitflow.infer.onnx_model import OnnxModel`` in a user's code
then raises ``ModuleNotFoundError`` naming the new place, instead of Python's bare "No module named".
The finder is appended to :data:`sys.meta_path`, so it is asked only after every real finder has
failed: imports of existing modules never reach it.
"""

from __future__ import annotations

import importlib.abc
import sys

# old module -> new module, by layer (``vitflow.train`` itself: the package is now ``vitflow.training``)
_TRAINING = {
    "loop": "loop", "callbacks": "callbacks", "setup": "setup", "configure": "configure", "checks": "checks",
    "normalize": "normalize", "sweep": "sweep",
    "plan": "plan.recipe", "plan_rules": "plan.rules", "clock": "plan.clock", "budget": "plan.budget",
    "run_dir": "run.folder", "resume": "run.resume", "preempt": "run.preempt", "guards": "run.guards",
    "store_stop": "run.store_stop",
    "logging": "track.records", "trackers": "track.trackers", "selection": "track.selection",
    "evaluator": "track.evaluator",
    "losses": "objectives.losses", "distill": "objectives.distill", "class_weights": "objectives.class_weights",
    "optim": "optim.optimizers", "schedules": "optim.schedules", "ema": "optim.ema", "finetune": "optim.finetune",
    "distributed": "scale.distributed", "elastic": "scale.elastic",
}
_INFER = {
    "onnx_model": "runtimes.onnx", "onnx_fusion": "runtimes.onnx_fusion", "openvino_model": "runtimes.openvino",
    "tensorrt": "runtimes.tensorrt", "hub_folder": "export.hub_folder", "model_card": "export.model_card",
    "static_quant": "quantize.static", "guard": "quantize.guard", "bench_paths": "bench.paths",
    "resolution": "bench.resolution", "embed": "features.embed", "knn": "features.knn",
    "backbone": "features.backbone",
}
MOVED: dict[str, str] = {
    "vitflow.train": "vitflow.training",
    **{f"vitflow.train.{old}": f"vitflow.training.{new}" for old, new in _TRAINING.items()},
    **{f"vitflow.infer.{old}": f"vitflow.infer.{new}" for old, new in _INFER.items()},
}
# (``vitflow.infer.export``, ``.quantize`` and ``.bench`` are packages now, holding their old module's
# contents in ``export.formats``, ``quantize.dynamic`` and ``bench.infer``: the package imports, its old names don't)
_TRAIN_HINT = ("vitflow.train is now the Python API's training function (vitflow.train(data=..., model=...)); "
               "the training layer moved to vitflow.training (vitflow.training.Trainer, vitflow.training.loop, "
               "vitflow.training.plan.recipe, ...: docs/architecture.md lists where each module went)")


def message(old: str) -> str | None:
    """The one line for importing ``old`` (a dotted module name), or ``None`` if it did not move."""
    if old == "vitflow.train" or old.startswith("vitflow.train."):
        return _TRAIN_HINT
    new = MOVED.get(old)
    return None if new is None else f"{old} moved to {new}"


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Raises ``ModuleNotFoundError`` with :func:`message` for a moved module's old name."""

    def find_spec(self, fullname, path, target=None):
        line = message(fullname)
        if line is not None:
            raise ModuleNotFoundError(line, name=fullname)
        return None


def install() -> None:
    """Append the finder to :data:`sys.meta_path` once (idempotent)."""
    if not any(isinstance(f, MovedModuleFinder) for f in sys.meta_path):
        sys.meta_path.append(MovedModuleFinder())
