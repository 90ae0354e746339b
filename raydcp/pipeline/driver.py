"""The pipeline driver: runs the post-commit stages of checkpoints, one checkpoint at a time.

A plain class (tests drive it directly, with :class:`ThreadRunner`); the coordinator actor of
:mod:`raydcp.runtime.pipeline_actor` is this class with a Ray runner.

Protocol:
  1. the saving process commits a checkpoint to tier 0, records ``staged``/``persisted``/
     ``committed@0`` in its status record, and calls :meth:`PipelineDriver.submit`;
  2. the driver's worker thread runs the remaining stages in record order -- before each stage it
     records ``running``, after it ``done`` or ``failed`` (after retries with backoff), always in
     every committed copy -- then waits for the next checkpoint;
  3. anyone may call :meth:`status`, :meth:`progress` or :meth:`wait`; :meth:`retry` puts failed
     stages back to pending and runs them again;
  4. a new driver (after a crash or a restart) calls :meth:`resume`: every record under tier 0
     whose pipeline is unfinished is submitted again, and each stage picks up where the record
     says. Stages are idempotent: ``replicated`` keeps the files already complete on the target
     and copies the rest; ``committed`` publishes byte-identical metadata; ``verified`` and
     ``exported`` redo their work; a hook interrupted while running runs again (at least once).
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any

from ..errors import CheckpointDamagedError, CheckpointError, CheckpointNotFoundError, StateMismatchError
from ..metadata_format import decode_metadata
from ..storage import METADATA_NAME, CheckpointStorage, list_committed, remove_checkpoint
from .config import EXPORT_DIR, PipelineConfig, Runner, ThreadRunner
from .policy import Candidate, pipeline_file, under_retention
from .record_files import read_freshest, read_record, records_under, write_record
from .replicate import commit_copy, replicate_files
from .status import StageEntry, StatusRecord

__all__ = ["PipelineDriver"]

log = logging.getLogger("raydcp.pipeline")


class _Superseded(Exception):
    """A newer save to the same name replaced the record this run was working on."""


class _Stopped(Exception):
    """The driver is shutting down."""


def _retryable(exc: BaseException) -> bool:
    """Whether running a stage again may help: not for damage, a mismatch or a missing checkpoint,
    nor once superseded or stopped. Every StorageError is retried, not only the ``retriable``
    ones: a tier that is unreachable or misconfigured now may be back (or fixed) by the next try."""
    return not isinstance(exc, (CheckpointDamagedError, CheckpointNotFoundError, StateMismatchError, _Superseded,
                                _Stopped))


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {text}"


def _by_source_node(tasks, default: str | None) -> dict:
    """``{node: [task index]}``: where each copy task runs best. A source filesystem that knows
    which node holds a file (``node_of``: the node-local and memory tiers) sends the task there;
    other tasks run on ``default`` (the saving node)."""
    groups: dict = {}
    nodes: dict = {}
    for i, task in enumerate(tasks):
        name = task.segment.file
        if name not in nodes:
            storage = CheckpointStorage(task.src_url, task.src_options)
            node_of = getattr(storage.fs, "node_of", None)
            nodes[name] = (node_of(f"{storage.path}/{name}") if node_of else None) or default
        groups.setdefault(nodes[name], []).append(i)
    return groups


class PipelineDriver:
    """Runs the post-commit stages of submitted checkpoints (see the module docstring)."""

    def __init__(self, config: PipelineConfig, runner: Runner | None = None, *, resume: bool = True,
                 start: bool = True):
        self.config = config
        self.runner = runner if runner is not None else ThreadRunner(config.max_parallel)
        self._records: dict[str, StatusRecord] = {}   # checkpoints this driver runs or ran
        self._known: dict[str, StatusRecord] = {}     # every record seen (retention reads seq from it)
        self._queue: collections.deque[str] = collections.deque()
        self._active: str | None = None
        self._progress: dict[str, dict] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if resume:  # before the worker starts: wait() right after construction sees what resumed
            try:
                self.resume()
            except Exception as exc:
                log.warning("could not resume unfinished pipelines under %s: %s", config.tiers[0].url, exc)
        if start:
            self._thread = threading.Thread(target=self._loop, name="raydcp-pipeline-driver", daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ public protocol

    def submit(self, name: str, record: StatusRecord | None = None) -> None:
        """Queue ``name`` (whose ``committed@0`` is recorded) to run its remaining stages."""
        if record is None:
            record, _ = read_freshest(self.config.tiers, name)
            if record is None:
                raise CheckpointError(f"no status record for checkpoint {name!r} on any tier")
        with self._cond:
            self._records[name] = record
            self._known[name] = record
            if name not in self._queue:
                self._queue.append(name)
            self._cond.notify_all()

    def resume(self, name: str | None = None) -> list[str]:
        """Submit again every unfinished pipeline recorded under tier 0 (or just ``name``, found on
        any tier). A record whose save never committed is left alone. Returns the names queued."""
        if name is not None:
            record, _ = read_freshest(self.config.tiers, name)
            found = {name: record} if record is not None else {}
        else:
            found = records_under(self.config.tiers[0], committed_only=False)
        queued = []
        for n, record in sorted(found.items(), key=lambda kv: kv[1].seq):
            with self._cond:
                if n in self._records and (n in self._queue or self._active == n):
                    continue
                self._known.setdefault(n, record)
            if record.finished:
                continue
            if record.entry("committed@0").state != "done" and not self._adopt(record):
                continue
            self.submit(n, record)
            queued.append(n)
        return queued

    def retry(self, name: str) -> list[str]:
        """Run the failed and blocked stages of ``name`` again; returns their keys."""
        with self._cond:
            busy = name in self._queue or self._active == name
        if busy:
            raise CheckpointError(f"checkpoint {name!r} is still running its pipeline; wait() for it first")
        record = self.status(name)
        keys = record.reset_failed()
        if keys:
            self.submit(name, record)
        return keys

    def status(self, name: str) -> StatusRecord:
        with self._cond:
            record = self._records.get(name)
        if record is not None:
            return record
        record, problems = read_freshest(self.config.tiers, name)
        if record is None:
            detail = "; ".join(problems.values())
            raise CheckpointError(f"no status record for checkpoint {name!r} on any tier" + (f" ({detail})" if detail else ""))
        return record

    def progress(self, name: str) -> dict:
        """``{"stage", "done_bytes", "total_bytes"}`` of the stage running now (empty when idle)."""
        with self._cond:
            return dict(self._progress.get(name, {}))

    def wait(self, name: str, timeout: float | None = None) -> StatusRecord:
        """Block until ``name``'s pipeline finished (complete or failed); returns its record."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while name in self._queue or self._active == name:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    stage = self._progress.get(name, {}).get("stage", "?")
                    raise CheckpointError(f"the pipeline of {name!r} did not finish within {timeout}s (now at {stage})")
                if self._thread is None or not self._thread.is_alive():
                    raise CheckpointError(f"the pipeline driver stopped while {name!r} was running; resume() it")
                self._cond.wait(min(left, 1.0) if left is not None else 1.0)
        return self.status(name)

    def wait_idle(self, timeout: float | None = None) -> None:
        """Block until no checkpoint is queued or running."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._queue or self._active is not None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise CheckpointError(f"the pipeline driver is still busy after {timeout}s")
                if self._thread is None or not self._thread.is_alive():
                    return
                self._cond.wait(min(left, 1.0) if left is not None else 1.0)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self.runner.close()

    def run_until_idle(self) -> None:
        """Run every queued checkpoint in the calling thread (for drivers built with start=False)."""
        while True:
            with self._cond:
                if not self._queue:
                    return
                name = self._queue.popleft()
                self._active = name
            try:
                self._run(name)
            finally:
                with self._cond:
                    self._active = None
                    self._cond.notify_all()

    # ------------------------------------------------------------------ the worker

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._cond:
                while not self._queue and not self._stop.is_set():
                    self._cond.wait()
                if self._stop.is_set():
                    return
                name = self._queue.popleft()
                self._active = name
            try:
                self._run(name)
            except (_Superseded, _Stopped):
                pass
            except Exception:
                log.exception("pipeline of %s stopped on an unexpected error", name)
            finally:
                with self._cond:
                    self._active = None
                    self._progress.pop(name, None)
                    self._cond.notify_all()

    def _run(self, name: str) -> None:
        with self._cond:
            record = self._records[name]
        if record.entry("committed@0").state != "done" and not self._adopt(record):
            raise CheckpointError(f"{name!r} has not committed on tier 0; nothing to run")
        while not self._stop.is_set():
            entry = record.next_stage()
            if entry is None:
                return
            blockers = record.blockers(entry.key)
            if blockers:
                why = ", ".join(f"{b.key} {b.state}" for b in blockers)
                record.transition(entry.key, "blocked", error=f"waits for {why}")
                self._persist(record)
                continue
            self._run_stage(record, entry)

    def _run_stage(self, record: StatusRecord, entry: StageEntry) -> None:
        key = entry.key
        record.transition(key, "running")
        self._persist(record)
        self._emit(record, key, "start")
        t0 = time.perf_counter()

        def on_retry(attempt: int, exc: BaseException, delay: float) -> None:
            log.warning("%s of %s: attempt %d failed (%s); retrying in %.2fs", key, record.name, attempt, exc, delay)
            entry.attempts += 1
            entry.error = _one_line(exc)
            self._emit(record, key, "retry", error=entry.error)

        try:
            nbytes, detail = self.config.retry.call(lambda: self._execute(record, entry), retryable=_retryable,
                                                    wait=self._stop.wait, on_retry=on_retry)
        except (_Superseded, _Stopped):
            raise
        except Exception as exc:
            if self._stop.is_set():
                raise _Stopped() from exc
            record.transition(key, "failed", seconds=time.perf_counter() - t0, error=_one_line(exc))
            if entry.stage in ("replicated", "committed") and entry.tier:
                record.tiers[entry.tier].copy = "failed"
            self._persist(record)
            self._emit(record, key, "failed", error=record.entry(key).error)
            return
        record.transition(key, "done", seconds=time.perf_counter() - t0, nbytes=nbytes, detail=detail)
        self._persist(record)
        self._emit(record, key, "done")

    def _execute(self, record: StatusRecord, entry: StageEntry) -> tuple[int, str | None]:
        """Do one stage; returns (bytes, detail). Every stage is safe to run again."""
        tiers, k, name = self.config.tiers, entry.tier, record.name
        if entry.stage == "verified":
            from ..verify import verify_checkpoint

            report = verify_checkpoint(tiers[k].copy_url(name), tiers[k].options())
            if not report.ok:
                first = report.problems[0] if report.problems else None
                raise CheckpointDamagedError(report.summary() + ": " + "; ".join(str(p) for p in report.problems[:3]),
                                             file=first and first.file, key=first and first.key,
                                             byte_range=first and first.byte_range)
            return report.bytes_checked, f"{report.pieces_checked} pieces"
        if entry.stage == "replicated":
            j, src, meta = self._source(record, exclude=k)
            dst = CheckpointStorage(tiers[k].copy_url(name), tiers[k].options())
            result = replicate_files(src, dst, meta, self._run_tasks(record), part_bytes=self.config.part_bytes,
                                     on_bytes=lambda d, t: self._emit(record, entry.key, "progress", done_bytes=d, total_bytes=t))
            return (result.bytes_copied + result.bytes_kept,
                    f"from tier {j}: {result.files_copied} files copied, {result.files_kept} already there")
        if entry.stage == "committed":
            _, _, meta = self._source(record, exclude=k)
            commit_copy(meta, CheckpointStorage(tiers[k].copy_url(name), tiers[k].options()))
            record.tiers[k].copy = "committed"
            return len(meta), None
        if entry.stage == "exported":
            from ..convert import to_safetensors

            url = self.config.export_url(name)
            result = to_safetensors(tiers[k].copy_url(name), url, storage_options=tiers[k].options(), overwrite=True,
                                    select=self.config.export_keys)
            return result.nbytes, url
        if entry.stage == "hook":
            hook = dict(zip(self.config.hook_names, self.config.hooks))[entry.detail]
            self.runner.call_hook(hook, self._hook_info(record))
            return 0, entry.detail
        if entry.stage == "retention":
            return 0, self._apply_retention(k, record)
        raise CheckpointError(f"stage {entry.key} runs in the saving process, not in the pipeline driver")

    # ------------------------------------------------------------------ helpers

    def _source(self, record: StatusRecord, exclude: int) -> tuple[int, CheckpointStorage, bytes]:
        """The fastest committed copy of this save (not on tier ``exclude``) and its metadata bytes."""
        problems = []
        for j, tier in enumerate(self.config.tiers):
            if j == exclude or record.tiers[j].copy != "committed":
                continue
            storage = CheckpointStorage(tier.copy_url(record.name), tier.options())
            try:
                meta = storage.read_metadata_bytes()
                save_id = decode_metadata(meta, storage.file_url(METADATA_NAME)).save_id
            except CheckpointError as exc:
                problems.append(f"tier {j}: {exc}")
                continue
            if save_id != record.save_id:
                raise _Superseded(f"{storage.url} now holds save {save_id}, not {record.save_id}")
            return j, storage, meta
        raise CheckpointError(f"no committed copy of {record.name!r} to copy from: " + ("; ".join(problems) or "none"))

    def _run_tasks(self, record: StatusRecord):
        def run(tasks, on_result):
            from .replicate import copy_segment

            groups = _by_source_node(tasks, record.node_id)
            if len(groups) <= 1:
                return self.runner.map(copy_segment, tasks, on_result, node_id=next(iter(groups), record.node_id))
            # a node-local (or memory) source: each node's files are copied on that node
            results: list = [None] * len(tasks)
            for node, idxs in groups.items():
                done = self.runner.map(copy_segment, [tasks[i] for i in idxs], on_result, node_id=node)
                for i, r in zip(idxs, done):
                    results[i] = r
            return results
        return run

    def _hook_info(self, record: StatusRecord) -> dict[str, Any]:
        return {
            "name": record.name, "seq": record.seq, "step": record.step, "save_id": record.save_id,
            "copies": [t.url for t in record.tiers if t.copy == "committed"],
            "export": self.config.export_url(record.name), "record": record.to_dict(),
        }

    def _adopt(self, record: StatusRecord) -> bool:
        """A record whose saving process stopped after the commit but before recording it:
        take the committed copy on tier 0 as this save if it is at least as new as the record."""
        storage = CheckpointStorage(self.config.tiers[0].copy_url(record.name), self.config.tiers[0].options())
        try:
            md = decode_metadata(storage.read_metadata_bytes(), storage.file_url(METADATA_NAME))
        except CheckpointError:
            return False
        if md.created_at < record.created_at:
            return False
        for key in ("staged@0", "persisted@0", "committed@0"):
            if record.entry(key).state != "done":
                record.transition(key, "done", detail="adopted after a restart")
        record.save_id, record.bytes, record.files = md.save_id, md.total_bytes, len(md.files)
        record.tiers[0].copy = "committed"
        return True

    def _persist(self, record: StatusRecord, exclude: int | None = None) -> None:
        """Write the record to every committed copy (best effort per tier; tier 0 first)."""
        with self._cond:
            if record.name in self._records and self._records[record.name] is not record:
                raise _Superseded(record.name)
            record.revision += 1
            record.updated_at = time.time()
            self._known[record.name] = record
            self._cond.notify_all()
        for i, tier in enumerate(self.config.tiers):
            if i == exclude or record.tiers[i].copy != "committed":
                continue
            storage = CheckpointStorage(tier.copy_url(record.name), tier.options())
            try:
                if storage.is_committed():  # never resurrect a deleted copy as a bare record
                    write_record(storage, record)
            except CheckpointError as exc:
                log.warning("could not write the status record of %s to tier %d: %s", record.name, i, exc)

    def _emit(self, record: StatusRecord, key: str, kind: str, **extra: Any) -> None:
        event = {"name": record.name, "stage": key, "event": kind, **extra}
        with self._cond:
            if kind == "start":
                self._progress[record.name] = {"stage": key, "done_bytes": 0, "total_bytes": None}
            elif kind == "progress":
                self._progress[record.name] = {"stage": key, "done_bytes": extra["done_bytes"],
                                               "total_bytes": extra["total_bytes"]}
        if self.config.on_event is not None:
            try:
                self.config.on_event(event)
            except Exception as exc:  # an observer's bug must not fail the checkpoint
                log.warning("on_event callback failed on %s: %s", event, exc)

    def _apply_retention(self, k: int, current: StatusRecord) -> str:
        """Prune tier ``k`` by its policy. A copy is kept while its pipeline runs, and on a tier
        below the last while a higher tier never received it (replication pending or failed)."""
        tier = self.config.tiers[k]
        policy = tier.retention
        if policy is None:
            return "no policy"
        last = len(self.config.tiers) - 1
        candidates, records = [], {}
        for c in list_committed(tier.url, tier.options(), links=False):
            record = self._record_of(c.name, k)
            if record is None or not under_retention([e.key for e in record.stages], [t.url for t in record.tiers],
                                                     k, tier.copy_url(c.name)):
                continue  # not saved under a retention policy of this tier: never ours to prune
            records[c.name] = record
            protected = c.name != current.name and not record.finished
            if k < last:
                protected |= any(t.copy in ("absent", "failed") for t in record.tiers[k + 1:])
            candidates.append(Candidate(c.name, record.seq, protected))
        doomed = policy.select(candidates)
        for name in doomed:
            record = records[name]
            record.tiers[k].copy = "pruned"
            self._persist(record, exclude=k)  # the other copies learn it first
            remove_checkpoint(tier.copy_url(name), tier.options(), also=lambda n: pipeline_file(n, EXPORT_DIR))
        return f"pruned {', '.join(doomed)}" if doomed else "nothing to prune"

    def _record_of(self, name: str, k: int) -> StatusRecord | None:
        with self._cond:
            record = self._records.get(name) or self._known.get(name)
        if record is not None:
            return record
        tier = self.config.tiers[k]
        try:
            record = read_record(CheckpointStorage(tier.copy_url(name), tier.options()))
        except CheckpointError as exc:
            log.warning("retention skips %s: %s", tier.copy_url(name), exc)
            return None
        if record is not None:
            with self._cond:
                self._known.setdefault(name, record)
        return record
