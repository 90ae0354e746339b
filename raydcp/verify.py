"""Verify a committed checkpoint end to end: metadata, tiling, data files and every checksum.

:func:`verify_checkpoint` reads every stored piece once, streaming file by file in blocks of at
most ``block_bytes`` (pieces larger than that are read in parts with a running CRC32C), so the
memory it needs is bounded whatever the checkpoint's size. A compressed piece is read whole,
its stored bytes checked, then decompressed to check that it holds its recorded length (the
memory is then bounded by the largest piece). It never stops at the first problem: the
:class:`VerifyReport` lists every one, each naming the key, file and byte range involved.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import crc32c as _crc32c

from .codec import checksum, decompress
from .errors import CheckpointError
from .metadata import ChunkMeta, Metadata
from .metadata_format import decode_metadata
from .planner.tiling import tiling_problems
from .storage import METADATA_NAME, CheckpointStorage

__all__ = ["Problem", "VerifyReport", "verify_checkpoint"]

_BLOCK = 64 << 20  # bytes read per storage call


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a checkpoint.

    ``kind`` is one of ``metadata``, ``tiling``, ``missing-file``, ``truncated``, ``checksum``,
    ``decompress`` (a compressed piece whose stored bytes are intact but do not decompress to its
    length) and ``read-error``; ``byte_range`` is ``(start, end)`` in ``file`` (end exclusive).
    """

    kind: str
    message: str
    key: str | None = None
    file: str | None = None
    byte_range: tuple[int, int] | None = None

    def __str__(self) -> str:
        if self.kind == "metadata":  # the message names the metadata file already
            return self.message
        where = []
        if self.key is not None:
            where.append(self.key)
        if self.file is not None:
            rng = f" bytes {self.byte_range[0]}..{self.byte_range[1]}" if self.byte_range else ""
            where.append(f"{self.file}{rng}")
        return f"{': '.join(where)}: {self.message}" if where else self.message


@dataclass
class VerifyReport:
    """What :func:`verify_checkpoint` found. ``ok`` is True when no problem was found."""

    checkpoint: str
    metadata: Metadata | None = None
    problems: list[Problem] = field(default_factory=list)
    pieces_checked: int = 0
    bytes_checked: int = 0
    files_checked: int = 0
    seconds: float = 0.0
    tensors: int = 0          # in the metadata (as `raydcp inspect` counts them)
    pieces: int = 0           # stored pieces in the metadata, empty ones included
    total_bytes: int = 0      # stored bytes of the pieces to check
    progress: Callable[[int, int], None] | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def damaged_files(self) -> list[str]:
        return sorted({p.file for p in self.problems if p.file is not None})

    @property
    def damaged_keys(self) -> list[str]:
        return sorted({p.key for p in self.problems if p.key is not None})

    def summary(self) -> str:
        """One line: intact, or what is damaged."""
        if self.ok:
            return (f"{self.checkpoint} is intact: {self.tensors} tensors in {self.pieces} pieces, "
                    f"{_mib(self.bytes_checked)} ({self.bytes_checked} bytes) in {self.files_checked} data files; "
                    "every checksum matches")
        files, keys = self.damaged_files, self.damaged_keys
        parts = [f"{self.checkpoint} is damaged: {len(self.problems)} problem(s)"]
        if files:
            parts.append(f"in {_few(files)}")
        if keys:
            parts.append(f"affecting {_few(keys)}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "ok": self.ok,
            "save_id": self.metadata.save_id if self.metadata else None,
            "tensors": self.tensors,
            "pieces": self.pieces,
            "pieces_checked": self.pieces_checked,
            "bytes_checked": self.bytes_checked,
            "files_checked": self.files_checked,
            "seconds": round(self.seconds, 6),
            "problems": [{**asdict(p), "byte_range": list(p.byte_range) if p.byte_range else None}
                         for p in self.problems],
        }


def _mib(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _few(names: list[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def verify_checkpoint(checkpoint_id, storage_options: dict | None = None, *,
                      block_bytes: int = _BLOCK, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Check a committed checkpoint completely and return a :class:`VerifyReport`.

    1. read and decode the metadata (a damaged, missing or unknown-version metadata file is
       reported as a ``metadata`` problem, and nothing else can be checked);
    2. check that each tensor's pieces tile it exactly (no gap, no overlap);
    3. look up every data file once: missing, or shorter than its pieces need;
    4. read every piece present, in file order, and compare the CRC32C of its stored bytes with
       the metadata; decompress each compressed piece and check it holds its recorded length.

    Raises CheckpointError only when the location itself cannot be opened (bad URL or options).
    ``progress(bytes checked, bytes to check)`` is called as pieces are read.
    """
    if not isinstance(block_bytes, int) or block_bytes < 1:
        raise CheckpointError(f"block_bytes must be a positive integer, got {block_bytes!r}")
    t0 = time.perf_counter()
    storage = CheckpointStorage(checkpoint_id, storage_options)
    report = VerifyReport(storage.url)
    try:
        md = decode_metadata(storage.read_metadata_bytes(), storage.file_url(METADATA_NAME))
    except CheckpointError as exc:
        report.problems.append(Problem("metadata", str(exc), file=METADATA_NAME))
        report.seconds = time.perf_counter() - t0
        return report
    report.metadata = md

    by_file: dict[str, list[tuple[str, ChunkMeta]]] = {}
    tiling = tiling_problems(md.tensors)
    for key, tm in md.tensors.items():
        for msg in tiling.get(key, ()):
            report.problems.append(Problem("tiling", msg.removeprefix(f"{key}: "), key=key))
        for c in tm.chunks:
            if c.nbytes:
                by_file.setdefault(c.file, []).append((key, c))
    report.tensors = len(md.tensors)
    report.pieces = sum(len(tm.chunks) for tm in md.tensors.values())
    report.total_bytes = sum(c.stored_length for pieces in by_file.values() for _, c in pieces)
    report.progress = progress
    if progress:
        progress(0, report.total_bytes)
    for name in sorted(by_file):
        _check_file(storage, name, by_file[name], report, block_bytes)
    report.progress = None
    report.problems.sort(key=lambda p: (p.kind != "tiling", p.file or "", p.byte_range or (0, 0), p.key or ""))
    report.seconds = time.perf_counter() - t0
    return report


def _check_file(storage: CheckpointStorage, name: str, pieces: list[tuple[str, ChunkMeta]],
                report: VerifyReport, block: int) -> None:
    pieces.sort(key=lambda p: (p[1].byte_offset, p[0]))
    try:
        size = storage.file_size(name)
    except CheckpointError as exc:
        for key, c in pieces:
            report.problems.append(Problem("read-error", str(exc), key, name, _range(c)))
        return
    if size is None:
        for key, c in pieces:
            report.problems.append(Problem("missing-file", "the data file is missing", key, name, _range(c)))
        return
    report.files_checked += 1
    present = []
    for key, c in pieces:
        if c.byte_offset + c.stored_length > size:
            report.problems.append(Problem(
                "truncated", f"the data file is truncated: it holds {size} bytes, this piece needs up to "
                f"{c.byte_offset + c.stored_length}", key, name, _range(c)))
        else:
            present.append((key, c))
    batch: list[tuple[str, ChunkMeta]] = []
    batch_bytes = 0
    for key, c in present:
        if c.stored_length > block and c.compression is None:
            _check_large_piece(storage, name, key, c, report, block)
            continue
        if batch and batch_bytes + c.stored_length > block:
            _check_batch(storage, name, batch, report)
            batch, batch_bytes = [], 0
        batch.append((key, c))
        batch_bytes += c.stored_length
    if batch:
        _check_batch(storage, name, batch, report)


def _check_batch(storage: CheckpointStorage, name: str, batch: list[tuple[str, ChunkMeta]],
                 report: VerifyReport) -> None:
    try:
        views = storage.read_ranges(name, [_range(c) for _, c in batch])
    except CheckpointError as exc:
        for key, c in batch:
            report.problems.append(Problem("read-error", str(exc), key, name, _range(c)))
        return
    for (key, c), view in zip(batch, views):
        if _compare(name, key, c, checksum(view), report) and c.compression is not None:
            try:
                decompress(c.compression, view, c.nbytes)
            except ValueError as exc:
                report.problems.append(Problem(
                    "decompress", f"the {c.compression}-compressed piece at {list(c.offsets)} does not decompress "
                    f"to its {c.nbytes} bytes ({exc}); the data is damaged", key, name, _range(c)))


def _check_large_piece(storage: CheckpointStorage, name: str, key: str, c: ChunkMeta,
                       report: VerifyReport, block: int) -> None:
    crc = 0
    for start in range(c.byte_offset, c.byte_offset + c.stored_length, block):
        end = min(start + block, c.byte_offset + c.stored_length)
        try:
            (view,) = storage.read_ranges(name, [(start, end)])
        except CheckpointError as exc:
            report.problems.append(Problem("read-error", str(exc), key, name, _range(c)))
            return
        crc = _crc32c.crc32c(view, crc)  # codec.checksum's CRC32C, continued across blocks
    _compare(name, key, c, crc, report)


def _compare(name: str, key: str, c: ChunkMeta, crc: int, report: VerifyReport) -> bool:
    """Count the piece checked; False (and a problem reported) where its checksum does not match."""
    report.pieces_checked += 1
    report.bytes_checked += c.stored_length
    if report.progress:
        report.progress(report.bytes_checked, report.total_bytes)
    if crc != c.checksum:
        report.problems.append(Problem(
            "checksum", f"checksum mismatch in the piece at {list(c.offsets)} "
            f"(stored {c.checksum:#010x}, read {crc:#010x}); the data is damaged", key, name, _range(c)))
        return False
    return True


def _range(c: ChunkMeta) -> tuple[int, int]:
    return (c.byte_offset, c.byte_offset + c.stored_length)
