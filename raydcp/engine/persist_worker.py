"""The helper process of :mod:`raydcp.engine.persist`: runs one save at a time as a
:class:`~raydcp.engine.session.PersistSession` over the in-process transport (begin, write each
batch, commit).

The pieces are in a shared-memory arena (attached by name) or in the trainer's private arena
(copied out with :func:`raydcp.engine.procmem.read_into`, one chunk of a file at a time).
"""
from __future__ import annotations

import sys
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..errors import CheckpointError
from ..options import DEFAULT_SAVE, STAGING_ENV
from ..transport import LocalTransport
from . import procmem
from .persist import lower_priority
from .save import StagedState
from .session import PersistSession


def attach_arena(name: str, size: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    """A shared staging arena another process made (``StagingArena(shared=True)``), attached by
    name: ``(its SharedMemory, a uint8 tensor of its first size bytes)``; the maker unlinks it."""
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the parent owns and unlinks it
    return shm, torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)


def _memory_reader(job: dict, items):
    """``read(file, item, start, nbytes, address)`` over the trainer's private arena: only the
    staged range of each piece is ever read, and a failed read names the piece, the file and
    what to do."""
    pid, base, size = job["source"]["pid"], job["source"]["address"], job["source"]["size"]
    layout = job["layout"]

    def read(name: str, item: int, start: int, nbytes: int, address: int) -> None:
        off, length = layout[item]
        if start < 0 or nbytes < 0 or start + nbytes > length or off + length > size:
            raise CheckpointError(
                f"internal error: a read of bytes [{start}, {start + nbytes}) of {items[item].key} "
                f"(staged: {length} bytes at {off} of a {size}-byte arena) was refused; nothing was committed")
        try:
            procmem.read_into(pid, base + off + start, nbytes, address)
        except OSError as exc:
            raise CheckpointError(
                f"could not read the staged bytes of {items[item].key} for {name} from the training process "
                f"(pid {pid}): {exc}; nothing was committed and the previous checkpoint at that path is "
                f"intact. Save again, or set {STAGING_ENV}=shm to stage in shared memory instead") from None
    return read


class _Helper:
    """The helper's one save in progress (saves arrive one after another)."""

    def __init__(self) -> None:
        self.session: PersistSession | None = None

    def run(self, job: dict) -> Any:
        op = job["op"]
        if op == "begin":
            self.session = PersistSession(LocalTransport(), job["checkpoint_id"], job["storage_options"],
                                          job["local_plan"], job["cap"], job.get("save_options") or DEFAULT_SAVE)
            return self.session.begin()
        session = self.session
        if session is None:
            raise CheckpointError(f"internal error: a {op!r} job without a save in progress; nothing was committed")
        if op == "write":
            return self._write(session, job)
        self.session = None
        if job.get("error") is not None:
            session.fail(job["error"])
        return session.commit()

    @staticmethod
    def _write(session: PersistSession, job: dict) -> bool:
        if session.plan_error is not None:
            return False
        plan = session.local_plan
        data: list[Any] = [None] * len(plan.items)
        if job.get("source") is not None:  # the trainer's private arena, read a chunk at a time
            return session.write(job["index"], StagedState(plan, data), _memory_reader(job, plan.items))
        shm, arena = attach_arena(job["arena"], job["arena_size"])  # a shared arena, written from straight away
        try:
            for i, (off, n) in job["layout"].items():
                data[i] = arena.narrow(0, off, n)
            ok = session.write(job["index"], StagedState(plan, data))
            del data
            return ok
        finally:
            del arena
            shm.close()


def _serve(inbox: Connection, outbox: Connection) -> None:
    helper = _Helper()
    while True:
        try:
            job = inbox.recv()
        except EOFError:
            return
        try:
            outbox.send((job["id"], True, helper.run(job)))
        except CheckpointError as exc:
            outbox.send((job["id"], False, exc))  # typed errors pickle with their attributes
        except Exception as exc:  # reported to the trainer, which raises it at result()
            outbox.send((job["id"], False, f"persisting failed: {type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    lower_priority(int(sys.argv[3]) if len(sys.argv) > 3 else 19)
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
