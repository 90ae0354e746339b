"""``raydcp convert SRC DST --to FORMAT`` and ``raydcp convert SRC DST --from FORMAT``."""
from __future__ import annotations

import argparse
import time

from ..errors import CheckpointError
from ._common import EXIT_OK, add_storage_options, human_bytes, print_json, progress_bar, safe, stderr, stdout, \
    storage_options
from ._registry import Command, register

__all__ = ["COMMAND"]

TO_FORMATS = ("torch-dcp", "safetensors", "torch-save")
FROM_FORMATS = ("torch-dcp", "safetensors", "torch-save")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("src", help="the checkpoint to convert (local path or fsspec URL)")
    parser.add_argument("dst", help="where to write the converted checkpoint")
    way = parser.add_mutually_exclusive_group(required=True)
    way.add_argument("--to", choices=TO_FORMATS, help="convert the raydcp checkpoint SRC to this format")
    way.add_argument("--from", dest="from_", choices=FROM_FORMATS,
                     help="convert SRC, in this format, to a raydcp checkpoint")
    parser.add_argument("--max-shard-size", metavar="SIZE", default=None,
                        help="safetensors: largest shard, e.g. 5GB (the default), 100MB, 512MiB")
    parser.add_argument("--memory-budget", metavar="SIZE", default="1GiB",
                        help="torch-dcp and torch-save: bytes of tensors loaded at a time (default 1GiB; "
                             "a larger tensor is loaded alone)")
    from ..convert.keys import add_key_arguments
    from ..reshard.args import add_save_arguments

    add_key_arguments(parser)
    add_save_arguments(parser, "--from: largest data file of the raydcp checkpoint (default 256MiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace what DST already holds")
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    parser.add_argument("--json", action="store_true", help="print what was written as JSON")
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    from .. import convert
    from ..convert.keys import key_selection_from_args
    from ..reshard.args import save_options_from_args

    opts = storage_options(args)
    select = key_selection_from_args(args)
    if args.max_shard_size is not None and args.to != "safetensors":
        raise CheckpointError("--max-shard-size applies only to --to safetensors")
    for flag, value in (("--max-file-bytes", args.max_file_bytes), ("--compression", args.compression)):
        if args.to is not None and value is not None:
            raise CheckpointError(f"{flag} applies only to --from (writing a raydcp checkpoint), not --to {args.to}")
    save_options = save_options_from_args(args)
    budget = convert.parse_size(args.memory_budget)
    fmt = args.to or f"raydcp (from {args.from_})"
    t0 = time.perf_counter()
    with progress_bar(f"convert to {args.to or 'raydcp'}", enabled=not (args.no_progress or args.quiet)) as progress:
        common = dict(storage_options=opts, overwrite=args.overwrite, progress=progress)
        if args.from_ == "torch-dcp":
            if not select.identity:
                raise CheckpointError("--from torch-dcp copies every key as it is: reshard the result to drop, "
                                      "rename or cast keys (`raydcp reshard DST OUT -M 1 --drop-optimizer ...`)")
            result = convert.from_torch_dcp(args.src, args.dst, options=save_options, **common)
        elif args.from_ == "safetensors":
            result = convert.from_safetensors(args.src, args.dst, select=select, options=save_options, **common)
        elif args.from_ == "torch-save":
            result = convert.from_torch_save(args.src, args.dst, select=select, options=save_options, **common)
        elif args.to == "torch-dcp":
            result = convert.to_torch_dcp(args.src, args.dst, budget_bytes=budget, select=select, **common)
        elif args.to == "safetensors":
            shard = convert.parse_size(args.max_shard_size or "5GB")
            result = convert.to_safetensors(args.src, args.dst, max_shard_bytes=shard, select=select, **common)
        else:
            result = convert.to_torch_save(args.src, args.dst, budget_bytes=budget, select=select, **common)
    seconds = time.perf_counter() - t0
    if args.json:
        print_json({"src": result.src, "dst": result.dst, "format": result.fmt, "tensors": result.tensors,
                    "values": result.values, "bytes": result.nbytes, "files": result.files,
                    "dropped": result.dropped, "skipped": result.skipped, "seconds": round(seconds, 6)})
    else:
        dropped = f", {result.dropped} keys dropped" if result.dropped else ""
        stdout().print(safe(
            f"converted {result.src} -> {result.dst} ({fmt}): {result.tensors} tensors "
            f"({human_bytes(result.nbytes)}), {result.values} plain values{dropped} in {seconds:.2f} s"))
    if result.skipped and not args.quiet:  # entries left out of the conversion (--json lists them too)
        err = stderr()
        for key, why in sorted(result.skipped.items()):
            err.print(safe(f"raydcp convert: skipped {key}: {why}"))
    return EXIT_OK


COMMAND = register(Command(
    "convert", "convert to or from torch DCP, safetensors or torch.save", configure, run,
    description="--to torch-dcp writes DCP's default layout, one __R_0.distcp file per saving rank and "
                "the .metadata (torch's dcp.load reads it); --to "
                "safetensors writes Hugging Face style model-0000i-of-0000N.safetensors shards and "
                "model.safetensors.index.json; --to torch-save writes one torch.save file of a flat "
                "{fqn: tensor or value} dict; --from torch-dcp reads a DCP checkpoint (its metadata "
                "only through a restricted unpickler), --from safetensors a Hugging Face model folder (with "
                "or without its index) or one .safetensors file, --from torch-save a torch.save file of a dict "
                "(torch.load with weights_only=True), and saves it as a raydcp checkpoint. --drop-optimizer, "
                "--drop, --strip-prefix and --dtype (the model's floating tensors; --dtype-all for the "
                "optimizer's too, never its step) choose what is written, as for `raydcp reshard`.",
))
