"""The command-line options shared by ``raydcp reshard`` and ``jobs/reshard.py``."""
from __future__ import annotations

import argparse
import json

from ..convert.keys import add_key_arguments, key_selection_from_args
from ..errors import CheckpointError

__all__ = ["LAYOUTS", "add_reshard_arguments", "add_save_arguments", "save_options_from_args", "options_from_args",
           "storage_options_from_args"]

# here rather than in .plan so that building the parser imports no torch (`raydcp --help`)
LAYOUTS = ("dim0", "dim1", "replicated")
COMPRESSION_CHOICES = ("none", "zstd", "lz4")  # raydcp.metadata.COMPRESSIONS, and none


def add_reshard_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the committed raydcp checkpoint to reshard (local path or fsspec URL)")
    parser.add_argument("dst", help="where to write the resharded checkpoint")
    parser.add_argument("--world-size", "-M", type=int, required=True, metavar="M",
                        help="the number of ranks the destination is laid out for")
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="how each tensor is split among the M ranks: dim0 (default; FSDP-style rows), "
                             "dim1 (columns, tensor-parallel style) or replicated (written once)")
    parser.add_argument("--consolidate", action="store_true",
                        help="store every tensor whole, as one piece (each held by one of the M ranks)")
    add_key_arguments(parser)
    parser.add_argument("--memory-budget", default="1GiB", metavar="SIZE",
                        help="tensor bytes one process holds at a time (default 1GiB); the work is cut into "
                             "rounds that fit, a tensor larger than that into blocks of rows")
    add_save_arguments(parser, "largest data file a rank writes per round (default 256MiB)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace a checkpoint DST already holds (it stays loadable until the new one commits)")
    parser.add_argument("--timeout", type=float, default=600.0, metavar="S",
                        help="seconds a rank waits for the others at any step before failing (default 600)")
    parser.add_argument("--storage-options", metavar="JSON", default=None,
                        help="fsspec options for SRC and DST, as a JSON object")
    parser.add_argument("--src-storage-options", metavar="JSON", default=None,
                        help="fsspec options for SRC only (overrides --storage-options)")
    parser.add_argument("--dst-storage-options", metavar="JSON", default=None,
                        help="fsspec options for DST only (overrides --storage-options)")


def add_save_arguments(parser: argparse.ArgumentParser, file_help: str) -> None:
    """The options of the raydcp checkpoint a command writes (:class:`raydcp.SaveOptions`)."""
    parser.add_argument("--max-file-bytes", "--max-file-size", dest="max_file_bytes", default=None, metavar="SIZE",
                        help=f"{file_help}; e.g. 64MiB, 1GB")
    parser.add_argument("--compression", choices=COMPRESSION_CHOICES, default=None,
                        help="compress each piece of the raydcp checkpoint written with this codec (pieces that do "
                             "not shrink stay raw; default none)")


def _compression(args: argparse.Namespace) -> str | None:
    return None if args.compression in (None, "none") else args.compression


def save_options_from_args(args: argparse.Namespace):
    """The :class:`raydcp.SaveOptions` the parsed arguments ask for (None: the defaults)."""
    from ..convert import parse_size
    from ..options import MAX_FILE_BYTES, SaveOptions

    if args.max_file_bytes is None and _compression(args) is None:
        return None
    max_file = MAX_FILE_BYTES if args.max_file_bytes is None else parse_size(args.max_file_bytes)
    return SaveOptions(max_file_bytes=max_file, compression=_compression(args))


def options_from_args(args: argparse.Namespace):
    """The :class:`raydcp.reshard.plan.ReshardOptions` the parsed arguments ask for."""
    from ..convert import parse_size
    from .plan import ReshardOptions

    if args.consolidate and args.layout is not None:
        raise CheckpointError("--consolidate stores whole tensors: it cannot be combined with --layout")
    keys = key_selection_from_args(args)
    return ReshardOptions(world_size=args.world_size, layout=args.layout or "dim0", dtype=keys.dtype,
                          drop_optimizer=keys.drop_optimizer, drop_prefixes=keys.drop_prefixes,
                          strip_prefixes=keys.strip_prefixes, dtype_all=keys.dtype_all,
                          consolidate=args.consolidate, memory_budget=parse_size(args.memory_budget),
                          max_file_bytes=parse_size(args.max_file_bytes or "256MiB"), compression=_compression(args))


def _json_object(text: str | None, flag: str) -> dict | None:
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{flag} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{flag} must be a JSON object")
    return value


def storage_options_from_args(args: argparse.Namespace) -> tuple[dict | None, dict | None]:
    """``(SRC options, DST options)``."""
    both = _json_object(args.storage_options, "--storage-options")
    src = _json_object(args.src_storage_options, "--src-storage-options")
    dst = _json_object(args.dst_storage_options, "--dst-storage-options")
    return (src if src is not None else both), (dst if dst is not None else both)
