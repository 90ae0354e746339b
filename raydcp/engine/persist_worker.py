"""The helper process of :mod:`raydcp.engine.persist`: writes staged pieces, commits last."""
from __future__ import annotations

import sys
from multiprocessing import resource_tracker, shared_memory
from multiprocessing.connection import Connection
from typing import Any

import torch

from ..errors import CheckpointError
from ..storage import CheckpointStorage
from .persist import lower_priority
from .save import StagedState, _reduce_commit, write_rank_files


def _attach(name: str, size: int) -> tuple[shared_memory.SharedMemory, torch.Tensor]:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the parent owns and unlinks it
    return shm, torch.frombuffer(shm.buf, dtype=torch.uint8, count=size)


def _run(job: dict) -> Any:
    shm, arena = _attach(job["arena"], job["arena_size"])
    try:
        plan = job["local_plan"]
        data: list[Any] = [None] * len(plan.items)
        for i, (off, n) in job["layout"].items():
            data[i] = arena.narrow(0, off, n)
        storage = CheckpointStorage(job["checkpoint_id"], job["storage_options"])
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
            outbox.send((job["id"], False, str(exc)))
        except Exception as exc:  # reported to the trainer, which raises it at result()
            outbox.send((job["id"], False, f"persisting failed: {type(exc).__name__}: {exc}"))


if __name__ == "__main__":
    lower_priority()
    _serve(Connection(int(sys.argv[1]), writable=False), Connection(int(sys.argv[2]), readable=False))
