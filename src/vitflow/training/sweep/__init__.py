"""``vitflow sweep``: a hyperparameter search with Optuna over any config keys, shared by as many
workers as you start.

Each trial is a normal vitflow run directory ``SWEEP_DIR/trial-NNNN`` (train it, resume it, report
it, evaluate it as any run), trained in a worker with the preset, config file and overrides of
the command plus the trial's sampled values; its budget is the run's own (``train.total_steps``
or ``train.time_budget`` among the overrides). The sampler is TPE (Bergstra et al. 2011), seeded
per trial (``seed`` + the values drawn before it) and with the constant liar for trials still
running; the pruner is Optuna's median rule: at each evaluation during training (``train.eval_every``) a
trial whose metric is worse than the median of the earlier trials at the same step stops there.

Workers: ``--workers N`` runs N trials at a time on this machine (N processes, the cores split
between them); several ``vitflow sweep`` commands on the same ``--dir``, or on the same
``--storage URL`` from several machines, cooperate: each asks the storage for the next trial, and
``--trials N`` counts the finished trials of all of them (:mod:`.search`). A trial whose worker
dies is found by its heartbeat and run again from its last checkpoint (:mod:`.storage`).

The sweep folder holds::

    SWEEP_DIR/sweep.json        the sweep's definition (preset, space, overrides, metric, direction, seed, storage)
    SWEEP_DIR/sweep.db          Optuna's storage (SQLite) unless --storage names another
    SWEEP_DIR/sweep.csv         trial, state, value, the sampled keys, run_dir, seconds, note; after each trial
    SWEEP_DIR/best.yaml         the best trial's full config, for `vitflow train --config best.yaml`
    SWEEP_DIR/trial-NNNN/       the trials' run directories (of this machine's workers)

Running the same command again continues the sweep to ``--trials`` finished trials (complete,
pruned, or failed on an error); a trial stopped by SIGINT/SIGTERM goes on from its checkpoint
first. The search space file maps config keys to distributions::

    optim.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
    optim.warmup_steps: {type: int, low: 0, high: 50, step: 10}
    model.drop_path_rate: {type: categorical, choices: [0.0, 0.1]}
"""

from vitflow.training.sweep.search import run_sweep
from vitflow.training.sweep.space import SweepError, default_direction, read_space
from vitflow.training.sweep.trial import SweepInterrupted

__all__ = ["SweepError", "SweepInterrupted", "default_direction", "read_space", "run_sweep"]
