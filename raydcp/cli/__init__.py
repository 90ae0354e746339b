"""The ``raydcp`` command line: ``main(argv)`` and its subcommands.

Subcommands register themselves in :mod:`raydcp.cli._registry`; the modules listed in its
``BUILTIN_MODULES`` are imported to build the parser. To add one, write
``raydcp/cli/<name>_cmd.py`` registering a :class:`Command` and add the module to that list.
Exit statuses and output conventions: :mod:`raydcp.cli._common`.

What raydcp's loggers (``raydcp.*``) say goes to stderr for the length of a command: warnings
and errors by default, errors only with ``-q``, INFO with ``-v``, DEBUG with ``-vv``.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from ..errors import CheckpointError
from ._common import EXIT_ERROR, EXIT_INTERNAL, add_verbosity, logging_to_stderr, one_line, safe, storage_options
from ._registry import BUILTIN_MODULES, Command, register, registered

__all__ = ["main", "build_parser", "Command", "register", "BUILTIN_MODULES"]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    for module in BUILTIN_MODULES:
        importlib.import_module(f"{__name__}.{module}")
    parser = argparse.ArgumentParser(
        prog="raydcp", description="Inspect, verify, compare and convert raydcp checkpoints.",
        epilog="Exit status: 0 success; 1 damage (verify) or differences (diff) found; 2 error; "
               "3 internal error. Every PATH is a local path or an fsspec URL.",
    )
    parser.add_argument("--version", action="version", version=f"raydcp {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks of unexpected errors")
    add_verbosity(parser)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, cmd in registered().items():
        p = sub.add_parser(name, help=cmd.help, description=cmd.description or cmd.help)
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        add_verbosity(p, default=argparse.SUPPRESS)
        cmd.configure(p)
        p.set_defaults(_command=cmd)
    return parser


def _fail(status: int, message: str) -> int:
    try:
        sys.stderr.write(f"raydcp: error: {safe(one_line(message), markup=False)}\n")
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):
        pass
    return status


def _with_format_hint(exc: CheckpointError, args) -> BaseException:
    """A path without a raydcp checkpoint that holds another format: say which, and the command that converts it."""
    from ..convert.detect import with_format_hint

    try:
        options = storage_options(args)
    except CheckpointError:
        options = None
    return with_format_hint(exc, options)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (the console script exits with it)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_ERROR
    command: Command = args._command
    try:
        with logging_to_stderr(args.quiet, args.verbose):
            return command.run(args)
    except CheckpointError as exc:
        return _fail(EXIT_ERROR, str(_with_format_hint(exc, args)))
    except KeyboardInterrupt:
        return _fail(130, "interrupted")
    except BrokenPipeError:  # stdout closed early (| head): not an error of the command
        return EXIT_ERROR
    except Exception as exc:
        if args.debug:
            raise
        return _fail(EXIT_INTERNAL, f"unexpected {type(exc).__name__} in `raydcp {command.name}`: {exc} "
                                    "(a bug in raydcp: rerun with --debug for the traceback and report it)")
