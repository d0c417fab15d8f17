"""Training layer: the loop (:mod:`.loop`), what it builds before its first step (:mod:`.setup`), its
callbacks (:mod:`.callbacks`), the configuration a run starts from and its checks
(:mod:`.configure`, :mod:`.checks`, :mod:`.normalize`), a planned run's race of models
(:mod:`.race`) and sweeps (:mod:`.sweep`); by concern, in
sub-packages: :mod:`.plan` (the planned recipe, its rules, the clock, the time budget), :mod:`.run`
(run folder, resume, pre-emption, guards), :mod:`.track` (records, evaluation, selection,
trackers), :mod:`.objectives` (losses, distillation, class weights), :mod:`.optim` (optimizers,
schedules, EMA, fine-tuning) and :mod:`.scale` (distributed and elastic training).

:class:`Callback` and :class:`StepOutput` load with the package; :class:`Trainer`, :func:`train`
(``train(cfg, callbacks=())``: a :class:`~vitflow.config.Config` trained, after its race if it has one) and :func:`check_config`
on first use, so that importing a callback does not import the whole pipeline. The Python API's
training function is :func:`vitflow.train` (:func:`vitflow.api.run.train`), not this package.
"""

from vitflow.training.callbacks import Callback, StepOutput

__all__ = ["Callback", "StepOutput", "Trainer", "check_config", "train"]


def __getattr__(name: str):
    if name == "Trainer":
        from vitflow.training.loop import Trainer

        return Trainer
    if name == "train":
        from vitflow.training.race import train

        return train
    if name == "check_config":
        from vitflow.training.checks import check_config

        return check_config
    raise AttributeError(f"module 'vitflow.training' has no attribute {name!r}")
