"""One checkpoint directory on any fsspec filesystem: the primitives the engine builds on."""
from __future__ import annotations

import contextlib
import os
import posixpath
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Iterator, Mapping, Sequence

from ..errors import CheckpointError, CheckpointNotFoundError, StorageError
from . import _local, references
from ._common import (
    METADATA_NAME,
    check_name,
    describe,
    forget,
    is_local,
    is_transient,
    missing_file_error,
    open_fs,
    to_url,
    translating,
    truncated_file_error,
)
from ._local import pread_into
from ._ranges import RangePlan, byte_view, plan_ranges

__all__ = ["CheckpointStorage"]

# Object stores (and the in-memory filesystem) have no directories to create: a put creates
# every "parent". Other remote filesystems (sftp, hdfs, ...) get makedirs before a write.
_FLAT_PROTOCOLS = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss", "memory"})

# Filesystems whose pipe_file(mode="create") is an exclusive creation: s3fs sends a conditional
# put (If-None-Match: *), fsspec's memory filesystem checks and creates in one call of one process,
# raydcp's memory and node-local tiers by a compare-and-set in each node's holder actor.
_EXCLUSIVE_CREATE = frozenset({"s3", "s3a", "memory", "raymem", "raynode"})


_END = object()


def _ahead(buffers: Iterable[Any]) -> Iterator[Any]:
    """``buffers``, each next one made in a helper thread while the caller uses the one before
    (:meth:`CheckpointStorage.write_file`'s ``read_ahead``). The first is made at once, in the
    caller's thread; the helper starts with the second (a file of one buffer starts none).
    An error of the producer comes out where its buffer would have."""
    it = iter(buffers)
    first = next(it, _END)
    if first is _END:
        return
    pool = ThreadPoolExecutor(1, thread_name_prefix="raydcp-write-ahead")
    try:
        pending = pool.submit(next, it, _END)
        item = first
        while True:
            yield item
            item = pending.result()
            if item is _END:
                return
            pending = pool.submit(next, it, _END)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # the producer is idle before the caller goes on


class CheckpointStorage:
    """One checkpoint directory on any fsspec filesystem (local path, file://, memory://, s3://, ...).

    Save protocol (who calls what):
      1. every writing rank calls :meth:`write_files` (or :meth:`write_file`) for its data files,
         named by the engine ``data/<save_id>/...`` so a new save never overwrites files that the
         committed metadata points at; local files are fsynced before the call returns;
      2. after every rank has written, the coordinator calls :meth:`commit` once with the
         encoded metadata: the checkpoint becomes visible to readers only then, atomically;
      3. the engine may then :meth:`remove_files` data of older saves into the same directory.

    Load protocol:
      1. the coordinator calls :meth:`read_metadata_bytes` (refuses an uncommitted directory);
      2. readers call :meth:`read_ranges` / :meth:`read_into` for exactly the bytes they need.

    Every failure is a :class:`CheckpointError` naming the file involved.
    """

    def __init__(self, checkpoint_id: str | os.PathLike, storage_options: dict | None = None):
        self.fs, self.path, self.url = open_fs(checkpoint_id, storage_options, "checkpoint_id")
        self.storage_options: dict = dict(storage_options or {})
        self._local = is_local(self.fs)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,)
        self._protocols = frozenset(protocols)
        self._needs_mkdir = not self._local and not _FLAT_PROTOCOLS.intersection(protocols)
        self._made_dirs: set[str] = set()
        self._fds: dict[str, tuple[int, int]] = {}  # local data files kept open by read_into
        self._fds_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CheckpointStorage({self.url!r})"

    @property
    def round_trip_reads(self) -> bool:
        """Whether each read request is a round trip to a server (object stores, remote
        filesystems), so that touching pieces are best read in one request each, not one per
        piece: not for local files, nor for a filesystem that fills buffers itself (the memory
        and node-local tiers, ``read_into_many``)."""
        return not self._local and getattr(self.fs, "read_into_many", None) is None

    @property
    def memory_reads(self) -> bool:
        """Whether :meth:`read_ranges` gives views of memory the filesystem already holds, with
        no I/O and no copy (a filesystem whose ``memory_views`` is True: the memory tier's
        object stores), so that a reader can verify a piece before copying it anywhere."""
        return getattr(self.fs, "memory_views", False) is True

    def __reduce__(self):
        return (type(self), (self.url, self.storage_options))

    # ----------------------------------------------------------------- names

    def _full(self, name: str) -> str:
        return f"{self.path}/{check_name(name, self.url)}"

    def _read_path(self, name: str) -> str:
        """The path of ``name`` to read: a file of this checkpoint, or one of another checkpoint
        that a delta checkpoint references (``../step-9/data/...``, :mod:`.references`)."""
        if references.is_reference(name):
            return references.resolve(self.path, references.check_reference(name, self.url))
        return self._full(name)

    def at(self, path: str) -> "CheckpointStorage":
        """The checkpoint directory at ``path`` on this one's filesystem (a path, no protocol)."""
        plain = self.url == os.path.normpath(self.path) and self._local
        return type(self)(to_url(self.fs, path, plain_local=plain), self.storage_options)

    def file_url(self, name: str) -> str:
        """The URL (or local path) of the file ``name`` of this checkpoint, as shown in messages."""
        if references.is_reference(name):
            return posixpath.normpath(f"{self.url}/{name}") if "://" not in self.url else \
                self.url.split("://", 1)[0] + "://" + posixpath.normpath(f"{self.url.split('://', 1)[1]}/{name}")
        return f"{self.url}/{name}"

    def _missing(self, name: str) -> CheckpointError:
        if references.is_reference(name):
            return references.missing_base_error(self.file_url(name), self.url, name)
        return missing_file_error(self.file_url(name), self.url)

    def _ensure_dir(self, directory: str) -> None:
        if self._needs_mkdir and directory not in self._made_dirs:
            self.fs.makedirs(directory, exist_ok=True)
            self._made_dirs.add(directory)

    # ----------------------------------------------------------------- writes

    def write_file(self, name: str, buffers: Iterable[Any], *, read_ahead: bool = False) -> int:
        """Write the concatenation of ``buffers`` to ``name``, durably; return the bytes written.

        Buffers are written one after another (never joined into one copy). ``buffers`` may be
        any iterable, a generator for instance: it is consumed in the writing thread, buffer by
        buffer, so a producer can pack or checksum each buffer just before it is written (and
        overlap that work with the writes of other files). Local files are flushed and fsynced,
        so the data is durable before the metadata commits.

        By default the next buffer is asked for only once the previous one is written (a
        producer may reuse it). With ``read_ahead`` the next buffer is made (in a second thread)
        while the previous one is written, so the producer's packing and checksumming overlap
        this file's own writes: the producer must then keep each buffer as it is until the one
        after the next is asked for (two buffers in turn, say).
        """
        path = self._full(name)
        with contextlib.suppress(TypeError):
            memoryview(buffers)  # a single buffer rather than a sequence of them
            buffers = [buffers]
        if read_ahead:
            buffers = _ahead(buffers)
        views = (byte_view(b) for b in buffers)
        with translating("write", self.file_url(name)):
            if self._local:
                return _local.write_durably(path, views)
            self._ensure_dir(path.rsplit("/", 1)[0])
            written = 0
            with self.fs.open(path, "wb") as f:
                for view in views:
                    f.write(view)
                    written += view.nbytes
            return written

    def write_files(self, files: Mapping[str, Iterable[Any]], max_workers: int = 8, *,
                    read_ahead: bool = False) -> dict[str, int]:
        """Write several files in parallel (threads: file and network I/O release the GIL).

        Each file's buffers are consumed in its writing thread, as in :meth:`write_file` (and
        ``read_ahead`` as there).

        Returns ``{name: bytes written}``. If any write fails, the others still finish and one
        CheckpointError lists every failed file.
        """
        if not isinstance(max_workers, int) or max_workers < 1:
            raise CheckpointError(f"write_files: max_workers must be an integer >= 1, got {max_workers!r}")
        items = list(files.items())
        for name, _ in items:
            check_name(name, self.url)
        if not items:
            return {}
        with ThreadPoolExecutor(min(max_workers, len(items)), thread_name_prefix="raydcp-write") as pool:
            futures = [(name, pool.submit(self.write_file, name, bufs, read_ahead=read_ahead)) for name, bufs in items]
        written: dict[str, int] = {}
        errors: list[CheckpointError] = []
        for name, future in futures:
            try:
                written[name] = future.result()
            except CheckpointError as exc:
                errors.append(exc)
        if len(errors) == 1:
            raise errors[0]
        if errors:
            lines = "\n  ".join(str(e) for e in errors)
            raise StorageError(f"{len(errors)} of {len(items)} files could not be written to {self.url}:\n  {lines}",
                               retriable=all(getattr(e, "retriable", False) for e in errors), path=self.url)
        return written

    def commit(self, metadata: bytes) -> None:
        """Publish ``metadata`` as METADATA_NAME atomically; call it last, after every data write.

        Local: write a temporary file, fsync it, rename it over METADATA_NAME, fsync the directory.
        Other filesystems: a single put (atomic on object stores). A failure or crash at any point
        leaves the previously committed metadata, if any, intact and readable.
        """
        data = byte_view(metadata)
        final = self._full(METADATA_NAME)
        with translating("commit the metadata of", f"{self.url} (the previous commit, if any, is unchanged)"):
            if self._local:
                _local.publish_atomically(final, data)
            else:
                self._ensure_dir(self.path)
                self.fs.pipe_file(final, bytes(data))
                forget(self.fs, final)

    def create_exclusive(self, name: str, data: bytes) -> bool:
        """Create ``name`` holding ``data`` only if no file of that name exists (FileExistsError if
        one does). Returns True where the filesystem makes the creation itself exclusive: local
        files (``O_CREAT | O_EXCL``, fsynced), and filesystems whose ``pipe_file`` takes
        ``mode="create"`` (fsspec's memory filesystem; s3fs, as a conditional put with
        ``If-None-Match: *``). Elsewhere it checks that the file is absent, then writes it, and
        returns False: two callers may both succeed, so the caller must read the file back.
        """
        path = self._full(name)
        data = bytes(byte_view(data))
        exists = False
        with translating("create", self.file_url(name)):
            try:
                return self._create_exclusive(path, data)
            except FileExistsError:
                exists = True
        assert exists
        raise FileExistsError(self.file_url(name))

    def _create_exclusive(self, path: str, data: bytes) -> bool:
        if self._local:
            _local.create_exclusive(path, data)
            return True
        self._ensure_dir(path.rsplit("/", 1)[0])
        forget(self.fs, path)
        try:
            # fsspec's default pipe_file(mode="create") checks, then writes: not exclusive
            self.fs.pipe_file(path, data, mode="create")
        finally:
            forget(self.fs, path)
        return bool(_EXCLUSIVE_CREATE.intersection(self._protocols))

    # ----------------------------------------------------------------- reads

    def read_ranges(self, name: str, ranges: Sequence[tuple[int, int]]) -> list[memoryview]:
        """Read byte ranges ``(start, end)`` (end exclusive) of ``name``; one view per range, in order.

        Ranges that touch or overlap are read once together and sliced without copying; no byte
        outside the requested ranges is read.
        """
        path = self._read_path(name)
        plan = plan_ranges(ranges, self.file_url(name))
        if not plan.spans:
            return plan.slices([])
        if self._local:
            buffers = self._read_spans_local(name, path, plan)
        else:
            buffers = self._read_spans_remote(name, path, plan)
        return plan.slices(buffers)

    def _read_spans_local(self, name: str, path: str, plan: RangePlan) -> list[bytearray]:
        # One open file and positional reads: fsspec's cat_ranges reopens the file per range.
        with translating("read", self.file_url(name)):
            fd = self._open_local(name, path)
            try:
                size = os.fstat(fd).st_size
                if plan.end > size:
                    raise truncated_file_error(self.file_url(name), size, plan.end, self.url)
                buffers = []
                for start, end in plan.spans:
                    buf = bytearray(end - start)
                    if pread_into(fd, memoryview(buf), start) < len(buf):
                        raise truncated_file_error(self.file_url(name), os.fstat(fd).st_size, end, self.url)
                    buffers.append(buf)
                return buffers
            finally:
                os.close(fd)

    def _read_spans_remote(self, name: str, path: str, plan: RangePlan) -> list[bytes]:
        starts = [s for s, _ in plan.spans]
        ends = [e for _, e in plan.spans]
        try:
            buffers = self.fs.cat_ranges([path] * len(starts), starts, ends, on_error="raise")
        except Exception as exc:
            raise self._read_failure(name, path, plan.end, exc) from exc
        for (start, end), buf in zip(plan.spans, buffers):
            if isinstance(buf, BaseException) or len(buf) != end - start:
                cause = buf if isinstance(buf, BaseException) else None
                raise self._read_failure(name, path, plan.end, cause) from cause
        return buffers

    def read_into(self, name: str, start: int, out: Any) -> None:
        """Fill the writable buffer ``out`` (n bytes) with bytes ``[start, start + n)`` of ``name``.

        Local files are read straight into ``out`` (no intermediate copy), e.g. a tensor's memory.
        Safe to call from several threads at once.
        """
        self.read_into_many(name, ((start, out),))

    def read_into_many(self, name: str, requests: Iterable[tuple[int, Any]]) -> int:
        """For each ``(start, out)`` of ``requests``, fill the writable buffer ``out`` with the
        bytes of ``name`` from ``start`` on; return the bytes read.

        The batched form of :meth:`read_into` for many small pieces of one file: a local file is
        opened once (and kept open, as by :meth:`read_into`) and each request is one positional
        read, straight into ``out``; other filesystems fetch every range in one ``cat_ranges``.
        Safe to call from several threads at once.
        """
        path = self._read_path(name)
        todo: list[tuple[int, memoryview]] = []
        end = 0
        for start, out in requests:
            if type(out) is memoryview and out.format == "B" and out.ndim == 1 and out.c_contiguous \
                    and not out.readonly:
                view = out  # already what byte_view would make of it
            else:
                view = byte_view(out, writable=True)
            if not isinstance(start, int) or start < 0:
                raise CheckpointError(
                    f"read_into {self.file_url(name)}: start must be an integer >= 0, got {start!r}")
            if len(view):
                todo.append((start, view))
                end = max(end, start + len(view))
        if not todo:
            return 0
        if self._local:
            with translating("read", self.file_url(name)):
                fd, size = self._reader_fd(name, path)
                if size < end:
                    raise truncated_file_error(self.file_url(name), os.fstat(fd).st_size, end, self.url)
                nread = 0
                for start, view in todo:
                    n = pread_into(fd, view, start)
                    if n < len(view):
                        raise truncated_file_error(self.file_url(name), os.fstat(fd).st_size, start + len(view),
                                                   self.url)
                    nread += n
                return nread
        fill = getattr(self.fs, "read_into_many", None)  # a filesystem that fills buffers itself (raymem://)
        if fill is not None:
            try:
                return fill(path, todo)
            except Exception as exc:
                raise self._read_failure(name, path, end, exc) from exc
        starts = [s for s, _ in todo]
        ends = [s + len(v) for s, v in todo]
        try:
            datas = self.fs.cat_ranges([path] * len(todo), starts, ends, on_error="return")
        except Exception as exc:
            raise self._read_failure(name, path, end, exc) from exc
        for (start, view), data in zip(todo, datas):
            if isinstance(data, BaseException) or len(data) != len(view):
                cause = data if isinstance(data, BaseException) else None
                raise self._read_failure(name, path, start + len(view), cause) from cause
            view[:] = data
        return sum(len(v) for _, v in todo)

    def _reader_fd(self, name: str, path: str) -> tuple[int, int]:
        """An open descriptor (and the size) of a local data file, kept for the next read."""
        fds = self._fds
        got = fds.get(name)
        if got is None:
            with self._fds_lock:
                got = fds.get(name)
                if got is None:
                    fd = self._open_local(name, path)
                    got = fds[name] = (fd, os.fstat(fd).st_size)
        return got

    def close(self) -> None:
        """Close the descriptors :meth:`read_into` kept open (the object stays usable)."""
        with self._fds_lock:
            fds, self._fds = self._fds, {}
        for fd, _ in fds.values():
            os.close(fd)
        close_reads = getattr(self.fs, "close_reads", None)  # a filesystem that keeps views for reads
        if close_reads is not None:
            close_reads()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown, or a half-built object
            pass

    def read_file(self, name: str) -> bytes:
        """The whole content of ``name``."""
        path = self._read_path(name)
        with translating("read", self.file_url(name)):
            if self._local:
                fd = self._open_local(name, path)
                with open(fd, "rb", closefd=True) as f:
                    return f.read()
            try:
                return self.fs.cat_file(path)
            except FileNotFoundError:
                raise self._missing(name) from None

    def _open_local(self, name: str, path: str) -> int:
        fd = _local.open_for_read(path)
        if fd is None:
            raise self._missing(name)
        return fd

    def _read_failure(self, name: str, path: str, needed_end: int, cause: BaseException | None) -> CheckpointError:
        """Explain a failed remote read: missing file, truncated file, or an access problem."""
        if isinstance(cause, CheckpointError):
            return cause  # the filesystem's own explanation (raymem://: a file released or lost with its holder)
        file_url = self.file_url(name)
        try:
            size = self._size(path)
        except Exception:
            size = -1  # unknown: report the original failure
        if size is None:
            return self._missing(name)
        if 0 <= size < needed_end:
            return truncated_file_error(file_url, size, needed_end, self.url)
        reason = describe(cause) if cause is not None else "short read"
        return StorageError(
            f"could not read {file_url}: {reason}; check that the storage is reachable and that "
            "storage_options carry valid credentials", retriable=cause is None or is_transient(cause), path=file_url
        )

    # ----------------------------------------------------------------- listing

    def _size(self, path: str) -> int | None:
        if self._local:
            return _local.file_size(path)
        forget(self.fs, path)
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        return int(info["size"]) if info.get("type") == "file" else None

    def file_size(self, name: str) -> int | None:
        """Size of ``name`` in bytes, or None if there is no such file."""
        path = self._read_path(name)
        with translating("look up", self.file_url(name)):
            return self._size(path)

    def exists(self, name: str) -> bool:
        return self.file_size(name) is not None

    def list_files(self, prefix: str = "") -> list[str]:
        """Sorted relative names of every file under the directory whose name starts with ``prefix``."""
        if prefix:
            check_name(prefix.rstrip("/"), self.url)
        sub = prefix.rsplit("/", 1)[0] if "/" in prefix else ""
        base = f"{self.path}/{sub}" if sub else self.path
        root = self.path.rstrip("/") + "/"
        with translating("list", self.url):
            if self._local:
                found = [
                    f"{d}/{f}".replace(os.sep, "/") for d, _, files in os.walk(base) for f in files
                ]
            else:
                forget(self.fs, self.path)
                try:
                    found = self.fs.find(base)
                except FileNotFoundError:
                    found = []
        names = (p[len(root):] for p in found if p.startswith(root))
        return sorted(n for n in names if n.startswith(prefix))

    # ----------------------------------------------------------------- removal

    def remove_files(self, names: Iterable[str]) -> None:
        """Remove files of this checkpoint; names that do not exist are ignored."""
        names = list(names)
        paths = [self._full(n) for n in names]
        if not paths:
            return
        with translating("remove files from", self.url):
            if self._local:
                parents = set()
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(path)
                    parents.add(os.path.dirname(path))
                for parent in sorted(parents, key=len, reverse=True):
                    _local.prune_empty_dirs(parent, self.path)
                return
            try:
                self.fs.rm(paths)
            except FileNotFoundError:
                for path in paths:
                    with contextlib.suppress(FileNotFoundError):
                        self.fs.rm_file(path)
            finally:
                forget(self.fs, self.path)

    def delete(self) -> None:
        """Remove the whole checkpoint directory; the metadata goes first, so a deletion that is
        interrupted leaves an uncommitted directory rather than a committed, damaged checkpoint."""
        meta = self._full(METADATA_NAME)
        with translating("delete", self.url):
            if self._local:
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    os.remove(meta)
                with contextlib.suppress(FileNotFoundError):
                    shutil.rmtree(self.path)
                return
            forget(self.fs, self.path)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm_file(meta)
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path, recursive=True)
            forget(self.fs, self.path)

    # ----------------------------------------------------------------- metadata

    def is_committed(self) -> bool:
        """True once :meth:`commit` has published the metadata."""
        return self.file_size(METADATA_NAME) is not None

    def read_metadata_bytes(self) -> bytes:
        """The committed metadata; CheckpointError if the directory holds no committed checkpoint."""
        try:
            return self.read_file(METADATA_NAME)
        except CheckpointNotFoundError:
            raise  # the filesystem's own reason (raymem://: released by retention, lost with its holder)
        except CheckpointError:
            if self.is_committed():
                raise
        from .discovery import not_found_error  # no such path, a file, checkpoints below, a save not committed

        raise not_found_error(self.fs, self.path, self.url)

