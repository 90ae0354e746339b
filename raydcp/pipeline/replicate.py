"""Replication of a committed copy to another tier: raw byte ranges, checked, metadata last.

The unit of work is a *segment*: a byte range of one data file that starts at a piece boundary,
so the CRC32C of every piece it holds can be checked on arrival (before it is written). Segments
of one file are copied in parallel, by whatever runs :func:`copy_segment` (threads here, Ray
tasks beside the source in :mod:`raydcp.runtime.pipeline_actor`), and written as follows:

- local directory: each segment is ``pwrite``-n at its offset into ``<file>.partial``, fsynced;
  once every segment is in, the file is truncated to size and renamed over ``<file>``;
- S3 (s3fs): a file of one segment is one PUT; a larger one is a multipart upload, one part per
  segment (parts are at least 5 MiB, as S3 requires), completed once every part is in;
- any other fsspec filesystem: one segment per file, one write.

In every case a data file appears under its final name only complete, the target's metadata is
committed after every file is in place (so the copy is invisible until then), and the metadata
bytes are the source's, byte for byte. Replicating again is idempotent: files already present
with the right size are checked (every piece's CRC32C, read from the target) and kept.

Protocol (called by the pipeline driver for stage ``replicated@k``, then ``committed@k``):
  1. :func:`replicate_files` -- plan, check what the target already holds, copy the rest;
  2. :func:`commit_copy` -- publish the metadata on the target, then drop files it does not name.
"""
from __future__ import annotations

import contextlib
import os
import posixpath
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..codec import checksum
from ..errors import CheckpointDamagedError, CheckpointError, StorageError
from ..metadata import Metadata
from ..metadata_format import decode_metadata
from ..storage import METADATA_NAME, CheckpointStorage, fsync_dir, is_local, is_transient
from ..storage import references
from ..storage.commits import raydcp_data_file

__all__ = ["Piece", "Segment", "CopyTask", "plan_segments", "file_pieces", "writer_kind",
           "copy_segment", "replicate_files", "commit_copy", "S3_MIN_PART"]

S3_MIN_PART = 5 << 20
_PARTIAL = ".partial"


@dataclass(frozen=True)
class Piece:
    offset: int
    nbytes: int
    crc: int


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of ``file``: part ``part`` (1-based) of ``parts``."""

    file: str
    start: int
    end: int
    pieces: tuple[Piece, ...]
    part: int = 1
    parts: int = 1

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class CopyTask:
    """One segment to copy (or, with ``check_only``, to check on the target). Plain and picklable."""

    src_url: str
    src_options: dict | None
    dst_url: str
    dst_options: dict | None
    segment: Segment
    kind: str                       # "local", "s3" or "whole": how the target is written
    upload_id: str | None = None    # S3 multipart upload of this file
    check_only: bool = False


def file_pieces(md: Metadata) -> dict[str, list[Piece]]:
    """Every data file the metadata names, with its pieces sorted by offset."""
    out: dict[str, list[Piece]] = {}
    for tm in md.tensors.values():
        for c in tm.chunks:
            out.setdefault(c.file, []).append(Piece(c.byte_offset, c.stored_length, c.checksum))  # stored bytes
    for pieces in out.values():
        pieces.sort(key=lambda p: p.offset)
    return out


def plan_segments(file: str, size: int, pieces: Sequence[Piece], part_bytes: int) -> list[Segment]:
    """Cut a file into segments of at least ``part_bytes`` (the last may be smaller), each starting
    at a piece boundary, covering ``[0, size)``."""
    if part_bytes < 1:
        raise CheckpointError(f"part_bytes must be >= 1, got {part_bytes}")
    need = max((p.offset + p.nbytes for p in pieces), default=0)
    if size < need:
        raise CheckpointDamagedError(f"data file {file} is truncated: it holds {size} bytes, its pieces need {need}",
                                     file=file, byte_range=(size, need))
    cuts = [0]
    for p in pieces:
        if p.offset - cuts[-1] >= part_bytes:
            cuts.append(p.offset)
    if size - cuts[-1] == 0 and len(cuts) > 1:
        cuts.pop()
    bounds = list(zip(cuts, cuts[1:] + [size]))
    segs = []
    for i, (start, end) in enumerate(bounds, start=1):
        inside = tuple(p for p in pieces if start <= p.offset < end and p.nbytes)
        segs.append(Segment(file, start, end, inside, i, len(bounds)))
    return segs


def writer_kind(storage: CheckpointStorage) -> str:
    if is_local(storage.fs):
        return "local"
    protocols = storage.fs.protocol if isinstance(storage.fs.protocol, tuple) else (storage.fs.protocol,)
    if {"s3", "s3a"} & set(protocols) and hasattr(storage.fs, "call_s3"):
        return "s3"
    return "whole"


def _check(view: memoryview, seg: Segment, where: str) -> None:
    """CheckpointDamagedError where a piece of the segment does not match its stored checksum (copying
    a damaged source again would not help)."""
    for p in seg.pieces:
        lo = p.offset - seg.start
        crc = checksum(view[lo:lo + p.nbytes])
        if crc != p.crc:
            raise CheckpointDamagedError(
                f"checksum mismatch in {where} at bytes {p.offset}..{p.offset + p.nbytes} (stored "
                f"{p.crc:#010x}, read {crc:#010x}): the copy is damaged", file=where,
                byte_range=(p.offset, p.offset + p.nbytes))


def copy_segment(task: CopyTask) -> dict[str, Any]:
    """Read a segment from the source, check every piece's CRC32C, write it to the target.

    Runs wherever the runner puts it (a thread, a Ray task beside the source). With
    ``check_only`` it reads the segment from the *target* instead and reports ``ok``.
    """
    seg = task.segment
    if task.check_only:
        dst = CheckpointStorage(task.dst_url, task.dst_options)
        try:
            (view,) = dst.read_ranges(seg.file, [(seg.start, seg.end)])
            _check(view, seg, dst.file_url(seg.file))
        except CheckpointDamagedError:
            return {"file": seg.file, "part": seg.part, "bytes": seg.nbytes, "ok": False}
        return {"file": seg.file, "part": seg.part, "bytes": seg.nbytes, "ok": True}
    src = CheckpointStorage(task.src_url, task.src_options)
    (view,) = src.read_ranges(seg.file, [(seg.start, seg.end)]) if seg.nbytes else (memoryview(b""),)
    _check(view, seg, src.file_url(seg.file))
    dst = CheckpointStorage(task.dst_url, task.dst_options)
    etag = None
    if task.kind == "local":
        _pwrite_durably(f"{dst.path}/{seg.file}{_PARTIAL}", view, seg.start)
    elif task.kind == "s3" and seg.parts > 1:
        bucket, key = _bucket_key(dst, seg.file)
        etag = _s3(dst, "upload part", "upload_part", Bucket=bucket, Key=key, UploadId=task.upload_id,
                   PartNumber=seg.part, Body=bytes(view))["ETag"]
    else:
        dst.write_file(seg.file, [view])
    return {"file": seg.file, "part": seg.part, "bytes": seg.nbytes, "etag": etag}


def _pwrite_durably(path: str, view: memoryview, offset: int) -> None:
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], offset + done)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        raise StorageError(f"could not write {path}: {exc}; check the path, permissions and free space",
                           retriable=is_transient(exc), path=path) from exc


def _bucket_key(storage: CheckpointStorage, name: str) -> tuple[str, str]:
    bucket, key, _ = storage.fs.split_path(f"{storage.path}/{name}")
    return bucket, key


def _s3(storage: CheckpointStorage, what: str, method: str, **kwargs) -> dict:
    try:
        return storage.fs.call_s3(method, **kwargs)
    except Exception as exc:
        raise StorageError(f"could not {what} under {storage.url}: {type(exc).__name__}: {exc}; check that "
                           "the bucket exists and is reachable and that storage_options carry valid credentials",
                           retriable=is_transient(exc), path=storage.url) from exc


def _abort_stale_uploads(dst: CheckpointStorage) -> None:
    """Abort multipart uploads a previous (interrupted) replication left under the target."""
    bucket, prefix = _bucket_key(dst, "data/")
    listing = _s3(dst, "list the multipart uploads", "list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    for up in listing.get("Uploads", []) or []:
        with contextlib.suppress(CheckpointError):
            _s3(dst, "abort an upload", "abort_multipart_upload", Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])


@dataclass
class ReplicateResult:
    bytes_copied: int = 0
    bytes_kept: int = 0
    files_copied: int = 0
    files_kept: int = 0


def replicate_files(src: CheckpointStorage, dst: CheckpointStorage, meta_bytes: bytes,
                    run: Callable[[list[CopyTask], Callable[[dict], None] | None], list[dict]], *,
                    part_bytes: int, on_bytes: Callable[[int, int], None] | None = None) -> ReplicateResult:
    """Copy every data file ``meta_bytes`` names from ``src`` to ``dst`` (stage ``replicated``).

    ``run(tasks, on_result)`` executes :func:`copy_segment` on each task in parallel and returns
    the results in order, calling ``on_result`` as each finishes; ``on_bytes(done, total)``
    reports progress. Files already complete on the target are kept.

    A delta checkpoint's references (``../step-1/data/...``) go to the same place beside the
    target: a base replicated before is where they point, and its files already there are kept
    (each referenced file is copied once). The target's bases are pinned for the copy first
    (:mod:`raydcp.storage.references`), so a removal on the target keeps what it references.
    """
    md = decode_metadata(meta_bytes, src.file_url(METADATA_NAME))
    pieces = file_pieces(md)
    where = _placements(src, dst, list(pieces), md.save_id)
    sizes = {}
    for name in pieces:
        size = src.file_size(name)
        if size is None:
            raise CheckpointError(f"data file {src.file_url(name)} is missing: the source copy is damaged")
        sizes[name] = size
    total = sum(sizes.values())
    kind = writer_kind(dst)
    if kind == "s3":
        part_bytes = max(part_bytes, S3_MIN_PART)
        _abort_stale_uploads(dst)
    elif kind == "whole":
        part_bytes = max(total, 1)
    result = ReplicateResult()
    done = 0

    def progress(r: dict) -> None:
        nonlocal done
        done += r["bytes"]
        if on_bytes is not None:
            on_bytes(done, total)

    def task(n: str, seg: Segment, **kw) -> CopyTask:
        s_st, d_st, local = where[n]
        return CopyTask(s_st.url, s_st.storage_options, d_st.url, d_st.storage_options,
                        Segment(local, seg.start, seg.end, seg.pieces, seg.part, seg.parts), kind, **kw)

    # 1. files a previous attempt (or the replication of a base) already put in place: check them there
    present = {n for n in sizes if where[n][1].file_size(where[n][2]) == sizes[n]}
    checks = [task(n, seg, check_only=True)
              for n in sorted(present) for seg in plan_segments(n, sizes[n], pieces[n], max(sizes[n], 1))]
    local_to_name = {where[n][2]: n for n in sizes}
    bad = {local_to_name[r["file"]] for r in run(checks, progress) if not r["ok"]} if checks else set()
    kept = present - bad
    result.files_kept, result.bytes_kept = len(kept), sum(sizes[n] for n in kept)

    # 2. the rest: segments in parallel, each file finished once all its segments are in
    todo = [n for n in sorted(sizes) if n not in kept]
    plans = {n: plan_segments(n, sizes[n], pieces[n], part_bytes) for n in todo}
    uploads: dict[str, str] = {}
    try:
        if kind == "s3":
            for n, segs in plans.items():
                if len(segs) > 1:
                    bucket, key = _bucket_key(where[n][1], where[n][2])
                    uploads[n] = _s3(dst, "start an upload", "create_multipart_upload", Bucket=bucket, Key=key)["UploadId"]
        tasks = [task(n, seg, upload_id=uploads.get(n)) for n in todo for seg in plans[n]]
        results = run(tasks, progress) if tasks else []
        etags: dict[str, dict[int, str]] = {}
        for r in results:
            etags.setdefault(local_to_name[r["file"]], {})[r["part"]] = r.get("etag")
        for n in todo:
            _finish_file(where[n][1], kind, where[n][2], sizes[n], uploads.pop(n, None), etags.get(n, {}))
    except BaseException:
        for n, upload_id in uploads.items():
            bucket, key = _bucket_key(where[n][1], where[n][2])
            with contextlib.suppress(Exception):
                _s3(dst, "abort an upload", "abort_multipart_upload", Bucket=bucket, Key=key, UploadId=upload_id)
        raise
    for n in todo:
        got = where[n][1].file_size(where[n][2])
        if got != sizes[n]:
            raise CheckpointError(f"after copying, {dst.file_url(n)} holds {got} bytes instead of {sizes[n]}")
    result.files_copied, result.bytes_copied = len(todo), sum(sizes[n] for n in todo)
    return result


def _placements(src: CheckpointStorage, dst: CheckpointStorage, names: list[str],
                save_id: str) -> dict[str, tuple[CheckpointStorage, CheckpointStorage, str]]:
    """Per data file: the checkpoint it is read from, the one it is written to, its name there.
    A reference's owner beside the target is pinned for ``save_id`` (and must not be being removed)."""
    out: dict[str, tuple[CheckpointStorage, CheckpointStorage, str]] = {}
    owners: dict[str, tuple[CheckpointStorage, CheckpointStorage, list[str]]] = {}
    for n in names:
        if not references.is_reference(n):
            out[n] = (src, dst, n)
            continue
        references.check_reference(n, src.url)
        owner = references.owner_of(n)
        if owner not in owners:
            owners[owner] = (src.at(posixpath.normpath(f"{src.path}/{owner}")),
                             dst.at(posixpath.normpath(f"{dst.path}/{owner}")), [])
        s_st, d_st, files = owners[owner]
        files.append(n[len(owner) + 1:])
        out[n] = (s_st, d_st, n[len(owner) + 1:])
    for owner, (_, d_st, files) in owners.items():
        references.write_pin(d_st, posixpath.relpath(dst.path, d_st.path), save_id, 0, files)
        if references.tombstoned(d_st):
            raise StorageError(f"the base {d_st.url} of this delta checkpoint's copy is being removed on the "
                               "target; the replication is retried", retriable=True, path=d_st.url)
    return out


def _finish_file(dst: CheckpointStorage, kind: str, name: str, size: int, upload_id: str | None,
                 etags: dict[int, str]) -> None:
    if kind == "local":
        final = f"{dst.path}/{name}"
        tmp = final + _PARTIAL
        try:
            if not os.path.exists(tmp):  # an empty file has no segment bytes written
                _pwrite_durably(tmp, memoryview(b""), 0)
            os.truncate(tmp, size)
            os.replace(tmp, final)
            fsync_dir(os.path.dirname(final))
        except OSError as exc:
            raise StorageError(f"could not finish {final}: {exc}", retriable=is_transient(exc), path=final) from exc
    elif upload_id is not None:
        bucket, key = _bucket_key(dst, name)
        parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
        _s3(dst, "complete an upload", "complete_multipart_upload", Bucket=bucket, Key=key,
            UploadId=upload_id, MultipartUpload={"Parts": parts})


def commit_copy(src_meta: bytes, dst: CheckpointStorage) -> bool:
    """Publish ``src_meta`` on the target (stage ``committed@k``), then remove raydcp's data files it
    does not name (an older save's, or leftovers); files raydcp did not write are never touched.
    Returns False if it was already committed."""
    md = decode_metadata(src_meta, dst.file_url(METADATA_NAME))
    already = dst.is_committed() and dst.read_metadata_bytes() == src_meta
    if not already:
        dst.commit(src_meta)
    keep = set(md.files)
    stale = [f for f in dst.list_files("data/") if f not in keep and raydcp_data_file(f)]
    if stale:
        dst.remove_files(stale)
    return not already
