"""Data-parallel training on ``torch.distributed``: process-group set-up from torchrun's
environment, DDP or FSDP2 wrapping, gradient-sync control for accumulation, full state dicts
for rank-0 checkpoints, and the few collectives the trainer needs.

Launch (one node, N processes; ``vitflow train --nproc N`` runs exactly this)::

    torchrun --standalone --nproc-per-node N -m vitflow train [--preset P] [key=value ...]

Every rank builds the same model from the same seed, reads its shard of each epoch
(:class:`vitflow.data.EpochSampler` with ``rank, world_size``) and ``train.batch_size`` stays
the *global* batch: each rank runs micro-batches of ``batch_size / (accum_steps * world_size)``.
DDP (Li et al. 2020) averages gradients across ranks in the backward pass (NCCL on CUDA, gloo on
CPU); FSDP2 (``torch.distributed.fsdp.fully_shard``, one unit per block plus the root) shards
parameters, gradients and optimizer state for models that do not fit one device.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from vitflow import timing
from vitflow.models.kernels import onednn
from vitflow.runtime import Precision, resolve_precision
from vitflow.training.scale.elastic import adopt_slurm_env


@dataclass(frozen=True)
class DistEnv:
    """This process's place in the job (``rank 0 of 1`` when not launched by torchrun)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over ranks, in place; returns it (unchanged in a single process)."""
        if self.enabled:
            dist.all_reduce(t)
        return t

    def mean(self, t: torch.Tensor) -> torch.Tensor:
        """The mean of a tensor over ranks (a new tensor; ``t`` itself in a single process)."""
        return self.all_reduce_sum(t.clone()) / self.world_size if self.enabled else t

    def any(self, flag: bool, device: torch.device) -> bool:
        """True on every rank when ``flag`` is true on any rank."""
        if not self.enabled:
            return flag
        return bool(self.all_reduce_sum(torch.tensor([float(flag)], device=device)).item() > 0)

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (picklable objects)."""
        if not self.enabled:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (tensors, containers and plain values that ``torch.load``
        accepts with ``weights_only=True``), in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        buf = io.BytesIO()
        torch.save(obj, buf)  # all_gather_object cannot carry tensors' storages (torch 2.14)
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, buf.getvalue())
        return [torch.load(io.BytesIO(b), weights_only=True) for b in out]


def init_distributed(device: str = "auto") -> DistEnv:
    """Join the job torchrun started, from its environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; in a task srun started without torchrun,
    from Slurm's: :func:`vitflow.training.scale.elastic.slurm_env`): NCCL when this rank uses CUDA, else
    gloo. Without ``WORLD_SIZE > 1``: a single-process :class:`DistEnv`, no process group."""
    adopt_slurm_env()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistEnv()
    env = DistEnv(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        cuda = device != "cpu" and not device.startswith("mps") and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(env.local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    return env


def rank_device(device: torch.device, env: DistEnv) -> torch.device:
    """``cuda`` without an index becomes ``cuda:LOCAL_RANK`` in a distributed job."""
    if env.enabled and device.type == "cuda" and device.index is None:
        return torch.device("cuda", env.local_rank)
    return device


def shutdown(env: DistEnv) -> None:
    """Leave the process group (after the last collective); choices made by timing are each
    process's own again, read from the cache again (``train.retime`` ends with the run)."""
    timing.set_agreement(None)
    timing.set_retime(False)
    if env.enabled and dist.is_initialized():
        dist.destroy_process_group()


class Parallel:
    """How the model is replicated: ``none`` (one process), ``ddp`` or ``fsdp``.

    Raises (at construction):
        ValueError: an unknown ``kind``.
    """

    def __init__(self, env: DistEnv, kind: str, device: torch.device):
        if kind not in ("ddp", "fsdp"):
            raise ValueError(f"train.distributed must be ddp or fsdp, got {kind!r}")
        self.env, self.device = env, device
        self.kind = kind if env.enabled else "none"
        self._ddp: torch.nn.parallel.DistributedDataParallel | None = None
        self._model: torch.nn.Module | None = None

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The module to call in training: ``model`` itself, its DDP wrapper, or ``model``
        sharded in place by ``fully_shard`` (each block, then the root)."""
        self._model = model
        if self.kind == "ddp":
            ids = [self.device.index] if self.device.type == "cuda" else None
            self._ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
            return self._ddp
        if self.kind == "fsdp":
            from torch.distributed.fsdp import fully_shard

            for block in model.blocks:
                fully_shard(block)
            fully_shard(model)
        return model

    @contextlib.contextmanager
    def sync_grads(self, enabled: bool):
        """Within the block, average gradients across ranks in backward only if ``enabled``
        (off for all but the last micro-batch of an accumulated step: one all-reduce per step)."""
        if self.kind == "ddp" and not enabled:
            with self._ddp.no_sync():
                yield
        elif self.kind == "fsdp" and not enabled:
            self._model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self._model.set_requires_gradient_sync(True)
        else:
            yield

    def _options(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        return StateDictOptions(full_state_dict=True, cpu_offload=True)

    def model_state(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The full (unsharded) state dict; under FSDP a collective, complete on rank 0 only."""
        if self.kind != "fsdp":
            return model.state_dict()
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(model, options=self._options())

    def optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
        """The optimizer's full state dict (FSDP: keyed by parameter names; a collective)."""
        if self.kind != "fsdp":
            return optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer, options=self._options())

    def load_optimizer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Load what :meth:`optimizer_state` returned (every rank passes the full dict).

        Raises:
            ValueError: the state was saved under another ``train.distributed`` mode.
        """
        keys = list(state.get("state", {}))
        if keys and isinstance(keys[0], str) != (self.kind == "fsdp"):
            raise ValueError("the checkpoint's optimizer state was saved " + ("under" if isinstance(keys[0], str)
                             else "without") + " FSDP; resume with the same train.distributed mode")
        if self.kind != "fsdp":
            optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


def micro_batch(batch_size: int, accum_steps: int, world_size: int) -> int:
    """Images per micro-batch on each rank: the global ``batch_size`` over ``accum_steps`` x ranks.

    Raises:
        ValueError: it does not divide evenly.
    """
    if batch_size % (accum_steps * world_size):
        raise ValueError(f"train.batch_size={batch_size} is not divisible by train.accum_steps={accum_steps} "
                         f"x {world_size} process(es)")
    return batch_size // (accum_steps * world_size)


def torchrun_command(nproc: int, argv: list[str]) -> list[str]:
    """The command ``vitflow train --nproc N ...`` replaces itself with: a single-node torchrun
    (``--standalone``: a local rendezvous on a free port) of ``python -m vitflow <argv>``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            "-m", "vitflow", *argv]


def run_precision(name: str, device: torch.device, dist: DistEnv) -> Precision:
    """``train.precision`` resolved for ``device``. The timed numeric choices on a CPU (``auto``
    precision, the fp32 GEMM of :mod:`vitflow.models.kernels.onednn`, made here under torchrun) are
    :mod:`vitflow.timing`'s: a resumed run's recorded ones, else the machine's cached ones, else
    timed; under torchrun rank 0's on every rank (:func:`vitflow.timing.set_agreement`), so that
    all ranks train alike."""
    if device.type == "cpu":
        onednn.fp32_mode()  # a bad VITFLOW_FP32_GEMM fails here, before the run folder is made
        if dist.enabled:
            onednn.fp32_gemm()  # chosen now, while every rank is here
    elif name == "auto":  # not timed: the device's kind
        name = dist.broadcast(resolve_precision("auto", device).name if dist.is_main else None)
    return resolve_precision(name, device)
