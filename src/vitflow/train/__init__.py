"""Training layer: the loop and its callbacks, optimizers and schedules, losses, mixed precision,
checkpoints, distributed training, fine-tuning, sweeps.

:class:`Callback` and :class:`StepOutput` load with the package; :class:`Trainer`, :func:`train`
and :func:`check_config` on first use (the loop imports the whole pipeline: ``import vitflow``
stays quick). Calling the package itself, ``vitflow.train(data=..., model=...)``, is the Python
API's :func:`vitflow.api.train` (the package is callable; see ``vitflow/__init__.py``).
"""

from vitflow.train.callbacks import Callback, StepOutput

__all__ = ["Callback", "StepOutput", "Trainer", "check_config", "train"]


def __getattr__(name: str):
    if name in ("Trainer", "train"):
        from vitflow.train import loop

        return getattr(loop, name)
    if name == "check_config":
        from vitflow.train.checks import check_config

        return check_config
    raise AttributeError(f"module 'vitflow.train' has no attribute {name!r}")
