"""``raydcp ls ROOT [--json]``: the committed checkpoints directly under ROOT, oldest first.

Each row: the directory name, the step (the pipeline status record's, else the checkpoint's
plain value ``step``, else the number the name ends with), the tensors and their bytes (as
``raydcp inspect`` counts them), the commit time, and the pipeline state where a status record
(``raydcp.status.json``, written by ``raydcp.pipeline``) lies beside the checkpoint. A ROOT
that does not exist is an error (exit 2); one without checkpoints lists none (exit 0).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import re
from typing import Any

from ..errors import CheckpointError
from ._common import EXIT_OK, add_storage_options, human_bytes, print_json, safe, stderr, stdout, storage_options
from ._registry import Command, register

__all__ = ["COMMAND", "list_checkpoints"]

_TRAILING_NUMBER = re.compile(r"(\d+)$")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("root", help="a directory holding checkpoints (local path or fsspec URL)")
    parser.add_argument("--json", action="store_true", help="print the list as JSON on stdout")
    add_storage_options(parser)


def _step(name: str, md, record) -> int | None:
    if record is not None and record.step is not None:
        return record.step
    step = md.values.get("step") if md is not None else None
    if isinstance(step, int) and not isinstance(step, bool):
        return step
    m = _TRAILING_NUMBER.search(name)
    return int(m.group(1)) if m else None


def list_checkpoints(root: str, opts: dict | None) -> list[dict[str, Any]]:
    """One dict per committed checkpoint under ``root`` (CheckpointError if ``root`` does not exist)."""
    from ..engine import read_metadata
    from ..pipeline.records import read_record
    from ..storage import CheckpointStorage, list_committed
    from ..storage._common import open_fs

    fs, path, url = open_fs(root, opts, "root")
    try:
        exists = fs.isdir(path)
    except Exception as exc:
        raise CheckpointError(f"cannot list {url}: {type(exc).__name__}: {exc}") from None
    if not exists:
        raise CheckpointError(f"no directory at {url}: check the path")
    rows = []
    for c in list_committed(root, opts):
        row: dict[str, Any] = {"name": c.name, "url": c.url, "committed_at": c.committed_at}
        md = record = None
        try:
            md = read_metadata(c.url, opts)
        except CheckpointError as exc:
            row["error"] = str(exc)
        try:
            record = read_record(CheckpointStorage(c.url, opts))
        except CheckpointError as exc:
            row.setdefault("error", str(exc))
        row["step"] = _step(c.name, md, record)
        row["tensors"] = len(md.tensors) if md is not None else None
        row["pieces"] = sum(len(t.chunks) for t in md.tensors.values()) if md is not None else None
        row["bytes"] = md.total_bytes if md is not None else None
        row["world_size"] = md.world_size if md is not None else None
        row["pipeline_state"] = record.state if record is not None else None
        rows.append(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    rows = list_checkpoints(args.root, storage_options(args))
    if args.json:
        print_json({"root": args.root, "checkpoints": rows})
        return EXIT_OK
    out = stdout()
    if not rows:
        out.print(safe(f"{args.root}: no committed checkpoints"))
        return EXIT_OK
    table = Table(title=safe(f"{args.root}: {len(rows)} committed checkpoint{'s' if len(rows) != 1 else ''}"),
                  title_justify="left")
    for col, justify in (("name", "left"), ("step", "right"), ("tensors", "right"), ("size", "right"),
                         ("ranks", "right"), ("committed (UTC)", "left"), ("pipeline", "left")):
        table.add_column(col, justify=justify, overflow="fold" if col == "name" else "ellipsis")
    for r in rows:
        when = _dt.datetime.fromtimestamp(r["committed_at"], tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(safe(r["name"]), "-" if r["step"] is None else str(r["step"]),
                      "-" if r["tensors"] is None else str(r["tensors"]),
                      "-" if r["bytes"] is None else human_bytes(r["bytes"]),
                      "-" if r["world_size"] is None else str(r["world_size"]), when,
                      safe(r["pipeline_state"] or "-"))
    out.print(table)
    err = stderr()
    for r in rows:
        if "error" in r:
            err.print(safe(f"raydcp ls: {r['name']}: {r['error']}"))
    return EXIT_OK


COMMAND = register(Command(
    "ls", "list the committed checkpoints under a directory (step, size, time, pipeline state)", configure, run,
    description=__doc__.split("\n\n", 1)[1] if __doc__ else "",
))
