"""``raydcp mem ls|rm|usage|stop``: operate the memory tier (``raymem://``) of a Ray cluster.

- ``ls [NAME]``: the checkpoints held in memory, by NAME: step, size, copies, commit time (or
  "uncommitted": a save in flight, or one that failed and is not released yet);
- ``rm URL...``: remove ``raymem://NAME`` (everything under it) or ``raymem://NAME/PATH`` (one
  checkpoint); nothing held there is an error;
- ``usage``: per node, the bytes its holder holds and has reserved for saves in flight;
- ``stop``: stop the holders and the coordinator hosts (refused while checkpoints are held,
  unless ``--force``, which drops them).

The cluster is ``--address``, else ``RAY_ADDRESS``, else the one running on this machine; one
that does not answer within ``--timeout`` seconds (default 15) is an error naming the address
(exit status 2). The Python functions: :mod:`raydcp.memory`.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys

from ._common import EXIT_ERROR, EXIT_OK, human_bytes, one_line, print_json, safe, stdout
from ._registry import Command, register

__all__ = ["COMMAND"]

_DEFAULT_TIMEOUT_S = 15.0  # raydcp.memory.DEFAULT_TIMEOUT_S (not imported here: it imports Ray)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text!r}")
    return value


def configure(parser: argparse.ArgumentParser) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--address", default=None,
                        help="the Ray cluster's address (host:port of its head); default RAY_ADDRESS, else the "
                             "cluster running on this machine")
    common.add_argument("--timeout", type=_positive, default=_DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help=f"give up on a cluster or holder that does not answer within this (default "
                             f"{_DEFAULT_TIMEOUT_S:g})")
    common.add_argument("--json", action="store_true", help="print the result as JSON on stdout")
    sub = parser.add_subparsers(dest="mem_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("ls", parents=[common], help="list the checkpoints held in memory, by NAME")
    p.add_argument("name", nargs="?", default=None, help="only those under this NAME (or raymem://NAME)")
    p = sub.add_parser("rm", parents=[common], help="remove raymem://NAME or raymem://NAME/PATH")
    p.add_argument("urls", nargs="+", metavar="URL", help="raymem://NAME (all of it) or raymem://NAME/PATH")
    sub.add_parser("usage", parents=[common], help="bytes held and reserved per node")
    p = sub.add_parser("stop", parents=[common], help="stop the memory tier's holders and the coordinator hosts")
    p.add_argument("--force", action="store_true",
                   help="stop even while the holders hold checkpoints (they are dropped)")


def run(args: argparse.Namespace) -> int:
    from .. import memory

    try:
        memory.connect(args.address, args.timeout)
    except memory.ClusterUnreachableError as exc:
        if not exc.pending:
            raise
        # Ray's connection attempt still runs in this process, and the interpreter's exit would wait
        # for it (or crash under it): say why, and leave now
        sys.stderr.write(f"raydcp: error: {safe(one_line(str(exc)), markup=False)}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os._exit(EXIT_ERROR)
    return {"ls": _ls, "rm": _rm, "usage": _usage, "stop": _stop}[args.mem_command](args, memory)


def _when(ts: float | None) -> str:
    if ts is None:
        return "uncommitted"
    return _dt.datetime.fromtimestamp(ts, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _ls(args, memory) -> int:
    from rich.table import Table

    rows = memory.checkpoints(args.name, timeout_s=args.timeout)
    if args.json:
        print_json({"checkpoints": [r.to_dict() for r in rows]})
        return EXIT_OK
    out = stdout()
    where = f"raymem://{args.name.removeprefix('raymem://')}" if args.name else "raymem://"
    if not rows:
        out.print(safe(f"{where}: no checkpoints held in memory"))
        return EXIT_OK
    names = sorted({r.name for r in rows})
    table = Table(title=safe(f"{where}: {len(rows)} checkpoint{'s' if len(rows) != 1 else ''} under "
                             f"{len(names)} NAME{'s' if len(names) != 1 else ''}"), title_justify="left")
    for col, justify in (("NAME", "left"), ("checkpoint", "left"), ("step", "right"), ("size", "right"),
                         ("all copies", "right"), ("nodes", "right"), ("committed (UTC)", "left")):
        table.add_column(col, justify=justify, overflow="fold")
    for r in rows:
        table.add_row(safe(r.name), safe(r.url), "-" if r.step is None else str(r.step), human_bytes(r.bytes),
                      human_bytes(r.held_bytes), str(len(r.nodes)), _when(r.committed_at))
    out.print(table)
    for r in rows:
        if r.error:
            out.print(safe(f"note: {r.url}: {r.error}"))
    return EXIT_OK


def _rm(args, memory) -> int:
    out = stdout()
    done = []
    for url in args.urls:
        removal = memory.remove(url, timeout_s=args.timeout)
        done.append(removal.to_dict())
        if not args.json:
            what = f"{removal.files} file{'s' if removal.files != 1 else ''}, {human_bytes(removal.bytes)}"
            if removal.checkpoints:
                what += f"; committed checkpoints: {', '.join(removal.checkpoints)}"
            if removal.reservations:
                what += f"; released the room of {removal.reservations} save(s) in flight"
            out.print(safe(f"removed {removal.url} ({what})"))
    if args.json:
        print_json({"removed": done})
    return EXIT_OK


def _usage(args, memory) -> int:
    from rich.table import Table

    rows = memory.usage(timeout_s=args.timeout)
    if args.json:
        print_json({"nodes": [r.to_dict() for r in rows]})
        return EXIT_OK

    def size(n):
        return "-" if n is None else human_bytes(n)

    table = Table(title=f"raymem://: {len(rows)} alive node{'s' if len(rows) != 1 else ''}", title_justify="left")
    for col, justify in (("node", "left"), ("address", "left"), ("holder", "left"), ("held", "right"),
                         ("reserved", "right"), ("files", "right"), ("object store", "right")):
        table.add_column(col, justify=justify, overflow="fold")
    for r in rows:
        table.add_row(r.node, safe(r.address), r.state, size(r.held), size(r.reserved),
                      "-" if r.files is None else str(r.files), size(r.object_store_bytes))
    counted = [r for r in rows if r.held is not None]
    table.add_row("total", "", "", size(sum(r.held for r in counted)), size(sum(r.reserved for r in counted)),
                  str(sum(r.files for r in counted)), "", end_section=False)
    stdout().print(table)
    return EXIT_OK


def _stop(args, memory) -> int:
    stopped = memory.stop(force=args.force, timeout_s=args.timeout)
    if args.json:
        print_json(stopped.to_dict())
        return EXIT_OK
    out = stdout()
    if not stopped.holders and not stopped.hosts:
        out.print("nothing to stop: no holder and no coordinator host runs")
        return EXIT_OK
    out.print(f"stopped {len(stopped.holders)} holder{'s' if len(stopped.holders) != 1 else ''}"
              + (f": {', '.join(stopped.holders)}" if stopped.holders else ""))
    out.print(f"stopped {len(stopped.hosts)} coordinator host{'s' if len(stopped.hosts) != 1 else ''}"
              + (f": {', '.join(stopped.hosts)}" if stopped.hosts else ""))
    if stopped.dropped:
        out.print(safe(f"dropped {len(stopped.dropped)} checkpoint(s) held in memory: {', '.join(stopped.dropped)}"))
    return EXIT_OK


COMMAND = register(Command(
    "mem", "operate the memory tier (raymem://): ls, rm, usage, stop", configure, run,
    description="List (ls), remove (rm) and measure (usage) what the Ray cluster's memory tier holds, and stop "
                "its holder actors and the coordinator hosts (stop). The cluster: --address, else RAY_ADDRESS, "
                "else the one running on this machine; one that does not answer within --timeout seconds is an "
                "error (exit status 2).",
))
