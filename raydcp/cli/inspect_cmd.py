"""``raydcp inspect PATH [--json]``: what a checkpoint holds, from its metadata alone."""
from __future__ import annotations

import argparse
import datetime as _dt
from typing import Any

from ._common import EXIT_OK, add_storage_options, human_bytes, print_json, read_metadata, safe, stdout, storage_options
from ._registry import Command, register

__all__ = ["COMMAND", "describe"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="checkpoint directory (local path or fsspec URL)")
    parser.add_argument("--json", action="store_true", help="print machine-readable JSON")
    add_storage_options(parser)


def _files(t) -> list[str]:
    return sorted({c.file for c in t.chunks})


def describe(path: str, md) -> dict[str, Any]:
    """The JSON form of ``inspect``: plain values use raydcp's tagged JSON (``codec.encode_value``)."""
    from ..codec import encode_value

    return {
        "path": path,
        "format_version": f"{md.version[0]}.{md.version[1]}",
        "save_id": md.save_id,
        "world_size": md.world_size,
        "created_at": md.created_at,
        "total_bytes": md.total_bytes,
        "stored_bytes": md.stored_bytes,
        "compressions": md.compressions,
        "owned_bytes": md.owned_bytes,
        "references": md.references,
        "files": md.files,
        "tensors": {
            key: {"shape": list(t.shape), "dtype": t.dtype, "pieces": len(t.chunks), "bytes": t.nbytes,
                  "files": _files(t)}
            for key, t in sorted(md.tensors.items())
        },
        "values": {key: encode_value(v) for key, v in sorted(md.values.items())},
        "extra": {key: encode_value(v) for key, v in sorted(md.extra.items())},
    }


def _short_files(names: list[str]) -> str:
    base = [n.rsplit("/", 1)[-1] for n in names]
    return ", ".join(base) if len(base) <= 2 else f"{base[0]} +{len(base) - 1} more"


def _value_text(v: Any, limit: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    url, md = read_metadata(args.path, storage_options(args))
    if args.json:
        print_json(describe(url, md))
        return EXIT_OK

    out = stdout()
    created = _dt.datetime.fromtimestamp(md.created_at, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
    esc = safe
    out.print(f"[bold]{esc(url)}[/bold]")
    out.print(f"format version {md.version[0]}.{md.version[1]}   save id {esc(md.save_id)}   "
              f"saved by world size {md.world_size}   created {created}")
    pieces = sum(len(t.chunks) for t in md.tensors.values())
    out.print(f"{len(md.tensors)} tensors in {pieces} pieces, {human_bytes(md.total_bytes)} ({md.total_bytes} bytes) "
              f"in {len(md.files)} data files; {len(md.values)} plain values")
    if md.references:
        bases = ", ".join(f"{human_bytes(n)} from {name}" for name, n in sorted(md.references.items()))
        out.print(f"delta checkpoint: owns {human_bytes(md.owned_bytes)} ({md.owned_bytes} bytes), "
                  f"references {esc(bases)}")
    if md.compressions:
        stored = md.stored_bytes
        codecs = ", ".join(f"{n} pieces {name}" for name, n in sorted(md.compressions.items()))
        out.print(f"compressed: {codecs}; stored in {human_bytes(stored)} ({stored} bytes, "
                  f"{stored / max(md.total_bytes, 1):.1%} of the raw bytes)")

    table = Table(title="Tensors", title_justify="left", show_footer=bool(md.tensors))
    table.add_column("key", overflow="fold", footer=f"total ({len(md.tensors)} tensors)")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("pieces", justify="right", footer=str(pieces))
    table.add_column("bytes", justify="right", footer=f"{md.total_bytes:,}")
    table.add_column("files", overflow="fold", footer=f"{len(md.files)} file{'' if len(md.files) == 1 else 's'}")
    for key, t in sorted(md.tensors.items()):
        table.add_row(esc(key), esc(str(list(t.shape))), esc(t.dtype), str(len(t.chunks)), f"{t.nbytes:,}",
                      esc(_short_files(_files(t))))
    out.print(table)

    if md.values:
        values = Table(title="Plain values", title_justify="left")
        values.add_column("key", overflow="fold")
        values.add_column("type")
        values.add_column("value", overflow="fold")
        for key, v in sorted(md.values.items()):
            values.add_row(esc(key), type(v).__name__, esc(_value_text(v)))
        out.print(values)
    return EXIT_OK


COMMAND = register(Command(
    "inspect", "show the tensors, plain values and layout of a checkpoint", configure, run,
    description="Read a checkpoint's metadata (no tensor data) and show every tensor's global shape, "
                "dtype, pieces, bytes and data files, with totals, the saving world size, the format "
                "version, the save id and the plain values.",
))
