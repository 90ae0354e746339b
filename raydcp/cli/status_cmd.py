"""``raydcp status PATH [--json] [--verify]``: where a checkpoint stands in its pipeline.

PATH is any copy of a pipeline checkpoint (``<tier>/NAME``). Shows the freshest status record
found in its copies: the stage per tier with state, duration, bytes and throughput, and a live
check of every copy the record calls committed (sizes by default, every checksum with
``--verify``). Exit status 0: every stage done or running and every copy intact; 1: a stage
failed or a copy is missing or damaged; 2: PATH holds no checkpoint or record.
"""
from __future__ import annotations

import argparse
import datetime as _dt

from ._common import EXIT_FOUND, EXIT_OK, add_storage_options, human_bytes, print_json, stdout, storage_options
from ._registry import Command, register

__all__ = ["COMMAND"]


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a copy of a checkpoint (local path or fsspec URL)")
    parser.add_argument("--json", action="store_true", help="print the record and the checks as JSON on stdout")
    parser.add_argument("--verify", action="store_true", help="read every piece of each copy and check its CRC32C")
    add_storage_options(parser)


def run(args: argparse.Namespace) -> int:
    from ..convert.detect import hint_for_url
    from ..errors import CheckpointError
    from ..pipeline.check import inspect_pipeline

    try:
        report = inspect_pipeline(args.path, storage_options(args), full=args.verify)
    except CheckpointError:
        hint = hint_for_url(args.path, storage_options(args))  # a torch DCP, safetensors, torch.save path
        if hint:
            raise CheckpointError(hint) from None
        raise
    status = EXIT_OK if report.ok else EXIT_FOUND
    if args.json:
        print_json(report.to_dict())
        return status
    _print(report)
    return status


def _print(report) -> None:
    from rich.table import Table

    from ._common import safe as escape

    out = stdout()
    r = report.record
    if r is None:
        c = report.checks[0]
        out.print(f"{escape(report.path)}: {escape('; '.join(report.notes))}")
        out.print(f"copy: {c.live}" + (f" ({escape('; '.join(c.problems[:5]))})" if c.problems else ""))
        return
    when = _dt.datetime.fromtimestamp(r.updated_at or r.created_at).isoformat(timespec="seconds")
    step = f", step {r.step}" if r.step is not None else ""
    out.print(f"[bold]{escape(r.name)}[/bold] (seq {r.seq}{step}, save {r.save_id or '-'}): "
              f"{_state(r.state)}, {human_bytes(r.bytes)} in {r.files} files, record revision {r.revision} ({when})")
    tiers = Table(title="copies", title_justify="left")
    for col in ("tier", "url", "recorded", "now"):
        tiers.add_column(col)
    for c in report.checks:
        live = c.live if not c.problems else f"{c.live}: {'; '.join(c.problems[:3])}"
        if len(c.problems) > 3:
            live += f" (and {len(c.problems) - 3} more)"
        tiers.add_row(str(c.tier), escape(c.url), c.recorded or "-", escape(live) + (" (checksums read)" if c.full else ""))
    out.print(tiers)
    stages = Table(title="stages", title_justify="left")
    for col, justify in (("stage", "left"), ("tier", "right"), ("state", "left"), ("seconds", "right"),
                         ("bytes", "right"), ("throughput", "right"), ("tries", "right"), ("detail", "left")):
        stages.add_column(col, justify=justify)
    for e in r.stages:
        tput = f"{human_bytes(int(e.throughput))}/s" if e.throughput else "-"
        detail = e.error if e.error else (e.detail or "")
        stages.add_row(e.stage if e.stage != "hook" else f"hook {e.detail}", "-" if e.tier is None else str(e.tier),
                       _state(e.state), "-" if e.seconds is None else f"{e.seconds:.3f}",
                       human_bytes(e.bytes) if e.bytes else "-", tput, str(e.attempts), escape(detail))
    out.print(stages)
    for note in report.notes:
        out.print(f"note: {escape(note)}")


def _state(state: str) -> str:
    color = {"done": "green", "complete": "green", "running": "yellow", "pending": "dim",
             "failed": "red", "blocked": "red", "skipped": "dim"}.get(state)
    return f"[{color}]{state}[/{color}]" if color else state


COMMAND = register(Command(
    "status", "show where a checkpoint stands in its pipeline (stages per tier, sizes, durations)", configure, run,
    description="Read the status record of a checkpoint saved through raydcp.pipeline.CheckpointPipeline "
                "(the freshest copy over its tiers) and check each copy it calls committed. Exit status 0: "
                "every stage done or running and every copy intact; 1: a failed stage or a missing or "
                "damaged copy; 2: error.",
))
