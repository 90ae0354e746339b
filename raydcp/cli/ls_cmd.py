"""``raydcp ls ROOT [--depth N] [--json]``: the committed checkpoints at and below ROOT, oldest first.

ROOT is searched down to ``--depth`` levels of subdirectories (default 3), without entering a
checkpoint, so a Ray Train run directory (``RUN/raydcp-step00000006-1b855de7``), a storage path
of several runs or a pipeline tier all list. ``raymem://NAME`` lists the checkpoints held in the
Ray cluster's memory (run it where the cluster is reachable).

Each row: the checkpoint's path relative to ROOT, its step, the tensors and their bytes (as
``raydcp inspect`` counts them), the saving world size, the commit time, and the pipeline state
where a status record (``raydcp.status.json``, written by ``raydcp.pipeline``) lies beside it.
The step is what was saved, never digits of a name: the checkpoint's plain value ``step`` (or
``progress.step`` of a ``raydcp.train.TrainState``), else the step Ray Train recorded with the
report (``checkpoint_manager_snapshot.json`` of the run: ``metrics["raydcp"]["step"]`` or
``metrics["step"]``), else the one ``raydcp.train.RayDCPCallback`` recorded
(``raydcp_checkpoints.jsonl``), else the pipeline record's; ``-`` where none is known. Saves below ROOT
that have not committed are named after the table. A ROOT that does not exist is an error (exit
2); one without checkpoints lists none (exit 0).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
from typing import Any

from ..errors import CheckpointError
from ._common import (EXIT_OK, add_storage_options, human_bytes, print_json, read_metadata, safe, stderr, stdout,
                      storage_options)
from ._registry import Command, register

__all__ = ["COMMAND", "list_checkpoints", "saved_step"]

RAY_TRAIN_SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train's record of a run's reported checkpoints
CALLBACK_RECORDS = "raydcp_checkpoints.jsonl"  # raydcp.train.RayDCPCallback's (its RECORDS_NAME; no Ray here)
_SHOWN_UNCOMMITTED = 5


def configure(parser: argparse.ArgumentParser) -> None:
    from ..storage.discovery import DEFAULT_DEPTH

    parser.add_argument("root", help="a directory holding checkpoints, at any depth up to --depth (local path, "
                                     "fsspec URL or raymem://NAME)")
    parser.add_argument("--depth", type=int, default=DEFAULT_DEPTH, metavar="N",
                        help=f"levels of subdirectories searched below ROOT (default {DEFAULT_DEPTH}; 0: ROOT only)")
    parser.add_argument("--json", action="store_true", help="print the list as JSON on stdout")
    add_storage_options(parser)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def saved_step(values: dict[str, Any]) -> tuple[int | None, str | None]:
    """The step a checkpoint's plain values hold and its key: ``step``, else the ``progress.step``
    of a TrainState (``train.progress.step``; the shortest such key where there are several)."""
    if _int(values.get("step")) is not None:
        return values["step"], "step"
    keys = sorted((k for k in values if k == "progress.step" or k.endswith(".progress.step")),
                  key=lambda k: (len(k), k))
    for key in keys:
        if _int(values[key]) is not None:
            return values[key], key
    return None, None


class _RunRecords:
    """The steps recorded beside the checkpoints of a run directory, by checkpoint directory name:
    Ray Train's (``checkpoint_manager_snapshot.json``: the metrics reported with each checkpoint)
    and raydcp's callback's (``raydcp_checkpoints.jsonl``). JSON only, read once per directory."""

    def __init__(self, opts: dict | None):
        self._opts = opts
        self._by_dir: dict[str, dict[str, tuple[int, str]]] = {}

    def step(self, checkpoint_url: str) -> tuple[int | None, str | None]:
        parent, _, name = checkpoint_url.rstrip("/").rpartition("/")
        if not parent:
            return None, None
        if parent not in self._by_dir:
            self._by_dir[parent] = self._read(parent)
        return self._by_dir[parent].get(name, (None, None))

    def _read(self, run_url: str) -> dict[str, tuple[int, str]]:
        from ..storage import CheckpointStorage

        try:
            storage = CheckpointStorage(run_url, self._opts)
            found = {name: (step, "raydcp-callback") for name, step in self._callback(storage)}
            found.update((name, (step, "ray-train")) for name, step in self._ray_train(storage))
        except CheckpointError:
            return {}  # the run directory cannot be read: the steps stay unknown
        return found

    @staticmethod
    def _ray_train(storage) -> list[tuple[str, int]]:
        if not storage.exists(RAY_TRAIN_SNAPSHOT):
            return []
        try:
            doc = json.loads(storage.read_file(RAY_TRAIN_SNAPSHOT))
        except ValueError:
            return []  # a record this reader does not understand
        if not isinstance(doc, dict):
            return []
        results = list(doc.get("checkpoint_results") or [])
        if isinstance(doc.get("latest_checkpoint_result"), dict):
            results.append(doc["latest_checkpoint_result"])
        out = []
        for r in results:
            if not isinstance(r, dict) or not isinstance(r.get("metrics"), dict):
                continue
            metrics = r["metrics"]
            ours = metrics.get("raydcp")  # what raydcp.train.save reports
            step = _int(ours.get("step")) if isinstance(ours, dict) else None
            step = step if step is not None else _int(metrics.get("step"))
            if step is not None and isinstance(r.get("checkpoint_dir_name"), str):
                out.append((r["checkpoint_dir_name"], step))
        return out

    @staticmethod
    def _callback(storage) -> list[tuple[str, int]]:
        if not storage.exists(CALLBACK_RECORDS):
            return []
        out = []
        for line in storage.read_file(CALLBACK_RECORDS).decode("utf-8", "replace").splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue  # a line cut short by a crash
            if isinstance(r, dict) and r.get("event") == "checkpoint" and isinstance(r.get("checkpoint"), str) \
                    and _int(r.get("step")) is not None:
                out.append((r["checkpoint"], r["step"]))
        return out


def _step(md, recorded: tuple[int | None, str | None], record) -> tuple[int | None, str | None]:
    step, key = saved_step(md.values) if md is not None else (None, None)
    if step is not None:
        return step, f"value {key}"
    if recorded[0] is not None:
        return recorded
    if record is not None and record.step is not None:
        return record.step, "pipeline"
    return None, None


def list_checkpoints(root: str, opts: dict | None, depth: int | None = None) -> dict[str, Any]:
    """``{"root", "checkpoints": [one dict per committed checkpoint], "uncommitted": [paths],
    "incomplete"}`` for the checkpoints at and below ``root`` (CheckpointError if ``root`` is not a
    directory)."""
    from ..pipeline.record_files import read_record
    from ..storage import CheckpointStorage
    from ..storage.discovery import DEFAULT_DEPTH, find_checkpoints

    depth = DEFAULT_DEPTH if depth is None else depth
    search = find_checkpoints(root, opts, max_depth=depth)
    run_records = _RunRecords(opts)
    rows = []
    for c in search.checkpoints:
        row: dict[str, Any] = {"name": c.relpath, "url": c.url, "committed_at": c.committed_at}
        md = record = None
        try:
            _, md = read_metadata(c.url, opts)
        except CheckpointError as exc:
            row["error"] = str(exc)
        try:
            record = read_record(CheckpointStorage(c.url, opts))
        except CheckpointError as exc:
            row.setdefault("error", str(exc))
        row["step"], row["step_from"] = _step(md, run_records.step(c.url), record)
        row["tensors"] = len(md.tensors) if md is not None else None
        row["pieces"] = sum(len(t.chunks) for t in md.tensors.values()) if md is not None else None
        row["bytes"] = md.total_bytes if md is not None else None
        row["owned_bytes"] = md.owned_bytes if md is not None else None
        row["references"] = md.references if md is not None else None
        row["world_size"] = md.world_size if md is not None else None
        # committed by the survivors of a save without these ranks (raydcp.engine.survivors.LOST_RANKS_KEY)
        row["lost_ranks"] = list((md.extra or {}).get("lost_ranks") or []) if md is not None else None
        row["pipeline_state"] = record.state if record is not None else None
        rows.append(row)
    return {"root": search.root, "depth": depth, "checkpoints": rows,
            "uncommitted": [c.relpath for c in search.uncommitted], "incomplete": search.incomplete,
            "bases": [c.relpath for c in search.bases]}


def _owns(row: dict) -> str:
    """What a checkpoint holds itself; a delta checkpoint's bases beside it."""
    if row.get("owned_bytes") is None:
        return "-"
    refs = row.get("references") or {}
    if not refs:
        return human_bytes(row["owned_bytes"])
    names = sorted(refs)
    shown = names[0] if len(names) == 1 else f"{names[0]} +{len(names) - 1}"
    return f"{human_bytes(row['owned_bytes'])} (delta of {shown})"


def _ranks(row: dict) -> str:
    """The saving world size; a survivors' commit says which ranks it was committed without."""
    if row.get("world_size") is None:
        return "-"
    lost = row.get("lost_ranks")
    if not lost:
        return str(row["world_size"])
    return f"{row['world_size']} (survivors; lost {', '.join(map(str, lost))})"


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    if args.depth < 0:
        raise CheckpointError(f"--depth must be >= 0, got {args.depth}")
    found = list_checkpoints(args.root, storage_options(args), args.depth)
    if args.json:
        print_json(found)
        return EXIT_OK
    rows, out = found["checkpoints"], stdout()
    if not rows:
        out.print(safe(f"{args.root}: no committed checkpoints (searched {args.depth} level"
                       f"{'s' if args.depth != 1 else ''} down)"))
    else:
        table = Table(title=safe(f"{args.root}: {len(rows)} committed checkpoint{'s' if len(rows) != 1 else ''}"),
                      title_justify="left")
        for col, justify in (("path", "left"), ("step", "right"), ("tensors", "right"), ("size", "right"),
                             ("owns", "right"), ("ranks", "right"), ("committed (UTC)", "left"),
                             ("pipeline", "left")):
            table.add_column(col, justify=justify, overflow="fold" if col == "path" else "ellipsis")
        for r in rows:
            when = _dt.datetime.fromtimestamp(r["committed_at"], tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(safe(r["name"]), "-" if r["step"] is None else str(r["step"]),
                          "-" if r["tensors"] is None else str(r["tensors"]),
                          "-" if r["bytes"] is None else human_bytes(r["bytes"]),
                          _owns(r),
                          _ranks(r), when,
                          safe(r["pipeline_state"] or "-"))
        out.print(table)
    pending = found["uncommitted"]
    if pending:
        shown = ", ".join(pending[:_SHOWN_UNCOMMITTED]) + (
            f" and {len(pending) - _SHOWN_UNCOMMITTED} more" if len(pending) > _SHOWN_UNCOMMITTED else "")
        out.print(safe(f"not committed ({len(pending)}): {shown}"))
    if found["bases"]:
        out.print(safe(f"removed, files kept for delta checkpoints ({len(found['bases'])}): "
                       + ", ".join(found["bases"][:_SHOWN_UNCOMMITTED])
                       + (f" and {len(found['bases']) - _SHOWN_UNCOMMITTED} more"
                          if len(found["bases"]) > _SHOWN_UNCOMMITTED else "")))
    if found["incomplete"]:
        out.print(safe(f"directories deeper than {args.depth} level{'s' if args.depth != 1 else ''} were not "
                       "searched (--depth)"))
    err = stderr()
    for r in rows:
        if "error" in r:
            err.print(safe(f"raydcp ls: {r['name']}: {r['error']}"))
    return EXIT_OK


COMMAND = register(Command(
    "ls", "list the committed checkpoints at and below a directory (step, size, time, pipeline state)", configure,
    run, description=__doc__.split("\n\n", 1)[1] if __doc__ else "",
))
