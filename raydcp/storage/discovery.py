"""Finding checkpoints below a directory, and saying what a path holds when it holds none.

- :func:`find_checkpoints` searches a directory and its subdirectories (down to ``max_depth``
  levels) for raydcp checkpoints: the committed ones (a directory holding METADATA_NAME) and the
  saves that have not committed (a directory holding the commit log ``_raydcp/`` but no
  metadata). It never descends into a checkpoint, so a run directory of large checkpoints costs
  one listing per directory, not one per data file. ``raydcp ls`` is built on it.
- :func:`not_found_error` is the error :meth:`CheckpointStorage.read_metadata_bytes` raises for a
  path without committed metadata, with its reason: the path does not exist; it is a file; it
  is a directory of checkpoints (a few named); a save there has not committed; another format
  (the layers above name it: :func:`raydcp.convert.detect.with_format_hint`); or nothing of raydcp's.
  ``CheckpointNotFoundError.reason`` names the case for callers.
"""
from __future__ import annotations

import os
from collections import deque
from dataclasses import dataclass

from ..errors import CheckpointError, CheckpointNotFoundError
from ._common import METADATA_NAME, forget, info_timestamp, is_plain_local, open_fs, to_url, translating
from .commits import LOG_DIR

__all__ = ["DEFAULT_DEPTH", "FoundCheckpoint", "Search", "find_checkpoints", "not_found_error"]

DEFAULT_DEPTH = 3     # levels of subdirectories searched below the directory given
_MAX_DIRS = 10_000    # directories listed at most by one search
_NAMED = 3            # checkpoints named in an error message


@dataclass(frozen=True)
class FoundCheckpoint:
    """A checkpoint directory found by :func:`find_checkpoints`: its URL (or local path), its path
    relative to the directory searched (``"."`` for that directory itself), and its commit time
    (seconds since the epoch, the metadata file's modification time; None where it has not committed)."""

    url: str
    relpath: str
    committed_at: float | None

    @property
    def committed(self) -> bool:
        return self.committed_at is not None


@dataclass(frozen=True)
class Search:
    """What :func:`find_checkpoints` found under ``root``: the committed checkpoints (oldest first,
    ties by path), the saves that have not committed (by path), and whether the search stopped
    before the end (directories deeper than ``max_depth``, or more than it lists at most); also the
    removed checkpoints kept for the files delta checkpoints reference (``bases``, by path)."""

    root: str
    checkpoints: tuple[FoundCheckpoint, ...]
    uncommitted: tuple[FoundCheckpoint, ...]
    incomplete: bool
    # removed checkpoints whose files delta checkpoints still reference (raydcp.storage.references)
    bases: tuple[FoundCheckpoint, ...] = ()


def _entries(fs, path: str) -> dict[str, dict]:
    forget(fs, path)
    return {e["name"].rstrip("/").rsplit("/", 1)[-1]: e for e in fs.ls(path, detail=True)}


def _stamp(fs, entry: dict) -> float:
    stamp = info_timestamp(entry)
    if stamp is None:
        try:
            stamp = fs.modified(entry["name"]).timestamp()
        except Exception:
            stamp = 0.0  # no time known: ordered by path only
    return stamp


def _walk(fs, path: str, url: str, plain: bool, max_depth: int, max_dirs: int) -> Search:
    committed, uncommitted, bases = [], [], []
    queue = deque([(path, ".", 0)])
    listed, incomplete = 0, False
    while queue:
        here, rel, depth = queue.popleft()
        if listed >= max_dirs:
            incomplete = True
            break
        listed += 1
        try:
            entries = _entries(fs, here)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed while the search ran
        meta = entries.get(METADATA_NAME)
        here_url = url if rel == "." else to_url(fs, here, plain_local=plain)
        if meta is not None and meta.get("type") == "file":
            committed.append(FoundCheckpoint(here_url, rel, _stamp(fs, meta)))
            continue
        log = entries.get(LOG_DIR)
        if log is not None and log.get("type") == "directory":
            found = FoundCheckpoint(here_url, rel, None)
            (bases if _retired_base(fs, f"{here.rstrip('/')}/{LOG_DIR}") else uncommitted).append(found)
            continue
        subdirs = sorted(n for n, e in entries.items() if e.get("type") == "directory")
        if subdirs and depth >= max_depth:
            incomplete = True
            continue
        for name in subdirs:
            queue.append((f"{here.rstrip('/')}/{name}", name if rel == "." else f"{rel}/{name}", depth + 1))
    committed.sort(key=lambda c: (c.committed_at, c.relpath))
    uncommitted.sort(key=lambda c: c.relpath)
    bases.sort(key=lambda c: c.relpath)
    return Search(url, tuple(committed), tuple(uncommitted), incomplete, tuple(bases))


def _retired_base(fs, log_path: str) -> bool:
    """A removed checkpoint that delta checkpoints still reference: pins in its log, no save begun."""
    try:
        names = _entries(fs, log_path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    return "refs" in names and not any(n.startswith("begun-") for n in names)


def find_checkpoints(root: str | os.PathLike, storage_options: dict | None = None, *,
                     max_depth: int = DEFAULT_DEPTH, max_dirs: int = _MAX_DIRS) -> Search:
    """The checkpoints at ``root`` and below it, down to ``max_depth`` levels of subdirectories.

    ``root`` itself counts (relative path ``"."``) when it is a checkpoint. A ``root`` that does
    not exist or is a file is a :class:`CheckpointNotFoundError` saying so.
    """
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or max_depth < 0:
        raise CheckpointError(f"max_depth must be an integer >= 0, got {max_depth!r}")
    fs, path, url = open_fs(root, storage_options, "root")
    with translating("list the checkpoints under", url):
        info = _info(fs, path)
        if info is None or info.get("type") != "directory":
            raise _not_a_directory(fs, path, url, info)
        return _walk(fs, path, url, is_plain_local(os.fspath(root), fs), max_depth, max_dirs)


def _info(fs, path: str) -> dict | None:
    """``fs.info(path)``, or None where nothing is there."""
    try:
        return fs.info(path)
    except FileNotFoundError:
        return None


def _few(found: tuple[FoundCheckpoint, ...]) -> str:
    names = [c.relpath for c in found[:_NAMED]]
    return ", ".join(names) + (f" and {len(found) - _NAMED} more" if len(found) > _NAMED else "")


def _error(url: str, reason: str, detail: str, below: tuple[str, ...] = ()) -> CheckpointNotFoundError:
    return CheckpointNotFoundError(f"no committed raydcp checkpoint at {url}: {detail}", path=url, reason=reason,
                                   below=below)


def _not_a_directory(fs, path: str, url: str, info: dict | None) -> CheckpointNotFoundError:
    if info is None:
        return _error(url, "missing", "no such file or directory")
    if path.rstrip("/").rsplit("/", 1)[-1] == METADATA_NAME:
        parent = url.rstrip("/").rsplit("/", 1)[0]
        return _error(url, "file", f"it is the metadata file of a checkpoint; pass its directory: {parent}")
    return _error(url, "file", "it is a file, not a checkpoint directory")


def not_found_error(fs, path: str, url: str) -> CheckpointNotFoundError:
    """Why ``path`` (on ``fs``; shown as ``url``) holds no committed checkpoint, as the error to raise.

    Looks, in this order, for: the path itself (missing, or a file); a save there that has not
    committed (the commit log ``_raydcp/``); committed checkpoints below it (up to
    :data:`DEFAULT_DEPTH` levels); data files without metadata. Another format there is named by
    the layers above (:func:`raydcp.convert.detect.with_format_hint`). Never raises itself: where the
    storage cannot be listed the reason is left open.
    """
    try:
        info = _info(fs, path)
        if info is None or info.get("type") != "directory":
            return _not_a_directory(fs, path, url, info)
        entries = _entries(fs, path)
        if entries.get(LOG_DIR, {}).get("type") == "directory":
            if _retired_base(fs, f"{path.rstrip('/')}/{LOG_DIR}"):
                return _error(url, "removed-base",
                              "it was removed (by retention or by hand); files of it stay only because delta "
                              "checkpoints reference them: load one of those, or a checkpoint beside it")
            return _uncommitted(url)
        search = _walk(fs, path, url, False, DEFAULT_DEPTH, 1_000)
        if search.checkpoints:
            n = len(search.checkpoints)
            return _error(url, "checkpoints-below",
                          f"it is a directory of checkpoints ({n} committed below it, newest first: "
                          f"{_few(search.checkpoints[::-1])}); "
                          f"pass one of them (`raydcp ls {url}` lists them)",
                          below=tuple(c.relpath for c in search.checkpoints))
        if search.uncommitted:
            return _error(url, "uncommitted-below",
                          f"the save(s) below it have not committed ({_few(search.uncommitted)}): still running, "
                          "or failed or stopped before their commit")
        if entries.get("data", {}).get("type") == "directory":
            return _uncommitted(url)
        what = "an empty directory" if not entries else "a directory without raydcp files"
        return _error(url, "empty", f"{what} (no {METADATA_NAME} in it or below it); check the path")
    except Exception:  # a storage that cannot be listed: the plain message
        return _error(url, None, f"missing {METADATA_NAME}: the save has not committed, failed before "
                                 "committing, or the path is wrong")


def _uncommitted(url: str) -> CheckpointNotFoundError:
    return _error(url, "uncommitted", f"a save there has not committed (missing {METADATA_NAME}): it is still "
                                      "running, or it failed or was stopped before its commit")
