"""``vitflow <command>``: parses arguments, builds the config, calls one layer. Nothing else.

:mod:`.parser` defines the commands' arguments, :mod:`.commands` runs them; :func:`main` sets up
logging, keeps ``--json`` output pipeable and turns the errors users can fix into one line.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from typing import Sequence

from vitflow.checkpoint import CheckpointWriteError
from vitflow.cli.commands import COMMANDS, CONFIG_CHECKS
from vitflow.cli.parser import build_parser
from vitflow.config import ConfigError

__all__ = ["CONFIG_CHECKS", "build_parser", "main"]


def parse_args(argv: Sequence[str] | None = None):
    """The parsed arguments; ``key=value`` overrides are taken wherever they stand on the line
    (``vitflow train --json train.total_steps=500 --print-config``), not only before the flags."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:  # told by the command's own parser: "see vitflow train --help", not "see vitflow --help"
        _command_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if getattr(args, "retime", False):  # train / resume --retime
        args.overrides = [*args.overrides, "train.retime=true"]
    return args


def _command_parser(parser, command: str):
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices.get(command, parser)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    level = logging.WARNING if os.environ.get("RANK", "0") != "0" else args.log_level  # other ranks: warnings only
    logging.basicConfig(level=max(level, logging.INFO), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    vitflow_log, previous = logging.getLogger("vitflow"), logging.getLogger("vitflow").level
    if level != logging.INFO:
        vitflow_log.setLevel(level)  # -v: vitflow's debug lines, not every library's
    # file names that are not valid UTF-8 travel as surrogate escapes: JSON and CSV write them as \\xNN
    # (vitflow.cli.outputs.escaped: valid UTF-8, with the exact bytes beside); stdout's other lines as their
    # original bytes, stderr as \\xNN (a message never fails to print)
    for stream, errors in ((sys.stdout, "surrogateescape"), (sys.stderr, "backslashreplace")):
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors=errors)
    json_only = getattr(args, "json", False) and args.command != "predict"  # predict --json: one line per image
    args.json_stdout = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr) if json_only else contextlib.nullcontext():
            return COMMANDS[args.command](args)
    except CheckpointWriteError as e:  # a disk full or failing: the run stopped, its checkpoints are intact
        if args.debug or os.environ.get("VITFLOW_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConfigError, ValueError, FileNotFoundError, FileExistsError) as e:
        if args.debug or os.environ.get("VITFLOW_DEBUG"):
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        from vitflow.infer.runtimes.onnx import UnavailableError  # a target this machine cannot serve

        if not isinstance(e, UnavailableError) or args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 3
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        vitflow_log.setLevel(previous)
