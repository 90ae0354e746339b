"""The helper process of :mod:`raydcp.engine.persist`: writes staged pieces, commits last.

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
from ..storage import CheckpointStorage
from . import procmem
from .persist import lower_priority
from .staging import STAGING_ENV
from .save import StagedState, _reduce_commit, write_rank_files


def _attach(name: str, size: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the parent owns and unlinks it
    return shm, torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)


def _memory_reader(job: dict):
    """``read(file, item, start, nbytes, address)`` over the trainer's private arena: only the
    staged range of each piece is ever read, and a failed read names the piece, the file and
    what to do."""
    pid, base, size = job["source"]["pid"], job["source"]["address"], job["source"]["size"]
    layout, items = job["layout"], job["local_plan"].items

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


def _run(job: dict) -> Any:
    plan = job["local_plan"]
    storage = CheckpointStorage(job["checkpoint_id"], job["storage_options"])
    if job.get("source") is not None:  # the trainer's private arena, read a chunk at a time
        data: list[Any] = [None] * len(plan.items)
        records = write_rank_files(storage, job["write_plan"], StagedState(plan, data), _memory_reader(job))
    else:  # a shared-memory arena, written from straight away
        shm, arena = _attach(job["arena"], job["arena_size"])
        try:
            data = [None] * len(plan.items)
            for i, (off, n) in job["layout"].items():
                data[i] = arena.narrow(0, off, n)
            records = write_rank_files(storage, job["write_plan"], StagedState(plan, data))
            del data
        finally:
            del arena
            shm.close()
    if job.get("header") is None:
        return records
    return _reduce_commit(job["checkpoint_id"], job["storage_options"],
                          [(job["records"] + records, job["header"])])[0]


def _serve(inbox: Connection, outbox: Connection) -> None:
    while True:
        try:
            job = inbox.recv()
        except EOFError:
            return
        try:
            outbox.send((job["id"], True, _run(job)))
        except CheckpointError as exc:
            outbox.send((job["id"], False, exc))  # typed errors pickle with their attributes
        except Exception as exc:  # reported to the trainer, which raises it at result()
            outbox.send((job["id"], False, f"persisting failed: {type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    lower_priority()
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
