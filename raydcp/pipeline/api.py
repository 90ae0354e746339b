"""CheckpointPipeline: save to the fastest tier, let the cluster do the rest, load from the best copy."""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .. import api
from ..errors import CheckpointError
from ..metadata import Metadata
from ..options import LoadOptions, SaveOptions
from ..storage import CheckpointStorage, check_name, list_committed
from .config import PipelineConfig
from .driver import PipelineDriver
from .policy import CopyInfo, RetryPolicy, load_order, make_tiers
from .record_files import read_record, records_under, write_record
from .status import StatusRecord

__all__ = ["CheckpointPipeline", "PipelineSave", "LoadResult"]

log = logging.getLogger("raydcp.pipeline")


@dataclass
class LoadResult:
    """Which copy a :meth:`CheckpointPipeline.load` read, and why it skipped others."""

    name: str
    tier: int
    url: str
    fallbacks: list[tuple[str, str]] = field(default_factory=list)  # (url, why it was not used)
    stats: Any = None


class PipelineSave:
    """What :meth:`CheckpointPipeline.save` returns, once the state is staged.

    ``stall_s``: how long the call blocked training. ``result()`` waits for the commit on tier 0
    (returns the Metadata); ``wait()`` for the whole pipeline (returns the StatusRecord; rank 0).
    """

    def __init__(self, pipeline: "CheckpointPipeline", name: str, stall_s: float, tracked: bool):
        self.name, self.stall_s, self._pipeline, self._tracked = name, stall_s, pipeline, tracked
        self._done = threading.Event()
        self._metadata: Metadata | None = None
        self._error: BaseException | None = None

    def _finish(self, metadata: Metadata | None, error: BaseException | None) -> None:
        self._metadata, self._error = metadata, error
        self._done.set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Metadata:
        if not self._done.wait(timeout):
            raise CheckpointError(f"the save of {self.name!r} did not commit within {timeout}s; call result() again")
        if self._error is not None:
            raise self._error
        return self._metadata

    def wait(self, timeout: float | None = None) -> StatusRecord:
        if not self._tracked:
            raise CheckpointError("only rank 0 of a group tracks the pipeline; call wait() there")
        t0 = time.monotonic()
        self.result(timeout)
        left = None if timeout is None else max(0.0, timeout - (time.monotonic() - t0))
        return self._pipeline.wait(self.name, timeout=left)


class CheckpointPipeline:
    """Checkpoints through storage tiers: commit to the fastest, replicate, verify, export, prune.

    ``tiers``: fastest first, e.g. ``["/nvme/ckpt", "s3://bucket/run-7"]`` (paths, URLs or
    :class:`Tier`); checkpoint ``NAME`` lives at ``<tier>/NAME`` on each. ``retention``: per tier,
    ``{0: {"keep_last": 3}, 1: {"keep_every": 10}}`` (keyed by index or URL). ``verify``: check
    every checksum of each copy once it commits. ``export``: ``"safetensors"`` writes
    ``<copy>/export/safetensors`` on ``export_tier`` (the last by default); ``export_keys`` (a
    :class:`raydcp.convert.KeySelection` or a dict of its fields: ``drop_optimizer``,
    ``drop_prefixes``, ``strip_prefixes``, ``dtype``, ``dtype_all``, as ``raydcp convert``'s key
    options) picks, renames and casts its keys; e.g. ``{"drop_optimizer": True,
    "strip_prefixes": ["model"]}`` gives a Hugging Face model's keys. ``hooks``: callables
    ``hook(info)`` or Ray remote functions, run on the cluster after commit. ``storage_options``:
    fsspec options for the tiers that are not local directories.

    ``save_options``: the :class:`raydcp.SaveOptions` of the saves to tier 0 (data file size
    cap, IOOptions); the later tiers receive the same files. ``load_options``: the
    :class:`raydcp.LoadOptions` of :meth:`load`.

    ``driver``: ``"ray"`` runs the stages in a named coordinator actor (restarted by Ray up to
    ``max_restarts`` times; each restart resumes from the status records), ``"local"`` in a thread
    of this process, ``"auto"`` picks ``"ray"`` when Ray is initialized. ``resume=True`` starts the
    driver now, which resumes every unfinished pipeline found under tier 0.
    """

    def __init__(self, tiers: Sequence[Any], *, retention: Mapping[Any, Any] | Sequence[Any] | None = None,
                 verify: bool = True, export: str | None = None, export_tier: int = -1,
                 export_keys: Any = None, hooks: Sequence[Any] = (), storage_options: Mapping[str, Any] | None = None,
                 retry: RetryPolicy | None = None, part_bytes: int = 64 << 20, max_parallel: int = 8,
                 on_event: Callable[[dict], None] | None = None, async_save: bool = True,
                 max_staging_bytes: int | None = None, driver: str = "auto", max_restarts: int = 3,
                 resume: bool = True, save_options: SaveOptions | None = None,
                 load_options: LoadOptions | None = None):
        self.config = PipelineConfig(
            tiers=make_tiers(tiers, retention, storage_options), verify=bool(verify), export=export,
            export_tier=export_tier, export_keys=export_keys, hooks=tuple(hooks), retry=retry or RetryPolicy(),
            part_bytes=part_bytes, max_parallel=max_parallel, on_event=on_event)
        if driver not in ("auto", "ray", "local"):
            raise CheckpointError(f"driver must be 'auto', 'ray' or 'local', got {driver!r}")
        for name, value, kind in (("save_options", save_options, SaveOptions),
                                  ("load_options", load_options, LoadOptions)):
            if value is not None and not isinstance(value, kind):
                raise CheckpointError(f"{name} must be a raydcp.{kind.__name__} (or None), got {type(value).__name__}")
        self._save_options, self._load_options = save_options, load_options
        self._driver_kind = driver
        self._max_restarts = max_restarts
        self._async = bool(async_save)
        self._max_staging_bytes = max_staging_bytes
        self._driver: Any = None
        self._seq: int | None = None
        self._lock = threading.Lock()
        self._post: queue.SimpleQueue = queue.SimpleQueue()  # saves waiting for their commit
        self._post_thread: threading.Thread | None = None
        if resume:
            self.driver()

    @property
    def tiers(self):
        return self.config.tiers

    # ------------------------------------------------------------------ the driver

    def driver(self):
        """The pipeline driver (started on first use): a PipelineDriver, or a proxy of the actor."""
        with self._lock:
            if self._driver is None:
                self._driver = api.pipeline_driver(self.config, self._driver_kind, local=PipelineDriver,
                                                  max_restarts=self._max_restarts)
            return self._driver

    # ------------------------------------------------------------------ save

    def save(self, state_dict: dict, name: str, *, group=None, step: int | None = None) -> PipelineSave:
        """Commit ``state_dict`` as checkpoint ``name`` on tier 0, then hand the rest to the driver.

        Every rank of ``group`` calls it; rank 0 keeps the status record and submits the pipeline.
        Returns once the state is staged (``async_save=True``, the default) or committed.
        """
        check_name(name, self.tiers[0].url)
        if "/" in name:
            raise CheckpointError(f"a checkpoint name is one directory name, got {name!r}")
        tracked = group is None or group.rank == 0
        tier0 = self.tiers[0]
        url = tier0.copy_url(name)
        record = None
        if tracked:
            record = self.config.new_record(name, self._next_seq(), step=step, node_id=_node_id())
            record.transition("staged@0", "running")
            if not self._async:
                self._write_quietly(record)
        t0 = time.perf_counter()
        if self._async:
            future = api.async_save(state_dict, url, group=group, storage_options=tier0.options(),
                                    max_staging_bytes=self._max_staging_bytes, options=self._save_options)
            stall = time.perf_counter() - t0
            handle = PipelineSave(self, name, stall, tracked)
            # one long-lived thread follows every commit: starting a thread per save would make
            # training wait for the scheduler to run it
            self._post.put((handle, record, future.result, t0, stall))
            if self._post_thread is None:
                self._post_thread = threading.Thread(target=self._follow_commits, name="raydcp-pipeline-commits",
                                                     daemon=True)
                self._post_thread.start()
            return handle
        box: dict = {}
        try:
            box["md"] = api.save(state_dict, url, group=group, storage_options=tier0.options(),
                                 options=self._save_options)
        except CheckpointError as exc:
            box["error"] = exc
        stall = time.perf_counter() - t0
        handle = PipelineSave(self, name, stall, tracked)
        self._after_commit(handle, record, lambda: _unbox(box), t0, stall)
        if "error" in box:
            raise box["error"]
        return handle

    def _follow_commits(self) -> None:
        while True:
            item = self._post.get()
            if item is None:
                return
            self._after_commit(*item)

    def _after_commit(self, handle: PipelineSave, record: StatusRecord | None, result: Callable[[], Metadata],
                      t0: float, stall: float) -> None:
        if record is not None and self._async:
            # off the training thread, while the data is written: a saving process that dies
            # after its commit leaves this trace, which a driver adopts (PipelineDriver.resume)
            self._write_quietly(record)
        try:
            md = result()
        except BaseException as exc:
            if record is not None:
                record.transition("staged@0", "done", seconds=stall)
                record.transition("persisted@0", "running")
                record.transition("persisted@0", "failed", error=" ".join(str(exc).split()))
                for e in record.stages:
                    if e.state == "pending":
                        record.transition(e.key, "skipped", error="the save did not commit")
                self._write_quietly(record)
            handle._finish(None, exc)
            return
        if record is not None:
            total = time.perf_counter() - t0
            record.transition("staged@0", "done", seconds=stall, nbytes=md.total_bytes)
            record.transition("persisted@0", "running")
            record.transition("persisted@0", "done", seconds=max(total - stall, 0.0), nbytes=md.total_bytes)
            record.transition("committed@0", "running")
            record.transition("committed@0", "done", seconds=0.0)
            record.save_id, record.bytes, record.files = md.save_id, md.total_bytes, len(md.files)
            record.tiers[0].copy = "committed"
            self._write_quietly(record)
            try:
                self.driver().submit(record.name, record)
            except Exception as exc:
                log.warning("could not hand %s to the pipeline driver: %s (resume() picks it up)", record.name, exc)
        handle._finish(md, None)

    def _write_quietly(self, record: StatusRecord) -> None:
        record.revision += 1
        try:
            write_record(CheckpointStorage(self.tiers[0].copy_url(record.name), self.tiers[0].options()), record)
        except CheckpointError as exc:
            log.warning("could not write the status record of %s: %s", record.name, exc)

    def _next_seq(self) -> int:
        with self._lock:
            if self._seq is None:
                self._seq = 0
                for i, tier in enumerate(self.tiers):
                    try:
                        found = records_under(tier, committed_only=i > 0)
                    except CheckpointError as exc:
                        log.warning("could not list %s: %s", tier.url, exc)
                        continue
                    if found:
                        self._seq = max(r.seq for r in found.values())
                        break
            self._seq += 1
            return self._seq

    # ------------------------------------------------------------------ load

    def latest(self) -> str | None:
        """The newest checkpoint committed on any tier (by the pipeline's sequence number)."""
        best: tuple[int, float, str] | None = None
        for tier in self.tiers:
            try:
                committed = list_committed(tier.url, tier.options())
            except CheckpointError as exc:
                log.warning("could not list %s: %s", tier.url, exc)
                continue
            if not committed:
                continue
            # commit times on object stores have a 1 s resolution: look at every near tie
            recent = [c for c in committed if c.committed_at >= committed[-1].committed_at - 2.0]
            for c in recent:
                try:
                    record = read_record(CheckpointStorage(c.url, tier.options()))
                except CheckpointError:
                    record = None
                key = (record.seq if record else -1, c.committed_at, c.name)
                if best is None or key[:2] > best[:2]:
                    best = key
        return best[2] if best else None

    def load(self, state_dict: dict, name: str | None = None, *, group=None, strict: bool = True) -> LoadResult:
        """Fill ``state_dict`` from the fastest tier holding a committed, undamaged copy of ``name``
        (the latest when None), falling back to the next tier when a copy is missing or damaged."""
        if name is None:
            name = self.latest()
            if name is None:
                raise CheckpointError(f"no committed checkpoint on any tier ({', '.join(t.url for t in self.tiers)})")
        copies, notes, record = [], {}, None
        for i, tier in enumerate(self.tiers):
            storage = CheckpointStorage(tier.copy_url(name), tier.options())
            try:
                committed = storage.is_committed()
            except CheckpointError as exc:
                committed, notes[i] = False, str(exc)
            if committed and record is None:
                try:
                    record = read_record(storage)
                except CheckpointError:
                    record = None
            copies.append(CopyInfo(i, committed))
        if record is not None:
            damaged = {e.tier for e in record.stages if e.stage == "verified" and e.state == "failed"}
            copies = [CopyInfo(c.tier, c.committed, c.tier in damaged) for c in copies]
        fallbacks = [(self.tiers[i].copy_url(name), notes.get(i, "no committed copy"))
                     for i in range(len(self.tiers)) if not copies[i].committed]
        for i in load_order(copies):
            url = self.tiers[i].copy_url(name)
            try:
                stats = api.load(state_dict, url, group=group, strict=strict, storage_options=self.tiers[i].options(),
                                 options=self._load_options)
            except CheckpointError as exc:
                log.warning("loading %s failed (%s); trying the next tier", url, exc)
                fallbacks.append((url, " ".join(str(exc).split())))
                continue
            return LoadResult(name, i, url, sorted(fallbacks), stats)
        lines = "\n  ".join(f"{u}: {why}" for u, why in sorted(fallbacks))
        raise CheckpointError(f"no tier holds a loadable copy of {name!r}:\n  {lines}")

    # ------------------------------------------------------------------ observe and control

    def status(self, name: str) -> StatusRecord:
        """Where ``name`` stands: the driver's live record, or the freshest one in storage."""
        return self.driver().status(name)

    def wait(self, name: str, timeout: float | None = None, *, progress: bool = False) -> StatusRecord:
        """Block until ``name``'s pipeline finished; ``progress=True`` draws a bar on a terminal."""
        if progress:
            from .progress import wait_with_progress

            return wait_with_progress(self.driver(), name, timeout)
        return self.driver().wait(name, timeout)

    def resume(self, name: str | None = None) -> list[str]:
        return self.driver().resume(name)

    def retry(self, name: str) -> list[str]:
        return self.driver().retry(name)

    def close(self, wait: bool = True, timeout: float | None = None) -> None:
        """Let pending pipelines finish (``wait``), then stop the driver (the coordinator actor only
        if this process created it: other ranks sharing it keep it)."""
        thread, self._post_thread = self._post_thread, None
        if thread is not None:
            self._post.put(None)
            thread.join(timeout)
        with self._lock:
            driver, self._driver = self._driver, None
        if driver is None:
            return
        if wait:
            driver.wait_idle(timeout)
        driver.shutdown()


def _unbox(box: dict) -> Metadata:
    if "error" in box:
        raise box["error"]
    return box["md"]


def _node_id() -> str | None:
    return api.current_node_id()
