"""Room for a whole save, reserved at its plan step, where a backend's room is per place.

Most filesystems have no room to reserve (a disk fills, and the write says so). A backend whose
room is counted per place -- ``raymem://``, whose bytes live in each node's object store under a
per-node byte cap -- can refuse a save that does not fit *before* any rank stages or writes a
byte, and reserve the room so that two saves running at once cannot both count on it. It does
so through three optional methods of its fsspec filesystem; raydcp's save protocol
(:mod:`raydcp.engine.protocol`) calls them through the functions here, and they are no-ops on
every other filesystem:

1. ``fs.writer_site()`` -- on every writing rank, at the plan step, in the process that will
   write: where this process's writes land (any picklable value; ``raymem://``: its node and the
   byte cap it sees). Sent to the coordinator beside the rank's local plan.
2. ``fs.reserve_save(path, save_id, bytes_by_site)`` -- on the coordinator, once the global plan
   is known: the bytes the ranks of each site will write into ``data/<save_id>/``. Raises a
   :class:`~raydcp.errors.CheckpointError` naming the place, the bytes needed and free, and the
   knob to change, when they do not fit; nothing is held then.
3. ``fs.release_save(path, save_id)`` -- on every rank of a save that failed after its plan
   step (idempotent). A save that commits releases its reservation itself, at the commit.
"""
from __future__ import annotations

from typing import Any, Mapping

__all__ = ["writer_site", "reserve_save", "release_save", "reserves_capacity"]


def reserves_capacity(storage) -> bool:
    """Whether the backend of ``storage`` (a CheckpointStorage) reserves room at the plan step."""
    return callable(getattr(storage.fs, "reserve_save", None))


def writer_site(storage) -> Any:
    """Step 1: where this process's writes to ``storage`` land; None where that does not matter."""
    hook = getattr(storage.fs, "writer_site", None)
    return hook() if callable(hook) else None


def reserve_save(storage, save_id: str, bytes_by_site: Mapping[Any, int]) -> None:
    """Step 2: reserve room for save ``save_id``'s data files; CheckpointError if they do not fit."""
    hook = getattr(storage.fs, "reserve_save", None)
    if callable(hook):
        hook(storage.path, save_id, dict(bytes_by_site))


def release_save(storage, save_id: str) -> None:
    """Step 3: give back what save ``save_id`` reserved (a save that failed)."""
    hook = getattr(storage.fs, "release_save", None)
    if callable(hook):
        hook(storage.path, save_id)
