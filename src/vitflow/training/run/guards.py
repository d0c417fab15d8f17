"""What keeps a run alive or stops it cleanly: the non-finite step guard and the SIGTERM/SIGINT
handler that turns a termination request into a checkpoint."""

from __future__ import annotations

import logging
import math
import signal
import threading

import torch

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """Too many optimizer steps in a row had a non-finite loss or gradient."""


class NonFiniteGuard:
    """Decides whether an optimizer step may be taken.

    A step whose loss is NaN/Inf, or whose gradient norm is NaN/Inf, is skipped (no parameter,
    optimizer-state, schedule or EMA update) and counted. Under fp16 loss scaling a non-finite
    gradient with a finite loss is the scaler's normal overflow signal: the scaler skips that
    step and lowers its scale, and it is counted as ``overflows``, not as a bad step.
    ``limit`` bad steps in a row raise :class:`NonFiniteError` naming the step and the likely cause.

    Attributes:
        skipped: bad steps so far; ``overflows``: fp16 scaler overflows; ``in_a_row``: current streak.
    """

    def __init__(self, limit: int, precision: str = "fp32", lr: float | None = None, warmup_steps: int = 0):
        self.limit, self.precision, self.lr, self.warmup_steps = limit, precision, lr, warmup_steps
        self.skipped = self.overflows = self.in_a_row = 0

    def check(self, step: int, loss: float, grad_norm: float, scaled: bool,
              inputs_finite: torch.Tensor | bool = True) -> bool:
        """True when step ``step`` (0-based) may update the model. ``inputs_finite`` (a bool or a
        0-d bool tensor, read only when the run is stopped) says whether the step's input batches
        were all finite; it names the likely cause in the error.

        Raises:
            NonFiniteError: the ``limit``-th bad step in a row.
        """
        loss_ok, grad_ok = math.isfinite(loss), math.isfinite(grad_norm)
        if loss_ok and (grad_ok or scaled):
            self.overflows += not grad_ok
            self.in_a_row = 0
            return True
        self.skipped += 1
        self.in_a_row += 1
        what = "loss" if not loss_ok else "gradient"
        log.warning("step %d: non-finite %s (loss %s, grad norm %s): step skipped (%d in a row, %d in all)",
                    step, what, loss, grad_norm, self.in_a_row, self.skipped)
        if self.in_a_row >= self.limit:
            inputs_ok = bool(inputs_finite)
            raise NonFiniteError(f"stopping at step {step}: {self.in_a_row} steps in a row had a non-finite {what} "
                                 f"(last loss {loss}, grad norm {grad_norm}); likely cause: "
                                 f"{self._cause(loss_ok, inputs_ok)}")
        return False

    def _cause(self, loss_ok: bool, inputs_ok: bool) -> str:
        if not inputs_ok:
            return "the input batch itself holds NaN/Inf values (check the data and its normalisation)"
        if self.precision == "fp16":
            return "fp16 overflow in the forward pass; use train.precision=bf16 or fp32"
        if loss_ok:
            return ("gradients overflow with a finite loss; keep optim.clip_grad_norm set, lower optim.lr "
                    f"(now {self.lr}) or use train.precision=fp32")
        return (f"the optimisation diverged; lower optim.lr (now {self.lr}) or lengthen optim.warmup_steps "
                f"(now {self.warmup_steps})")

    def state_dict(self) -> dict[str, int]:
        return {"skipped": self.skipped, "overflows": self.overflows, "in_a_row": self.in_a_row}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped, self.overflows, self.in_a_row = state["skipped"], state["overflows"], state["in_a_row"]


class StopSignals:
    """Context manager: while active, the first SIGTERM or SIGINT only records itself in
    :attr:`signum` (the trainer checkpoints at the end of the current step and exits); a second
    one acts as usual (SIGINT raises KeyboardInterrupt, SIGTERM kills). Handlers can only be
    installed from the main thread; elsewhere this does nothing."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        signal.signal(signum, self._previous[signum])  # a second one is not caught
        log.warning("received %s: writing a checkpoint after this step, then exiting (send it again to stop "
                    "immediately)", signal.Signals(signum).name)

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    @property
    def name(self) -> str | None:
        return signal.Signals(self.signum).name if self.signum else None
