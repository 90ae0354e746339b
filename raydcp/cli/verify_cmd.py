"""``raydcp verify PATH [--json]``: read every byte of a checkpoint and check it.

Exit status 0 when the checkpoint is intact, 1 when it is damaged (the problems are listed on
stderr, each naming the key, file and byte range), 2 when it cannot be checked at all.
"""
from __future__ import annotations

import argparse

from ._common import (EXIT_FOUND, EXIT_OK, add_storage_options, print_json, progress_bar, safe, stderr, stdout,
                      storage_options)
from ._registry import Command, register

__all__ = ["COMMAND"]

_SHOWN = 20  # problems listed before "... and N more"


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory (local path or fsspec URL)")
    parser.add_argument("--json", action="store_true", help="print the report as JSON on stdout")
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    from ..storage import CheckpointStorage
    from ..verify import verify_checkpoint

    opts = storage_options(args)
    storage = CheckpointStorage(args.path, opts)
    if not storage.is_committed() and not storage.list_files("data/"):
        # no raydcp checkpoint there at all (a wrong path, another format): an error, exit 2; data
        # files without their metadata are a damaged checkpoint, reported below (exit 1)
        storage.read_metadata_bytes()
    with progress_bar("verify", enabled=not (args.no_progress or args.json or args.quiet)) as progress:
        report = verify_checkpoint(args.path, opts, progress=progress)
    escape = safe
    status = EXIT_OK if report.ok else EXIT_FOUND
    if args.json:
        print_json(report.to_dict())
        return status
    if report.ok:
        stdout().print(f"OK: {escape(report.summary())} ({report.seconds:.2f} s)")
        return status
    err = stderr()
    err.print(f"raydcp verify: DAMAGED: {escape(report.summary())}")
    lines = _lines(report.problems)
    for line in lines[:_SHOWN]:
        err.print(f"  - {escape(line)}")
    if len(lines) > _SHOWN:
        err.print(f"  ... and {len(lines) - _SHOWN} more (--json lists every problem)")
    return status


def _lines(problems) -> list[str]:
    """One line per problem, except one per missing file (naming the keys it held)."""
    missing: dict[str, list[str]] = {}
    entries: list[tuple[str, str]] = []  # ("text", line) or ("missing", file name)
    for p in problems:
        if p.kind != "missing-file":
            entries.append(("text", str(p)))
            continue
        if p.file not in missing:
            missing[p.file] = []
            entries.append(("missing", p.file))
        missing[p.file].append(p.key)
    lines = []
    for kind, text in entries:
        if kind == "missing":
            keys = sorted(set(missing[text]))
            shown = ", ".join(keys[:5]) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")
            text = f"{text}: the data file is missing ({len(missing[text])} pieces of {shown})"
        lines.append(text)
    return lines


COMMAND = register(Command(
    "verify", "check a checkpoint's metadata, tiling, data files and every checksum", configure, run,
    description="Read every stored piece (streaming, with bounded memory) and check its CRC32C, that "
                "each tensor's pieces tile it exactly and that every data file exists and is long "
                "enough. Exit status 0: intact; 1: damaged (every problem is listed); 2: error.",
))
