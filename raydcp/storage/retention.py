"""The committed checkpoints under a root directory, and pruning all but the newest few.

A checkpoint directory counts as committed when it holds METADATA_NAME; its age is that file's
modification time, which :meth:`CheckpointStorage.commit` sets. Directories without it (a save
in progress, or one that failed) are never listed and never deleted here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import CheckpointError
from ._common import (
    METADATA_NAME,
    forget,
    info_timestamp,
    is_local,
    is_plain_local,
    open_fs,
    to_url,
    translating,
)
from .fs import CheckpointStorage

__all__ = ["CommittedCheckpoint", "list_committed", "apply_retention"]


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint directly under a root: its URL (or local path), directory name,
    and commit time (seconds since the epoch, from the metadata file's modification time)."""

    url: str
    name: str
    committed_at: float


def list_committed(root: str | os.PathLike, storage_options: dict | None = None) -> list[CommittedCheckpoint]:
    """The committed checkpoints directly under ``root``, oldest first (ties broken by name).

    A root that does not exist holds none.
    """
    fs, root_path, root_url = open_fs(root, storage_options, "root")
    plain = is_plain_local(os.fspath(root), fs)
    found: list[CommittedCheckpoint] = []
    with translating("list the checkpoints under", root_url):
        for name, path in _subdirectories(fs, root_path):
            committed_at = _commit_time(fs, f"{path}/{METADATA_NAME}")
            if committed_at is not None:
                found.append(CommittedCheckpoint(to_url(fs, path, plain_local=plain), name, committed_at))
    found.sort(key=lambda c: (c.committed_at, c.name))
    return found


def apply_retention(root: str | os.PathLike, keep_last: int, storage_options: dict | None = None) -> list[str]:
    """Delete all but the newest ``keep_last`` committed checkpoints under ``root``.

    Returns the URLs deleted, oldest first. Uncommitted directories are left alone, and the newest
    committed checkpoint is never deleted (``keep_last`` must be at least 1).
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(
            f"apply_retention({os.fspath(root)!r}, keep_last={keep_last!r}): keep_last must be an "
            "integer >= 1, since the newest committed checkpoint is always kept; to remove one "
            "checkpoint on purpose use CheckpointStorage(url).delete()"
        )
    committed = list_committed(root, storage_options)
    doomed = committed[: max(0, len(committed) - keep_last)]
    for checkpoint in doomed:
        CheckpointStorage(checkpoint.url, storage_options).delete()
    return [c.url for c in doomed]


def _subdirectories(fs, root_path: str) -> list[tuple[str, str]]:
    """``(name, path)`` of each directory directly under ``root_path``, sorted by name."""
    if is_local(fs):
        try:
            entries = [e for e in os.scandir(root_path) if e.is_dir()]
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted((e.name, f"{root_path}/{e.name}") for e in entries)
    forget(fs, root_path)
    try:
        entries = fs.ls(root_path, detail=True)
    except FileNotFoundError:
        return []
    out = []
    for entry in entries:
        if entry.get("type") != "directory":
            continue
        path = entry["name"].rstrip("/")
        out.append((path.rsplit("/", 1)[-1], path))
    return sorted(out)


def _commit_time(fs, meta_path: str) -> float | None:
    """Modification time of a metadata file, or None if it does not exist."""
    if is_local(fs):
        try:
            st = os.stat(meta_path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        return st.st_mtime
    try:
        info = fs.info(meta_path)
    except FileNotFoundError:
        return None
    if info.get("type") != "file":
        return None
    stamp = info_timestamp(info)
    if stamp is None:
        try:
            stamp = fs.modified(meta_path).timestamp()
        except Exception:
            stamp = 0.0  # no time known: order by name only
    return stamp
