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
import logging
import re
import sys
from typing import Any, Iterator

from rich.console import Console

from ..errors import CheckpointError

__all__ = ["EXIT_OK", "EXIT_FOUND", "EXIT_ERROR", "EXIT_INTERNAL", "one_line", "stdout", "stderr",
           "print_json", "human_bytes", "add_storage_options", "storage_options", "progress_bar", "safe",
           "Progress", "read_metadata", "add_verbosity", "logging_to_stderr"]

EXIT_OK, EXIT_FOUND, EXIT_ERROR, EXIT_INTERNAL = 0, 1, 2, 3


# C0 controls (but tab), DEL, C1 controls, and the bidirectional overrides that reorder what follows
_UNSAFE = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def safe(text: Any, markup: bool = True) -> str:
    """``text`` made harmless for a terminal (and, with ``markup``, for rich): control characters
    (escape sequences in a key name) shown as ``\\x1b``-style escapes, rich markup escaped."""
    text = _UNSAFE.sub(lambda m: ascii(m.group())[1:-1], str(text))
    if not markup:
        return text
    from rich.markup import escape

    return escape(text)


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


def read_metadata(path: str, opts: dict | None):
    """``(url, metadata)`` of the checkpoint at ``path``: its metadata alone, decoded without torch."""
    from ..metadata_format import decode_metadata
    from ..storage import METADATA_NAME, CheckpointStorage

    storage = CheckpointStorage(path, opts)
    return storage.url, decode_metadata(storage.read_metadata_bytes(), storage.file_url(METADATA_NAME))


def add_verbosity(parser: argparse.ArgumentParser, default=None) -> None:
    """``-q/--quiet`` and ``-v/--verbose`` (repeatable). The top-level parser sets the defaults; a
    subcommand's parser takes them too (``default=argparse.SUPPRESS`` there keeps a flag given
    before the subcommand)."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("-q", "--quiet", action="store_true", default=default if default is not None else False,
                       help="print results and errors only: no warnings, progress or per-step messages")
    group.add_argument("-v", "--verbose", action="count", default=default if default is not None else 0,
                       help="also print what raydcp's loggers say at INFO (-vv: DEBUG)")


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = safe(one_line(record.getMessage()), markup=False)
        if record.levelno < logging.WARNING:  # -v: which part of raydcp speaks
            return f"raydcp: {record.levelname.lower()}: [{record.name}] {text}"
        return f"raydcp: {record.levelname.lower()}: {text}"


@contextlib.contextmanager
def logging_to_stderr(quiet: bool = False, verbose: int = 0) -> Iterator[None]:
    """For one command: what the ``raydcp`` loggers say at WARNING and above (ERROR with
    ``quiet``, INFO with ``verbose``, DEBUG with ``verbose >= 2``) goes to stderr, one line each.
    The logger's level and handlers are restored afterwards."""
    level = logging.ERROR if quiet else logging.DEBUG if verbose >= 2 else logging.INFO if verbose else logging.WARNING
    logger = logging.getLogger("raydcp")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    handler.setLevel(level)
    saved = logger.level
    logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


class Progress:
    """What :func:`progress_bar` yields: ``progress(done, total)`` moves the bar, ``progress.log(msg)``
    prints a message above it (on stderr; plain when there is no bar)."""

    def __init__(self, bar=None, task=None, console: Console | None = None):
        self._bar, self._task = bar, task
        self._console = console or stderr()

    def __call__(self, done: int, total: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done, total=total)

    def log(self, message: str) -> None:
        self._console.print(safe(message), highlight=False)


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator[Progress]:
    """A :class:`Progress` drawing one live rich progress bar on stderr, messages printed above it.

    The bar is drawn only when stderr is a terminal (and ``enabled``); otherwise moving it does
    nothing, so pipes, logs and tests see no control characters.
    """
    console = Console(file=sys.stderr, highlight=False)
    if not (enabled and console.is_terminal):
        yield Progress()
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress as Bar, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    with Bar(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(binary_units=True),
             TransferSpeedColumn(), TimeRemainingColumn(), console=console, transient=True) as bar:
        yield Progress(bar, bar.add_task(description, total=None), bar.console)
