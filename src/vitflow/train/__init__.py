"""Training layer: the loop, optimizers and schedules, losses, mixed precision, checkpoints."""

from vitflow.train.loop import Trainer, train

__all__ = ["Trainer", "train"]
