"""Training layer: the loop and its callbacks, optimizers and schedules, losses, mixed precision,
checkpoints, distributed training, fine-tuning, sweeps."""

from vitflow.train.callbacks import Callback, StepOutput
from vitflow.train.checks import check_config
from vitflow.train.loop import Trainer, train

__all__ = ["Callback", "StepOutput", "Trainer", "check_config", "train"]
