"""Persisting staged checkpoints in a helper process, so the trainer's GIL is never contended.

Protocol (parent = the training process, helper = ``python -m raydcp.engine.persist_worker``):

1. The parent stages pieces into an arena (:class:`StagingArena`: its own private
   memory, or shared memory) and sends a job: the write plan of some files, where
   each piece sits in the arena, and -- for the last job of a save -- the header to
   commit. For a private arena, ``submit(job, reads_memory=True)`` first names the
   helper as the process allowed to read the parent's memory
   (:func:`raydcp.engine.procmem.allow_reader`).
2. The helper (running at a lower CPU priority, :func:`lower_priority`, so
   that its checksums and copies do not slow the training steps) attaches to a
   shared arena by name or copies a private one's pieces out a chunk at a time,
   writes the files (fsync), and for the last job writes the
   metadata last, atomically. It answers with the
   storage records (or the Metadata, or an error message). The parent does not
   touch the arena until the answer to the job's save has come.
3. A watcher thread in the parent (blocked on the pipe, not on the GIL) resolves
   the job's future; if the helper dies, every pending future fails with a
   CheckpointError and the next save starts a new helper.

Only raydcp's own plans and records cross the pipe; checkpoint data never does.
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

from ..errors import CheckpointError
from . import procmem

__all__ = ["HelperPersister", "lower_priority", "PERSIST_NICE_ENV"]

PERSIST_NICE_ENV = "RAYDCP_PERSIST_NICE"


def lower_priority() -> int:
    """Let this (persisting) process yield the CPU to training: raise its nice value by
    ``RAYDCP_PERSIST_NICE`` (default 19, the lowest priority: the persist then runs on CPU time
    training leaves idle, as on GPU nodes, and slows down rather than slowing a CPU-bound trainer;
    0 leaves it). Returns the nice value now in effect."""
    try:
        step = int(os.environ.get(PERSIST_NICE_ENV, "19"))
    except ValueError:
        step = 19
    if step <= 0 or not hasattr(os, "nice"):
        return os.nice(0) if hasattr(os, "nice") else 0
    try:
        return os.nice(step)
    except OSError:
        return os.nice(0)


class HelperPersister:
    """One helper process per training process, started on first use and reused."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._pending: dict[int, cf.Future] = {}
        self._ids = itertools.count()
        self._reader: int | None = None  # the helper pid named by allow_reader

    def _ensure(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "raydcp.engine.persist_worker", str(to_child_r), str(to_parent_w)],
            pass_fds=(to_child_r, to_parent_w), close_fds=True,
        )
        os.close(to_child_r)
        os.close(to_parent_w)
        self._conn = Connection(to_child_w, readable=False)
        reader = Connection(to_parent_r, writable=False)
        threading.Thread(target=self._watch, args=(self._proc, reader), daemon=True,
                         name="raydcp-persist-watch").start()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def submit(self, job: dict, *, reads_memory: bool = False) -> cf.Future:
        fut: cf.Future = cf.Future()
        with self._lock:
            self._ensure()
            if reads_memory and self._reader != self._proc.pid:
                procmem.allow_reader(self._proc.pid)
                self._reader = self._proc.pid
            job_id = next(self._ids)
            self._pending[job_id] = fut
            try:
                self._conn.send({**job, "id": job_id})
            except OSError as exc:
                self._pending.pop(job_id)
                fut.set_exception(CheckpointError(f"the persisting helper process is gone ({exc}); retry the save"))
        return fut

    def _watch(self, proc: subprocess.Popen, reader: Connection) -> None:
        while True:
            try:
                job_id, ok, result = reader.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = self._pending.pop(job_id, None)
            if fut is not None:
                if ok:
                    fut.set_result(result)
                else:
                    fut.set_exception(CheckpointError(result))
        code = proc.wait()
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(CheckpointError(
                f"the process persisting the checkpoint died (exit status {code}) before it committed; "
                f"nothing was committed and the previous checkpoint at that path is intact: save again"))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._conn.close()
            self._proc.wait(timeout=30)
