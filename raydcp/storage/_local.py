"""Local files: durable writes, an atomic rename-based publish, and positional reads.

Local paths skip fsspec's file objects: data must be fsynced before the metadata commits (as
torch DCP does), and reads of thousands of ranges must not reopen the file for each range
(fsspec's cat_ranges does), so these helpers use the OS calls directly.
"""
from __future__ import annotations

import contextlib
import os
import secrets
from typing import Iterable

_HAS_PREADV = hasattr(os, "preadv")


def write_durably(path: str, views: Iterable[memoryview]) -> int:
    """Write ``views`` one after another to ``path`` (creating its directory), then fsync.

    ``views`` is consumed lazily, one buffer at a time. Returns the bytes written.
    """
    os.makedirs(os.path.dirname(path), exist_ok=True)
    written = 0
    with open(path, "wb") as f:
        for view in views:
            f.write(view)
            written += view.nbytes
        f.flush()
        os.fsync(f.fileno())
    return written


def publish_atomically(path: str, data: memoryview) -> None:
    """Replace ``path`` with ``data`` so that readers see the old content or the new, never a mix.

    1. write ``<path>.tmp-<random>`` and fsync it; 2. rename it over ``path``; 3. fsync the
    directory so the rename survives a power loss. A failure before step 2 removes the temporary
    file and leaves ``path`` untouched.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = f"{path}.tmp-{secrets.token_hex(8)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(directory)


def create_exclusive(path: str, data: bytes) -> None:
    """Create ``path`` with ``data``, durably, failing with FileExistsError if it exists.

    ``O_CREAT | O_EXCL`` makes the creation atomic: of several processes creating the same
    name, exactly one succeeds. A failed write removes the file it created.
    """
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.remove(path)
        raise
    os.close(fd)
    fsync_dir(directory)


def fsync_dir(directory: str) -> None:
    """Make a rename in ``directory`` durable, where the platform can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def open_for_read(path: str) -> int | None:
    """A read-only descriptor of ``path``, or None if there is no such file."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        return None


def pread_into(fd: int, view: memoryview, offset: int) -> int:
    """Fill ``view`` from ``fd`` at ``offset``, looping on short reads; returns bytes read.

    Fewer than ``len(view)`` bytes come back only at end of file.
    """
    done, total = 0, len(view)
    while done < total:
        if _HAS_PREADV:
            n = os.preadv(fd, [view[done:]], offset + done)
        else:  # no preadv: pread copies once, still only the bytes asked for
            chunk = os.pread(fd, total - done, offset + done)
            n = len(chunk)
            view[done : done + n] = chunk
        if n == 0:
            break
        done += n
    return done


def file_size(path: str) -> int | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_size if os.path.isfile(path) else None


def prune_empty_dirs(directory: str, root: str) -> None:
    """Remove ``directory`` and its parents up to (not including) ``root`` while they are empty."""
    root = os.path.normpath(root)
    directory = os.path.normpath(directory)
    while directory != root and directory.startswith(root + os.sep):
        try:
            os.rmdir(directory)
        except OSError:  # not empty, or already gone
            return
        directory = os.path.dirname(directory)
