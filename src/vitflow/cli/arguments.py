"""Arguments several ``vitflow`` commands share (the config options, the checkpoint and weights
choice, test-time augmentation, verbosity) and argparse value types."""

from __future__ import annotations

import argparse
import logging


def config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", help="named recipe (see `vitflow presets`); default digits-vit-tiny")
    p.add_argument("--config", metavar="FILE.yaml", help="YAML file of sections applied over the preset")
    p.add_argument("--print-config", action="store_true", help="print the resolved config and exit")


def weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weights", choices=["auto", "ema", "raw"], default="auto",
                   help="auto: the EMA weights when the checkpoint has them (default), else the trained ones")


def checkpoint_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", dest="which", metavar="best|last|PATH",
                   help="which checkpoint of a run directory: last (the newest, default), best (train.keep_best's "
                   "checkpoints/best.pt) or a file")


def merge_count(text: str) -> int | str:
    """argparse type: ``auto`` or a whole number of tokens >= 1 (token merging's ``r``)."""
    return text if text == "auto" else positive(text)


def positive(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (got {value})")
    return value


def verbosity(p: argparse.ArgumentParser, default) -> None:
    """``-v`` / ``-q``, accepted before and after the command (``default`` is SUPPRESS on the
    commands, so that they do not reset a value given before them)."""
    g = p.add_mutually_exclusive_group()
    g.add_argument("-v", "--verbose", dest="log_level", action="store_const", const=logging.DEBUG, default=default,
                   help="also vitflow's debug lines (each cpu_bf16_matmul=auto timing, the num_workers=auto probe)")
    g.add_argument("-q", "--quiet", dest="log_level", action="store_const", const=logging.WARNING, default=default,
                   help="warnings and errors only (no info lines, no progress bars)")


def retime_arg(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--retime", action="store_true", help="make the choices made by timing again (fp32 GEMM, "
                   f"attention and bf16 GEMM per shape, precision=auto), {what}")


def tta_arg(p: argparse.ArgumentParser, what: str = "average the probabilities over test-time views") -> None:
    p.add_argument("--tta", metavar="SPEC", help=f"{what}: flip, crops5, scales=S1,S2,... (last), comma-joined, "
                   "e.g. flip,crops5 (10 views); default none")
