"""Every checkpoint read and write: atomic saves, safe loads, finding and pruning.

A checkpoint is one ``torch.save`` file, ``RUN_DIR/checkpoints/step-XXXXXXXX.pt``, holding::

    format, version, step, model, optimizer, scheduler, scaler, rng, data (loader position),
    config, model_args, classes, preprocess, metrics
    ema (``{"module": state_dict, "updates": n}`` or None), rng_ranks (one RNG state per rank
    of a distributed run, or None), guard (non-finite step counters)

``model`` always holds the trained weights (what training resumes from); ``ema`` the averaged
ones, which inference uses when present (:func:`model_from_checkpoint`).

It is written to a hidden temporary file in the same folder, flushed and fsync'ed, then renamed
over the final name (``os.replace`` is atomic on POSIX) and the folder fsync'ed: a run killed at
any instant leaves either the previous checkpoints or the new one, never a torn file. Loads use
``torch.load(weights_only=True)``, which executes no code from the file.
"""

from __future__ import annotations

import logging
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch

from vitflow.models import create_model, model_kwargs
from vitflow.models.kernels.matmul import as_plain_linear
from vitflow.models.lora import apply_lora, has_lora_weights, merge_lora, merge_lora_state_dict, split_lora_args
from vitflow.models.pretrained.weights import load_adapted, load_error_reason
from vitflow.rundir import STEP_FILE

log = logging.getLogger(__name__)

FORMAT = "vitflow-checkpoint"
VERSION = 1
SPACE_MARGIN = 1 << 20  # bytes beyond the tensors' a checkpoint's free-space check asks for


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """``RUN_DIR/checkpoints/step-XXXXXXXX.pt`` of step ``step``."""
    return Path(run_dir) / "checkpoints" / f"step-{step:08d}.pt"


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (no space, a failing disk); the message names the file,
    the folder and, for space, the bytes needed and free. Nothing was replaced: the previous
    checkpoints are intact and no temporary file is left."""


def state_bytes(obj: Any) -> int:
    """Bytes of the tensors in a (nested) checkpoint state: what its file will about weigh."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(state_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    return 0


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Atomically write ``state`` (plus format/version tags) to ``path``; returns ``path``.

    The folder's free space is checked first (the state's tensor bytes plus a margin). A write
    that fails (no space, an I/O error) removes its temporary file and leaves every existing file
    as it was.

    Raises:
        CheckpointWriteError: not enough free space, or the write failed (one line, naming the
            folder and, for space, the bytes needed and free).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    need = int(state_bytes(state) * 1.05) + SPACE_MARGIN
    free = shutil.disk_usage(path.parent).free
    if free < need:
        raise CheckpointWriteError(f"not enough space for checkpoint {path.name} in {path.parent}: about "
                                   f"{need / 2**20:.1f} MiB needed, {free / 2**20:.1f} MiB free")
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as raw:
            f = _WriteErrors(raw)
            torch.save({"format": FORMAT, "version": VERSION, **state}, f)
            raw.flush()
            os.fsync(raw.fileno())
    except (OSError, RuntimeError) as e:  # torch reports a failed write as RuntimeError("... enforce fail ...")
        tmp.unlink(missing_ok=True)
        cause = e if isinstance(e, OSError) else getattr(locals().get("f"), "error", None)
        reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(e).splitlines()[0][:200]
        raise CheckpointWriteError(f"cannot write checkpoint {path.name} in {path.parent}: {reason} "
                                   f"({shutil.disk_usage(path.parent).free / 2**20:.1f} MiB free there)") from None
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return path


class _WriteErrors:
    """A file wrapper that keeps the ``OSError`` of a failed ``write`` (torch reports it only as
    an opaque RuntimeError), so the message can say "No space left on device"."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


def remove_orphans(run_dir: str | Path) -> list[Path]:
    """Delete the temporary files of checkpoint writes that never finished (a process killed
    while writing); returns what was removed."""
    folder = Path(run_dir) / "checkpoints"
    orphans = sorted(folder.glob(".step-*.pt.tmp")) if folder.is_dir() else []
    for p in orphans:
        p.unlink(missing_ok=True)
    return orphans


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a vitflow checkpoint on the CPU without executing code from it. ``path``: a checkpoint
    file, or a run directory, whose newest *readable* checkpoint is taken (:func:`newest_readable`:
    an unreadable newer one, a killed copy or a bad disk, is skipped with a warning naming it). Every
    command that reads a run directory (eval, predict, export, quantize, report, embed, bench infer,
    resume) reads it through this function.

    Raises:
        FileNotFoundError: no such file, or a run directory without a checkpoint.
        ValueError: truncated, corrupt or not a vitflow checkpoint (for a file of a run directory
            the message names the run's readable checkpoints); a run directory whose checkpoints
            are all unreadable.
    """
    path = Path(path)
    if path.is_dir():
        if not list_checkpoints(path):
            raise FileNotFoundError(f"no checkpoint in run directory {path}")
        state = newest_readable(path)
        if state is None:
            raise ValueError(f"no readable checkpoint in run directory {path}: every one is truncated or corrupt "
                             "(see the warnings above)")
        return state
    try:
        return _read(path)
    except ValueError as e:
        readable = _readable_names(path.parent.parent, path) if path.parent.name == "checkpoints" else []
        if readable:
            raise ValueError(f"{e}; readable checkpoints of this run: {', '.join(readable)}") from e.__cause__
        raise


def newest_readable(run_dir: str | Path) -> dict[str, Any] | None:
    """The newest checkpoint of ``run_dir`` that can be read (:func:`load_checkpoint`'s state), or
    ``None`` when there is none; each unreadable newer one is skipped with a warning naming it
    (``skipping unreadable checkpoint PATH (reason); trying the one before it``)."""
    for p in reversed(list_checkpoints(run_dir)):
        try:
            return _read(p)
        except ValueError as e:
            log.warning("skipping unreadable checkpoint %s (%s); trying the one before it", p, e)
    return None


def _readable_names(run_dir: Path, unreadable: Path, most: int = 3) -> list[str]:
    """The names of up to ``most`` of ``run_dir``'s readable checkpoints (newest first), ``best.pt``
    included, ``unreadable`` left out."""
    found = []
    for p in [*reversed(list_checkpoints(run_dir)), run_dir / "checkpoints" / "best.pt"]:
        if len(found) < most and p.is_file() and p.resolve() != unreadable.resolve():
            try:
                _read(p)
                found.append(p.name)
            except ValueError:
                pass
    return found


def _read(path: Path) -> dict[str, Any]:
    """One checkpoint file, read (see :func:`load_checkpoint`)."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if path.suffix.lower() == ".onnx":
        raise ValueError(f"{path} is an ONNX model; this command needs a vitflow checkpoint (.pt or a run directory); "
                         "predict and bench infer also take .onnx")
    try:
        with warnings.catch_warnings():  # INT8 checkpoints: torch flags quantized tensors as deprecated
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            warnings.filterwarnings("ignore", message=".*quantized tensor creation functions")
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read checkpoint {path} (truncated, corrupt or not a PyTorch file?): "
                         f"{load_error_reason(e, path)}") from e
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise ValueError(f"{path} is not a vitflow checkpoint (for plain weights use create_model(pretrained=...))")
    state["path"] = str(path)
    return state


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest step first (temporary files are never listed)."""
    folder = Path(run_dir) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_FILE.match(p.name))]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of a run directory, or ``None`` when it has none."""
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def choose_checkpoint(path: str | Path, which: str | None) -> Path:
    """The checkpoint ``--checkpoint best|last|PATH`` picks for ``path`` (a run directory or a file).

    ``None`` / ``last``: ``path`` itself (a run directory loads its newest checkpoint); ``best``:
    ``RUN_DIR/checkpoints/best.pt`` (kept by ``train.keep_best``); anything else: that file, or that
    name in ``RUN_DIR/checkpoints``.

    Raises:
        FileNotFoundError: ``best`` of a run without one (trained without ``train.keep_best``), or
            a PATH that exists neither as given nor in the run's checkpoints folder.
    """
    p = Path(path)
    if which in (None, "", "last"):
        return p
    run = p if p.is_dir() else p.parent.parent
    if which == "best":
        best = run / "checkpoints" / "best.pt"
        if not best.is_file():
            raise FileNotFoundError(f"--checkpoint best: {run} has no checkpoints/best.pt (train with "
                                    "train.keep_best=METRIC, e.g. val_top1, to keep one)")
        return best
    for candidate in (Path(which), run / "checkpoints" / which):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"--checkpoint {which}: no such file, neither as given nor in {run / 'checkpoints'}")


def prune_checkpoints(run_dir: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints."""
    for p in list_checkpoints(run_dir)[:-keep]:
        p.unlink(missing_ok=True)


QUANTIZATIONS = ("dynamic-int8",)


def apply_quantization(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """Turn a float CPU model into the quantised form a checkpoint's ``quantization`` key names.

    ``dynamic-int8``: ``torch.ao.quantization.quantize_dynamic`` of every ``nn.Linear`` to
    ``qint8`` weights with one scale per output channel (activations quantised per batch at run
    time).

    Raises:
        ValueError: unknown scheme.
    """
    if scheme != "dynamic-int8":
        raise ValueError(f"unknown quantization {scheme!r}; this vitflow reads {list(QUANTIZATIONS)}")
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
        return quantize_dynamic(as_plain_linear(model), {torch.nn.Linear: per_channel_dynamic_qconfig},
                                dtype=torch.qint8)


WEIGHTS = ("auto", "ema", "raw")


def model_from_checkpoint(state: dict[str, Any], weights: str = "auto", img_size: int | None = None) -> torch.nn.Module:
    """Rebuild the model a checkpoint was trained with and load its weights (eval mode, CPU).

    ``model_args`` may carry per-block head counts / MLP sizes (pruned models); a
    ``quantization`` key (see :func:`apply_quantization`) rebuilds the quantised form. A model
    trained with LoRA (``model_args["lora"]`` and unmerged ``lora_A`` / ``lora_B`` weights) is
    rebuilt with its adapters, loaded, then merged (:func:`vitflow.models.lora.merge_lora`): what
    is returned is always a plain model of its family.

    Args:
        weights: ``auto``: the EMA weights when the checkpoint has them, else the trained ones;
            ``ema``: the EMA weights (error without); ``raw``: the trained weights.
        img_size: build the model for this input size in pixels instead of the trained one, its
            weights fitted as fine-tuning at ``model.img_size`` fits them
            (:func:`vitflow.models.pretrained.weights.load_adapted`: position embeddings and
            relative position tables resampled bicubically, logged); ``None`` = the trained size.
    Raises:
        ValueError: the weights do not fit the saved model arguments; ``ema`` asked for a
            checkpoint without EMA; an unknown ``weights``; an ``img_size`` the family cannot
            take (its own message) or one asked of a quantized checkpoint.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    ema = state.get("ema")
    if weights == "ema" and not ema:
        raise ValueError(f"checkpoint {state.get('path')} has no EMA weights (trained without train.ema_decay)")
    args, lora = split_lora_args(state["model_args"])
    chosen = ema["module"] if ema and weights != "raw" else state["model"]
    if img_size is not None and img_size != model_kwargs(**args).get("img_size"):
        return _resized_model(state, args, chosen, lora, img_size)
    model = create_model(args.pop("name"), **args)
    if lora and has_lora_weights(chosen):  # a training checkpoint keeps the adapters unmerged
        apply_lora(model, **lora)
    if state.get("quantization"):
        model = apply_quantization(model.eval(), state["quantization"])
    try:
        model.load_state_dict(chosen)
    except RuntimeError as e:
        raise ValueError(f"checkpoint {state.get('path')} does not fit its saved model arguments: {e}") from None
    return merge_lora(model).eval()


def _resized_model(state: dict[str, Any], args: dict[str, Any], chosen: dict[str, torch.Tensor],
                   lora: dict[str, Any] | None, img_size: int) -> torch.nn.Module:
    """The checkpoint's model built for ``img_size`` px, its weights (adapters merged) fitted by the
    fine-tuning loader (eval mode, CPU). Raises ValueError (see :func:`model_from_checkpoint`)."""
    if state.get("quantization"):
        raise ValueError(f"checkpoint {state.get('path')} is quantized ({state['quantization']}): its weights "
                         "cannot be resampled to another input size; use the float checkpoint it came from")
    if lora and has_lora_weights(chosen):
        chosen = merge_lora_state_dict(chosen, lora["alpha"])
    model = create_model(**{**args, "img_size": int(img_size)})
    load_adapted(model, chosen, state.get("path", "checkpoint"))
    return model.eval()
