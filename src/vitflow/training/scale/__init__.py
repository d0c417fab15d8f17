"""Training on more than one process: :mod:`.distributed` (DDP / FSDP2 under torchrun) and
:mod:`.elastic` (several nodes, elastic restarts, SLURM)."""
