"""The committed checkpoints under a root directory, and pruning all but the newest few.

A checkpoint directory counts as committed when it holds METADATA_NAME; its age is that file's
modification time, which :meth:`CheckpointStorage.commit` sets. Directories without it (a save
in progress, or one that failed) are never listed and never deleted here.

Retention's scope is the root it is given: the committed checkpoints directly under it, never a
deeper or a sibling directory. Pruning one removes only the files that follow raydcp's own naming
(:func:`raydcp.storage.commits.raydcp_file`: the metadata, the commit log, the data files), the
metadata first; any other file in it (a README, a user's data) stays, and so does the directory
then. Nothing is reached through a symbolic link: a link under the root (``latest -> step-9``)
is not a checkpoint of the root, and a checkpoint whose ``data/`` links elsewhere loses only its
own files.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

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
from . import references
from .commits import linked, raydcp_file
from .fs import CheckpointStorage

__all__ = ["CommittedCheckpoint", "list_committed", "apply_retention", "remove_checkpoint"]


@dataclass(frozen=True)
class CommittedCheckpoint:
    """A committed checkpoint directly under a root: its URL (or local path), directory name,
    and commit time (seconds since the epoch, from the metadata file's modification time)."""

    url: str
    name: str
    committed_at: float


def list_committed(root: str | os.PathLike, storage_options: dict | None = None, *,
                   links: bool = True) -> list[CommittedCheckpoint]:
    """The committed checkpoints directly under ``root``, oldest first (ties broken by name).

    A root that does not exist holds none. ``links=False`` leaves out directories that are
    symbolic links (what retention may prune).
    """
    fs, root_path, root_url = open_fs(root, storage_options, "root")
    plain = is_plain_local(os.fspath(root), fs)
    found: list[CommittedCheckpoint] = []
    with translating("list the checkpoints under", root_url):
        for name, path in _subdirectories(fs, root_path, links):
            committed_at = _commit_time(fs, f"{path}/{METADATA_NAME}")
            if committed_at is not None:
                found.append(CommittedCheckpoint(to_url(fs, path, plain_local=plain), name, committed_at))
    found.sort(key=lambda c: (c.committed_at, c.name))
    return found


def apply_retention(root: str | os.PathLike, keep_last: int, storage_options: dict | None = None) -> list[str]:
    """Delete all but the newest ``keep_last`` committed checkpoints under ``root``.

    Returns the URLs deleted, oldest first. Uncommitted directories are left alone, and the newest
    committed checkpoint is never deleted (``keep_last`` must be at least 1). Only checkpoints
    directly under ``root`` count, never one reached through a symbolic link, and each goes by
    :func:`remove_checkpoint` (raydcp's own files only).
    """
    if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
        raise CheckpointError(
            f"apply_retention({os.fspath(root)!r}, keep_last={keep_last!r}): keep_last must be an "
            "integer >= 1, since the newest committed checkpoint is always kept; to remove one "
            "checkpoint on purpose use CheckpointStorage(url).delete()"
        )
    committed = list_committed(root, storage_options, links=False)
    doomed = committed[: max(0, len(committed) - keep_last)]
    for checkpoint in doomed:
        remove_checkpoint(checkpoint.url, storage_options)
    return [c.url for c in doomed]


def remove_checkpoint(url: str | os.PathLike, storage_options: dict | None = None, *,
                      also: Callable[[str], bool] | None = None) -> list[str]:
    """Remove the files of the checkpoint at ``url`` that raydcp wrote; returns those left there.

    1. the metadata goes first, so an interrupted removal leaves an uncommitted directory, never a
       committed, damaged checkpoint;
    2. then every other file whose name (relative to the checkpoint) follows raydcp's naming
       (:func:`~raydcp.storage.commits.raydcp_file`) or ``also`` (a layer above names its own
       files: the pipeline its status record and exports), never one reached through a symbolic
       link below the checkpoint, and never one that a delta checkpoint still references
       (:mod:`raydcp.storage.references`: those stay, with the pins that keep them, until no
       checkpoint references them);
    3. directories left empty go with them (local disks; elsewhere directories are prefixes);
    4. the checkpoints this one referenced (a delta checkpoint's bases) that were removed before
       it are swept: their files that no checkpoint references any more go.

    The other files (a README beside the data, a user's file in ``data/``) are returned, and
    their directories stay.
    """
    storage = CheckpointStorage(url, storage_options)
    owners = references.referenced_owners(storage) if storage.is_committed() else []
    left = _remove_unreferenced(storage, also)
    for path in owners:
        owner = storage.at(path)
        if not owner.is_committed():
            _remove_unreferenced(owner, None)
    return left


def _remove_unreferenced(storage: CheckpointStorage, also: Callable[[str], bool] | None) -> list[str]:
    names = storage.list_files()
    through_link = {d for d in {n.rsplit("/", 1)[0] for n in names if "/" in n} if linked(storage, d)}
    own = [n for n in names if (raydcp_file(n) or (also is not None and also(n)))
           and ("/" not in n or n.rsplit("/", 1)[0] not in through_link)]
    pinned = any(n.startswith(f"{references.PIN_DIR}/") for n in own)
    if pinned:  # referenced by delta checkpoints: removal under a tombstone (see references)
        storage.write_file(references.TOMBSTONE, [b""])
    if METADATA_NAME in own:
        storage.remove_files([METADATA_NAME])
    keep: set[str] = set()
    if pinned:
        needed, stale = references.referenced_files(storage)
        live_pins = {n for n in own if n.startswith(f"{references.PIN_DIR}/")} - set(stale)
        data = {n for n in own if n.startswith("data/")}
        keep = (data if needed is None else needed & data) | live_pins
        if keep:  # the data of the saves kept: their digest files stay beside them
            dirs = {n.rsplit("/", 1)[0] for n in keep if n.startswith("data/")}
            keep |= {n for n in data if n.rsplit("/", 1)[0] in dirs and n.endswith(".xxh3")}
    storage.remove_files([n for n in own if n != METADATA_NAME and n not in keep and n != references.TOMBSTONE])
    if pinned:
        storage.remove_files([references.TOMBSTONE])
    if is_local(storage.fs):
        try:
            os.rmdir(storage.path)  # only when nothing else is left in it
        except OSError:
            pass
    gone = set(own) - keep
    return [n for n in names if n not in gone and n not in keep]


def _subdirectories(fs, root_path: str, links: bool = True) -> list[tuple[str, str]]:
    """``(name, path)`` of each directory directly under ``root_path``, sorted by name
    (``links=False``: not those that are symbolic links)."""
    if is_local(fs):
        try:
            entries = [e for e in os.scandir(root_path) if e.is_dir() and (links or not e.is_symlink())]
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
