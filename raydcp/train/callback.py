"""``RayDCPCallback``: checks and records raydcp checkpoints on the Ray Train controller.

Add it with ``RunConfig(callbacks=[raydcp.train.RayDCPCallback()])``. Ray Train
calls it on the controller process (not on the workers):

1. ``after_report`` (after the checkpoint manager registered the report): for a
   checkpoint written by :func:`raydcp.train.save`, check that it is committed
   (its metadata is published and decodes), that it was saved by the world size
   the ranks reported, that the pieces of every tensor tile it exactly and that every data
   file exists and is long enough (``verify="checksums"`` also reads every byte
   and checks its CRC32C); then append a record with its size, save seconds and
   throughput. An incomplete checkpoint raises a :class:`CheckpointError`
   (``strict=False``: only recorded and logged), which fails the run.
2. ``after_exception`` (a worker raised or died): delete every checkpoint
   directory of the run that raydcp.train.save created, that Ray Train did not
   register and that is not newer (by its step) than the latest registered one: a
   save cut short, or committed but never reported by every rank, which can never be
   resumed from. A newer one is left alone: the surviving workers of a preemption may
   still be saving it (Ray Train keeps them running until the deadline), and once
   committed it is the checkpoint :func:`raydcp.train.restore` resumes from
   (:mod:`raydcp.train.latest`); if it never commits, the next attempt's ``restore``
   removes it (no worker of this run runs then). Check that the latest registered
   checkpoint is committed; append a record.

A report without a checkpoint from a ``raydcp.train.save(memory=True)`` that kept its
checkpoint in the cluster's memory only is recorded too (``tier="memory"``,
``persisted=False``, ``path`` its ``raymem://`` URL; not checked, as the next memory save
replaces it).

Records go to ``self.records`` (on the controller) and, one JSON object per line,
to ``<run directory>/raydcp_checkpoints.jsonl`` (``RECORDS_NAME``) next to the
checkpoints. Checkpoint records: ``event="checkpoint"``, ``checkpoint`` (directory
name), ``path``, ``step``, ``world_size``, ``bytes`` (tensor bytes), ``files``,
``mode`` (``"sync"``, ``"async"`` or ``"memory"``), ``tier`` (``"storage"``, or ``"memory"``
for one held in the cluster's memory only), ``persisted``, ``seconds`` (the slowest rank's save, from
the call to the commit, from its ``metrics["raydcp"]``), ``stall_seconds`` (the
slowest rank's time blocked in ``raydcp.train.save``: the whole save when
synchronous, the staging when ``async_save=True``), ``persist_seconds`` (the
slowest rank's writing and commit: all of the save when synchronous, from the
return of the call to the commit when asynchronous), ``throughput_mb_s``
(bytes / seconds / 1e6), ``committed``, ``complete``,
``problems``, ``emergency`` (the preemption details of an emergency save, else
None), ``reported_at``. Exception records: ``event="exception"``, ``ranks``,
``errors`` (first line per rank), ``removed`` (directories deleted), ``latest``
and ``latest_committed``.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

from ray.train import UserCallback

from .. import engine
from ..errors import CheckpointError
from ..planner.tiling import piece_problems
from ..storage import CheckpointStorage
from ._context import fsspec_location
from .checkpoint import METRICS_KEY, run_checkpoint_dirs
from .memory_saves import step_of_dir

__all__ = ["RayDCPCallback", "RECORDS_NAME", "check_checkpoint"]

logger = logging.getLogger(__name__)

RECORDS_NAME = "raydcp_checkpoints.jsonl"


def check_checkpoint(url: str, storage_options: dict | None = None, *, world_size: int | None = None,
                     checksums: bool = False) -> tuple[Any, list[str]]:
    """(metadata or None, problems) of the checkpoint at ``url``; no problems means complete."""
    storage = CheckpointStorage(url, storage_options)
    if not storage.is_committed():
        return None, [f"{url} is not committed (no metadata)"]
    try:
        md = engine.read_metadata(url, storage_options=storage_options)
    except CheckpointError as exc:
        return None, [str(exc)]
    problems: list[str] = []
    if world_size is not None and md.world_size != world_size:
        problems.append(f"saved by {md.world_size} ranks, reported by {world_size}")
    ends: dict[str, int] = {}
    for key, t in md.tensors.items():
        problems += piece_problems(key, tuple(t.shape), [(c.offsets, c.sizes) for c in t.chunks])
        for c in t.chunks:
            ends[c.file] = max(ends.get(c.file, 0), c.byte_offset + c.stored_length)
    for name, end in sorted(ends.items()):
        size = storage.file_size(name)
        if size is None:
            problems.append(f"data file {name} is missing")
        elif size < end:
            problems.append(f"data file {name} has {size} bytes, the metadata needs {end}")
    if checksums and not problems:
        from ..verify import verify_checkpoint

        report = verify_checkpoint(url, storage_options=storage_options)
        problems += [str(p) for p in report.problems]
    return md, problems


class RayDCPCallback(UserCallback):
    """Checks every raydcp checkpoint Ray Train registers, cleans up after failures, records both.

    Args:
        verify: ``"files"`` (default: metadata, tiling, data file sizes) or
            ``"checksums"`` (also read every byte and check its checksum).
        strict: raise when a reported checkpoint is incomplete (default), else log it.
        storage_options: fsspec options for the run's storage (as given to save).
    """

    def __init__(self, *, verify: str = "files", strict: bool = True, storage_options: dict | None = None):
        if verify not in ("files", "checksums"):
            raise CheckpointError(f"RayDCPCallback(verify=...) must be 'files' or 'checksums', got {verify!r}")
        self.verify = verify
        self.strict = bool(strict)
        self.storage_options = storage_options
        self.records: list[dict] = []
        self._reported: set[str] = set()
        self._latest: str | None = None

    # -- UserCallback -----------------------------------------------------------
    def after_report(self, run_context, metrics: list[dict], checkpoint) -> None:
        ours = [m.get(METRICS_KEY) for m in metrics if isinstance(m.get(METRICS_KEY), dict)]
        if not ours:
            return  # not written by raydcp.train.save
        if checkpoint is None:
            if ours[0].get("tier") == "memory":
                self._record_memory(run_context, ours)
            return
        name = checkpoint.path.rstrip("/").rsplit("/", 1)[-1]
        self._reported.add(name)
        self._latest = name
        url, options = fsspec_location(checkpoint.filesystem, checkpoint.path, self.storage_options)
        world = max(int(m.get("world_size", 0)) for m in ours) or None  # as the ranks saw it
        md, problems = check_checkpoint(url, options, world_size=world, checksums=self.verify == "checksums")
        seconds = max(float(m.get("seconds", 0.0)) for m in ours)
        stall = max(float(m.get("stall_seconds", m.get("seconds", 0.0))) for m in ours)
        persist = max(float(m.get("persist_seconds", m.get("seconds", 0.0))) for m in ours)
        nbytes = md.total_bytes if md is not None else None
        record = {
            "event": "checkpoint",
            "checkpoint": name,
            "path": url,
            "step": ours[0].get("step"),
            "world_size": md.world_size if md is not None else None,
            "bytes": nbytes,
            "files": len(md.files) if md is not None else None,
            "mode": ours[0].get("mode", "sync"),
            "tier": "storage",
            "persisted": True,
            "seconds": seconds,
            "stall_seconds": stall,
            "persist_seconds": persist,
            "throughput_mb_s": (nbytes / seconds / 1e6) if nbytes and seconds > 0 else None,
            "committed": md is not None,
            "complete": not problems,
            "problems": problems,
            "emergency": ours[0].get("emergency"),
            "reported_at": time.time(),
        }
        self._record(run_context, record)
        if problems:
            msg = f"raydcp checkpoint {url} was reported but is incomplete: " + "; ".join(problems)
            if self.strict:
                raise CheckpointError(msg)
            logger.error(msg)

    def after_exception(self, run_context, worker_exceptions: dict[int, Exception]) -> None:
        storage = run_context.run_config.storage_context
        registered, latest = self._registered(storage)
        _, options = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, self.storage_options)
        removed = []
        floor = None if latest is None else step_of_dir(latest)
        for name, url in run_checkpoint_dirs(storage, self.storage_options):
            ckpt = CheckpointStorage(url, options)
            # Without Ray Train's list, only directories that never committed are known to be garbage.
            if (registered is None and ckpt.is_committed()) or (registered is not None and name in registered):
                continue
            step = step_of_dir(name)
            if step is not None and (floor is None or step > floor):
                continue  # maybe still being saved by survivors of a preemption (module doc, step 2)
            try:
                ckpt.delete()
                removed.append(name)
            except CheckpointError as exc:
                logger.warning("raydcp: could not remove the unregistered checkpoint %s: %s", url, exc)
        latest_committed = None
        if latest is not None:
            latest_committed = CheckpointStorage(f"{_root(storage, self.storage_options)}/{latest}",
                                                 options).is_committed()
            if not latest_committed:
                logger.error("raydcp: the latest registered checkpoint %s is not committed", latest)
        self._record(run_context, {
            "event": "exception",
            "ranks": sorted(worker_exceptions),
            "errors": {str(r): (str(e).strip().splitlines() or [type(e).__name__])[0][:500]
                       for r, e in sorted(worker_exceptions.items())},
            "removed": removed,
            "latest": latest,
            "latest_committed": latest_committed,
            "at": time.time(),
        })

    # -- helpers ------------------------------------------------------------------
    def _record_memory(self, run_context, ours: list[dict]) -> None:
        """A checkpoint kept in the cluster's memory only (``save(memory=True)``, not persisted):
        recorded from the ranks' numbers; Ray Train registers nothing, and the next memory save
        replaces it, so it is not read back here."""
        seconds = max(float(m.get("seconds", 0.0)) for m in ours)
        nbytes = ours[0].get("bytes")
        self._record(run_context, {
            "event": "checkpoint",
            "checkpoint": ours[0].get("checkpoint"),
            "path": ours[0].get("path"),
            "step": ours[0].get("step"),
            "world_size": ours[0].get("world_size"),
            "bytes": nbytes,
            "files": None,
            "mode": "memory",
            "tier": "memory",
            "persisted": False,
            "seconds": seconds,
            "stall_seconds": max(float(m.get("stall_seconds", m.get("seconds", 0.0))) for m in ours),
            "persist_seconds": 0.0,
            "throughput_mb_s": (nbytes / seconds / 1e6) if nbytes and seconds > 0 else None,
            "committed": True,
            "complete": None,
            "problems": [],
            "emergency": None,
            "reported_at": time.time(),
        })

    def _registered(self, storage):
        """(names Ray Train has registered, or None if unknown; the latest registered name or None)."""
        names = set(self._reported)
        latest = self._latest
        try:  # Ray Train's own list (also covers checkpoints of earlier controllers of this run)
            with storage.storage_filesystem.open_input_stream(storage.checkpoint_manager_snapshot_path) as f:
                snap = json.loads(f.read().decode("utf-8"))
            names |= {r["checkpoint_dir_name"] for r in snap.get("checkpoint_results", [])}
            last = snap.get("latest_checkpoint_result")
            if last:
                names.add(last["checkpoint_dir_name"])
                latest = last["checkpoint_dir_name"]
        except FileNotFoundError:
            pass  # nothing registered before this controller
        except Exception as exc:  # an unknown snapshot format: be conservative
            logger.warning("raydcp: cannot read Ray Train's checkpoint list (%s); only uncommitted "
                           "checkpoint directories will be removed", exc)
            return None, latest
        return names, latest

    def _record(self, run_context, record: dict) -> None:
        self.records.append(record)
        storage = run_context.run_config.storage_context
        path = f"{storage.experiment_fs_path}/{RECORDS_NAME}"
        fs = storage.storage_filesystem
        try:
            try:
                with fs.open_input_stream(path) as f:
                    old = f.read()
            except FileNotFoundError:
                old = b""
            with fs.open_output_stream(path) as f:
                f.write(old + (json.dumps(record, default=str) + "\n").encode("utf-8"))
        except Exception as exc:  # records are best effort; the checkpoint itself is fine
            logger.warning("raydcp: could not write %s: %s", path, exc)


def _root(storage, storage_options):
    return fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)[0].rstrip("/")
