"""Conventions shared by the subcommands: exit statuses, output, sizes, progress, storage options.

Exit statuses: 0 success; 1 the command worked and found a problem (``verify``: damage,
``diff``: differences); 2 an error (a :class:`raydcp.CheckpointError`, or bad arguments), shown as
one line on stderr; 3 an unexpected internal error (a bug), also one line unless ``--debug``.
Results go to stdout (``--json`` prints machine-readable JSON there); messages go to stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any, Callable, Iterator

from rich.console import Console

from ..errors import CheckpointError

__all__ = ["EXIT_OK", "EXIT_FOUND", "EXIT_ERROR", "EXIT_INTERNAL", "one_line", "stdout", "stderr",
           "print_json", "human_bytes", "add_storage_options", "storage_options", "progress_bar"]

EXIT_OK, EXIT_FOUND, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


def one_line(message: str) -> str:
    """A possibly multi-line message folded onto one line."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    if not lines:
        return ""
    head, rest = lines[0], lines[1:]
    return head + (" " + "; ".join(rest) if rest else "")


def _console(file) -> Console:
    # Tables and messages must not be cut at 80 columns when the output is a pipe or a file.
    tty = bool(getattr(file, "isatty", lambda: False)())
    return Console(file=file, highlight=False, width=None if tty else 200, soft_wrap=not tty)


def stdout() -> Console:
    return _console(sys.stdout)


def stderr() -> Console:
    return _console(sys.stderr)


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def add_storage_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--storage-options", metavar="JSON", default=None,
        help="fsspec filesystem options as a JSON object, e.g. '{\"endpoint_url\": \"http://127.0.0.1:9000\"}'",
    )


def storage_options(args: argparse.Namespace) -> dict | None:
    text = getattr(args, "storage_options", None)
    if text is None:
        return None
    try:
        opts = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"--storage-options is not valid JSON: {exc}") from None
    if not isinstance(opts, dict):
        raise CheckpointError("--storage-options must be a JSON object")
    return opts


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator[Callable[[int, int], None]]:
    """A ``progress(done_bytes, total_bytes)`` callback drawing a rich progress bar on stderr.

    The bar is drawn only when stderr is a terminal (and ``enabled``); otherwise the callback
    does nothing, so pipes, logs and tests see no control characters.
    """
    console = Console(file=sys.stderr)
    if not (enabled and console.is_terminal):
        yield lambda done, total: None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        task = bar.add_task(description, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update
