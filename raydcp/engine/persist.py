"""The asynchronous persister of a process saving alone: a helper process writes and commits.

:class:`LocalPersister` is the :class:`~raydcp.engine.background.AsyncPersister` for
``group=None``; its writes run in a helper process (``python -m raydcp.engine.persist_worker``,
:class:`HelperProcess`), so the trainer's GIL is never contended. Protocol (parent = the
training process, helper = the helper process), per save:

1. ``begin``: the parent sends the local plan and the save's options; the helper opens a
   :class:`~raydcp.engine.session.PersistSession` over the in-process transport and runs the
   plan step (it answers with the plan items of each batch).
2. ``write``, per batch: the parent stages the batch's pieces into its arena
   (:class:`StagingArena`: its own private memory, or shared memory) and sends where each
   piece sits. For a private arena the helper is first named as the process allowed to read
   the parent's memory (:func:`raydcp.engine.procmem.allow_reader`). The helper (at a lower
   CPU priority, :func:`lower_priority`, so that its checksums and copies do not slow the
   training steps) attaches to a shared arena by name, or copies a private one's pieces out a
   chunk at a time, and writes the batch's files (fsync). The parent does not touch the arena
   until the save has finished.
3. ``commit``: the helper writes the metadata last, atomically, and answers with it.

The parent sends the jobs from one hand-over thread, in order, so that pickling a large plan
never stalls the caller. A watcher thread in the parent (blocked on the pipe, not on the GIL)
resolves each job's future; if the helper dies, every pending future fails with a
CheckpointError and the next save starts a new helper.

Only raydcp's own plans and records cross the pipe; checkpoint data never does.
"""
from __future__ import annotations

import atexit
import concurrent.futures as cf
import itertools
import os
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from typing import Callable

from ..errors import CheckpointError, CoordinatorLostError, RankFailure
from ..options import PERSIST_NICE_ENV, AsyncOptions, SaveOptions
from . import procmem
from .background import wait_for_last_save
from .delta import writer_environment
from .save import StagedState
from .staging import StagingArena, staging_mode

__all__ = ["LocalPersister", "HelperProcess", "local_persister", "lower_priority", "PERSIST_NICE_ENV",
           "add_helper_environment"]


def lower_priority(step: int = 19) -> int:
    """Let this (persisting) process yield the CPU to training: raise its nice value by ``step``
    (``AsyncOptions.persist_nice``, ``RAYDCP_PERSIST_NICE``; default 19, the lowest priority: the
    persist then runs on CPU time training leaves idle, as on GPU nodes, and slows down rather
    than slowing a CPU-bound trainer; 0 leaves it). Returns the nice value now in effect."""
    if step <= 0 or not hasattr(os, "nice"):
        return os.nice(0) if hasattr(os, "nice") else 0
    try:
        return os.nice(step)
    except OSError:
        return os.nice(0)


# Variables a helper process gets in its environment beside this process's own: providers that
# the layers above register (the Ray runtime names the cluster this process is connected to, so
# a helper's raymem:// writes reach it), asked when a helper starts. This process's own
# environment is left as it is.
_HELPER_ENV: list[Callable[[], dict[str, str]]] = []


def add_helper_environment(provider: Callable[[], dict[str, str]]) -> None:
    """Register ``provider``: the variables it returns are set in each helper process started later."""
    if provider not in _HELPER_ENV:
        _HELPER_ENV.append(provider)


add_helper_environment(writer_environment)  # a helper's delta saves are this process's (base="previous")


class HelperProcess:
    """One helper process per training process, started on first use and reused."""

    def __init__(self, nice: int = 19) -> None:
        self.nice = nice
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._pending: dict[int, cf.Future] = {}
        self._ids = itertools.count()
        self._reader: int | None = None  # the helper pid named by allow_reader
        self._extra: dict[str, str] = {}  # what the helper's environment got from _HELPER_ENV

    def _ensure(self) -> None:
        extra: dict[str, str] = {}
        for provider in list(_HELPER_ENV):
            extra.update(provider())
        if self._proc is not None and self._proc.poll() is None:
            if extra == self._extra or self._pending:
                return
            # this process reaches another cluster now (a new Ray session): an idle helper of the old one retires
            self._conn.close()
            self._proc.wait(timeout=30)
        self._extra = extra
        self._pending = {}  # this helper's jobs: a retired helper's watcher fails only its own
        env = {**os.environ, **extra}
        to_child_r, to_child_w = os.pipe()
        to_parent_r, to_parent_w = os.pipe()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "raydcp.engine.persist_worker", str(to_child_r), str(to_parent_w), str(self.nice)],
            pass_fds=(to_child_r, to_parent_w), close_fds=True, env=env,
        )
        os.close(to_child_r)
        os.close(to_parent_w)
        self._conn = Connection(to_child_w, readable=False)
        reader = Connection(to_parent_r, writable=False)
        threading.Thread(target=self._watch, args=(self._proc, reader, self._pending), daemon=True,
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
                fut.set_exception(CoordinatorLostError(f"the persisting helper process is gone ({exc}); retry the save"))
        return fut

    def _watch(self, proc: subprocess.Popen, reader: Connection, jobs: dict[int, cf.Future]) -> None:
        while True:
            try:
                job_id, ok, result = reader.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = jobs.pop(job_id, None)
            if fut is not None:
                if ok:
                    fut.set_result(result)
                else:
                    fut.set_exception(result.copy() if isinstance(result, CheckpointError) else CheckpointError(result))
        code = proc.wait()
        with self._lock:
            pending = list(jobs.values())
            jobs.clear()
        for fut in pending:
            fut.set_exception(CoordinatorLostError(
                f"the process persisting the checkpoint died (exit status {code}) before it reported the commit: "
                f"the save either committed whole (the process died just after) or not at all, leaving the "
                f"previous checkpoint at that path intact; raydcp.read_metadata(path) tells which: save again"))

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._conn.close()
            self._proc.wait(timeout=30)


def _relay(outer: cf.Future, send: Callable[[], cf.Future]) -> None:
    """On the hand-over thread: send a job and resolve ``outer`` with the helper's answer."""
    try:
        inner = send()
    except BaseException as exc:
        outer.set_exception(exc if isinstance(exc, CheckpointError) else CheckpointError(f"{type(exc).__name__}: {exc}"))
        return

    def resolve(done: cf.Future) -> None:
        exc = done.exception()
        if exc is not None:
            outer.set_exception(exc)
        else:
            outer.set_result(done.result())
    inner.add_done_callback(resolve)


class LocalPersister:
    """The :class:`~raydcp.engine.background.AsyncPersister` of a process saving alone (see the module doc)."""

    rank = 0
    world_size = 1

    def __init__(self) -> None:
        self.helper: HelperProcess | None = None
        self.arena: StagingArena | None = None
        self._private = False
        self._cap: int | None = None
        self._handover = cf.ThreadPoolExecutor(1, thread_name_prefix="raydcp-handover")  # jobs in save order

    def begin(self, plan, checkpoint_id: str, storage_options, options: AsyncOptions,
              save_options: SaveOptions) -> cf.Future:
        private = staging_mode(options.staging) == "private"
        if self.helper is None or self.helper.nice != options.persist_nice:
            if self.helper is not None:
                self.helper.close()
            self.helper = HelperProcess(options.persist_nice)
        if self.arena is None or self.arena.shared == private:  # first save, or the staging mode changed
            if self.arena is not None:
                self.arena.close()
            self.arena = StagingArena(shared=not private, huge_pages=private)
        # The arena is free to overwrite: the previous save has finished with it.
        self._private, self._cap = private, options.max_staging_bytes
        return self._send({"op": "begin", "local_plan": plan, "checkpoint_id": checkpoint_id,
                           "storage_options": storage_options, "cap": self._cap, "save_options": save_options})

    def write(self, index: int, staged: StagedState, items: list[int]) -> cf.Future:
        layout = self.arena.stage(staged, items, limit=self._cap)
        return self._send({"op": "write", "index": index, "layout": layout, **self._where()}, self._private)

    def commit(self, error: "RankFailure | str | None") -> cf.Future:
        return self._send({"op": "commit", "error": error})

    def _where(self) -> dict:
        """Where the helper finds the staged bytes: this process's private arena, or the shared one."""
        if self._private:
            return {"source": {"pid": os.getpid(), "address": self.arena.address, "size": self.arena.buffer.numel()}}
        return {"arena": self.arena.shm_name, "arena_size": self.arena.buffer.numel()}

    def _send(self, job: dict, reads_memory: bool = False) -> cf.Future:
        outer: cf.Future = cf.Future()
        helper = self.helper
        self._handover.submit(_relay, outer, lambda: helper.submit(job, reads_memory=reads_memory))
        return outer

    def close(self) -> None:
        """At exit: let the last save finish, stop the helper, free the shared staging memory."""
        wait_for_last_save()
        if self.helper is not None:
            self.helper.close()
        if self.arena is not None:
            self.arena.close()


_LOCAL: LocalPersister | None = None


def local_persister() -> LocalPersister:
    """This process's LocalPersister (started on first use, stopped at exit)."""
    global _LOCAL
    if _LOCAL is None:
        _LOCAL = LocalPersister()
        atexit.register(_LOCAL.close)
    return _LOCAL
