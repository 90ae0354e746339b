"""The registry of ``raydcp`` subcommands.

A subcommand is a module of this package that registers one :class:`Command` when imported:

    COMMAND = register(Command("status", "show a checkpoint's pipeline stages", configure, run))

and whose name is listed in ``BUILTIN_MODULES`` below (one line per subcommand). ``configure`` adds
the subcommand's arguments to its argparse parser; ``run`` gets the parsed arguments and returns
the exit status (see ``raydcp.cli._common`` for the conventions). Modules are imported on every
invocation to build the parser, so they import heavy or optional dependencies (Ray, torch DCP)
inside ``run``, never at module level. Every subcommand also takes ``-q/--quiet``,
``-v/--verbose`` and ``--debug`` (added by :func:`raydcp.cli.build_parser`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Callable

__all__ = ["Command", "register", "registered", "BUILTIN_MODULES"]

# The modules of raydcp.cli that register the built-in subcommands, imported in this order.
BUILTIN_MODULES: tuple[str, ...] = (
    "inspect_cmd",
    "verify_cmd",
    "convert_cmd",
    "diff_cmd",
    "status_cmd",
    "reshard_cmd",
    "ls_cmd",
    "mem_cmd",
)


@dataclass(frozen=True)
class Command:
    name: str
    help: str                                              # one line, shown in `raydcp --help`
    configure: Callable[[argparse.ArgumentParser], None]   # adds the subcommand's arguments
    run: Callable[[argparse.Namespace], int]               # returns the exit status
    description: str = ""                                  # longer text for `raydcp NAME --help`


_COMMANDS: dict[str, Command] = {}


def register(command: Command) -> Command:
    """Add ``command`` (a name may be registered once) and return it."""
    existing = _COMMANDS.get(command.name)
    if existing is not None and existing is not command:
        raise ValueError(f"raydcp subcommand {command.name!r} is registered twice")
    _COMMANDS[command.name] = command
    return command


def registered() -> dict[str, Command]:
    return dict(_COMMANDS)
