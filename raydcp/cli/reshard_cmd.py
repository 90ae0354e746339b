"""``raydcp reshard SRC DST --world-size M``: the reshard job's engine, in this process."""
from __future__ import annotations

import argparse

from ._common import EXIT_OK, human_bytes, print_json, progress_bar, safe, stdout
from ._registry import Command, register

__all__ = ["COMMAND"]


def configure(parser: argparse.ArgumentParser) -> None:
    from ..reshard.args import add_reshard_arguments

    add_reshard_arguments(parser)
    parser.add_argument("--no-progress", action="store_true", help="do not draw a progress bar")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args: argparse.Namespace) -> int:
    from ..reshard import reshard
    from ..reshard.args import options_from_args, storage_options_from_args

    options = options_from_args(args)
    src_opts, dst_opts = storage_options_from_args(args)
    escape = safe
    with progress_bar("reshard", enabled=not (args.no_progress or args.quiet)) as progress:
        say = None if args.quiet else (lambda msg: progress.log(f"raydcp reshard: {msg}"))  # above the bar
        result = reshard(args.src, args.dst, options, src_storage_options=src_opts, dst_storage_options=dst_opts,
                         overwrite=args.overwrite, timeout_s=args.timeout, progress=progress, log=say)
    if args.json:
        print_json(result.to_json())
    elif result.noop:
        stdout().print(escape(f"{result.dst} already holds this reshard of {result.src}: nothing to do"))
    else:
        rate = result.nbytes / result.seconds if result.seconds > 0 else 0.0
        resumed = f", {result.resumed_rounds} resumed" if result.resumed_rounds else ""
        stdout().print(escape(
            f"resharded {result.src} ({result.source_world_size} ranks) -> {result.dst} ({result.world_size} ranks, "
            f"{result.layout}): {result.tensors} tensors ({human_bytes(result.nbytes)}), {result.values} plain values"
            f"{f', {result.dropped} keys dropped' if result.dropped else ''} in {result.rounds} rounds{resumed}, "
            f"{result.seconds:.2f} s ({human_bytes(int(rate))}/s)"))
    return EXIT_OK


COMMAND = register(Command(
    "reshard", "rewrite a checkpoint for M ranks (layout, dtype, fewer keys), streaming", configure, run,
    description="Reads SRC and writes DST laid out for --world-size M ranks, in rounds of at most "
                "--memory-budget bytes of tensors (all M ranks run as threads of this process); DST's "
                "metadata commits once, at the end. Rerunning after a failure resumes; rerunning after "
                "success does nothing. On a Ray cluster run the same engine with jobs/reshard.py.",
))
