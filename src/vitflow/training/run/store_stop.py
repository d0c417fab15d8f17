"""A remote store that stays unreachable during training (:class:`~vitflow.data.remote.fs.RemoteError`
out of the data iterator, after its retries): checkpoint the last completed step, then stop with
one line naming the URL and the error and saying how to continue once the store is back.

The checkpoint is the one a ``train.checkpoint_every`` save at that step would write (the loader
position is the one before the failed step's batches were fetched), so ``vitflow resume RUN``
continues exactly. A store lost during a periodic evaluation leaves the checkpoint of the step
just trained, marked ``eval_due``: the resumed run runs that evaluation first. Under torchrun
every rank must see the error for the save's collectives to complete (a store that fails for one
rank only stops that rank).
"""

from __future__ import annotations

import logging
import time
from typing import NoReturn

from vitflow.data.remote.fs import RemoteError

log = logging.getLogger(__name__)


def first_line(error: Exception) -> str:
    """The error's own message: a loader worker's error arrives with ``Caught RemoteError in
    DataLoader worker process N`` and the worker's traceback around it; its last line is kept."""
    text = str(error).strip()
    if "Caught RemoteError" not in text:
        return text
    return text.splitlines()[-1].split("RemoteError: ", 1)[-1]


def stop_on_store_error(trainer, error: RemoteError, position: tuple[int, int], started: float) -> NoReturn:
    """Checkpoint ``trainer`` at its current step with the loader at ``position`` (before the failed
    step's batches), record the stop in the metrics, and raise one :class:`RemoteError` line.

    Raises:
        RemoteError: always: ``URL: what failed...; the run stopped: checkpoint ... at step N; when
            the store is back, continue with: vitflow resume RUN``.
    """
    trainer.epochs.position = tuple(position)
    path = trainer.save()
    trainer.epochs.end_partial(trainer.step)
    why = first_line(error)
    trainer.metrics.write("interrupted", interrupted="remote storage", error=why, step=trainer.step,
                          run_dir=str(trainer.run_dir), checkpoint=str(path), elapsed_s=time.perf_counter() - started)
    raise RemoteError(f"{why}; the run stopped: checkpoint {path} written at step {trainer.step}; when the store is "
                      f"back, continue with: vitflow resume {trainer.run_dir}", getattr(error, "url", ""),
                      getattr(error, "status", None), True) from None
