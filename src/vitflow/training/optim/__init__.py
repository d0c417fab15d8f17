"""How the weights move: :mod:`.optimizers` (AdamW / SGD and their parameter groups), :mod:`.schedules`
(every learning-rate schedule), :mod:`.ema` (the weights' moving average) and :mod:`.finetune`
(which weights train when fine-tuning)."""
