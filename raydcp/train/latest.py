"""The newest checkpoint raydcp committed in a Ray Train run's storage, registered or not.

Ray Train registers a checkpoint when every worker has reported it (``ray.train.report`` is a
barrier of the whole worker group). A checkpoint the survivors of a preemption committed
(:mod:`raydcp.train.preemption`) may never be: the preempted workers are gone before they report.
raydcp's commit is what makes a checkpoint whole, so :func:`raydcp.train.restore` resumes from
the newest *committed* one of the run, found by listing the run's directory: the one Ray Train
registered last, or a newer one it never registered. A directory whose save did not commit is
never chosen (and is removed before, :func:`raydcp.train.checkpoint.remove_uncommitted`).
"""
from __future__ import annotations

from typing import Any

from ..api import read_metadata
from ..errors import CheckpointError
from ..storage import CheckpointStorage
from ._context import fsspec_location
from .memory_saves import step_of_dir

__all__ = ["latest_committed"]


def latest_committed(storage: Any, registered: Any, run_dirs: list[tuple[str, str]],
                     storage_options: dict | None = None) -> tuple[str, str] | None:
    """``(name, URL)`` of the run's newest committed checkpoint (the latest commit), or None.

    ``storage``: Ray Train's StorageContext; ``registered``: the checkpoint Ray Train holds
    (``ray.train.get_checkpoint()``) or None; ``run_dirs``: the run's raydcp directories as
    ``(name, URL)`` (:func:`raydcp.train.checkpoint.run_checkpoint_dirs`)."""
    _, options = fsspec_location(storage.storage_filesystem, storage.experiment_fs_path, storage_options)
    best: tuple[float, str, str] | None = None
    names = {name for name, _ in run_dirs}
    candidates = list(run_dirs)
    if registered is not None:
        url, _ = fsspec_location(registered.filesystem, registered.path, storage_options)
        name = str(registered.path).rstrip("/").rsplit("/", 1)[-1]
        if name not in names:  # a registered checkpoint outside the run's directory
            candidates.append((name, url))
    floor = None if registered is None else step_of_dir(str(registered.path).rstrip("/").rsplit("/", 1)[-1])
    for name, url in candidates:
        step = step_of_dir(name)
        if floor is not None and step is not None and step < floor:
            continue  # older than the registered one by its step: not the newest
        try:
            if not CheckpointStorage(url, options).is_committed():
                continue
            created = read_metadata(url, storage_options=options).created_at
        except CheckpointError:
            continue  # damaged or removed meanwhile: not one to resume from
        if best is None or created > best[0]:
            best = (created, name, url)
    return None if best is None else (best[1], best[2])
