"""Executing a rank's load plan: read source chunks once, deliver each part where it is needed."""
from __future__ import annotations

import abc
import bisect
import ctypes
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Iterator, Sequence

import crc32c
import numpy as np
import torch

from ..codec import checksum, combine_block_checksums, crc32c_combine, itemsize, tensor_bytes, tensor_from_bytes
from ..errors import CheckpointDamagedError, CheckpointError, CheckpointReplacedError
from ..metadata import BLOCK_BYTES, ChunkColumns
from ..metadata_format import decode_metadata
from ..options import DEFAULT_IO, IOOptions
from ..storage import METADATA_NAME
from ..planner import ChunkRead, Delivery, byte_runs, merge_runs
from ..state import TensorLeaf
from .compressed import CompressedPieces, read_compressed
from .read_columns import columnar_reads as _columnar_reads

__all__ = ["ChunkReader", "FileChunkReader", "LiveChunkReader", "Deliverer", "check_shares"]


def _narrow(t: torch.Tensor, base, offsets, sizes) -> torch.Tensor:
    """The view of ``t`` (whose first element sits at global ``base``) holding the global box."""
    for d, (o, n, b) in enumerate(zip(offsets, sizes, base)):
        t = t.narrow(d, o - b, n)
    return t


def _region(leaf: TensorLeaf, offsets, sizes) -> torch.Tensor:
    return _narrow(leaf.tensor, leaf.offsets, offsets, sizes)


class Deliverer:
    """Puts delivered parts into this rank's tensors, or queues them for other ranks.

    ``written``: None, or a list the readers add a key to before they write into its tensor's
    memory (a load that is not atomic names them when it fails).

    ``staged``: a two-phase load. Nothing is written into this rank's tensors while the pieces
    are read, verified and exchanged: each part this rank keeps is queued (:meth:`stage`, with
    the verified source bytes it comes from), and :meth:`apply` copies them all in once every
    rank has verified its own (after the load's finish step). Copying verified bytes of the
    right size into memory the state dict already has cannot fail for the data's sake, so a
    load that fails leaves the tensors untouched without an undo copy. The sources must stay
    as they are until then: views of memory the storage holds (the memory tier's objects),
    buffers received from other ranks, or a live group's tensors."""

    def __init__(self, rank: int, leaves: Sequence[TensorLeaf], written: list[str] | None = None,
                 staged: bool = False):
        self.rank = rank
        self.leaves = leaves
        self.outgoing: dict[int, list[tuple[Any, torch.Tensor]]] = {}
        self.received = 0
        self.written = written
        self.pending: list[tuple[str, torch.Tensor, Any]] | None = [] if staged else None

    def stage(self, key: str, dest: torch.Tensor, src: Any) -> None:
        """Queue the copy of ``src`` (a tensor of ``dest``'s shape, or the bytes of a host-dense
        ``dest``) into ``dest``, part of the tensor ``key``, for :meth:`apply`."""
        self.pending.append((key, dest, src))

    def apply(self) -> None:
        """Phase 2 of a staged load: copy every queued part into this rank's tensors."""
        pending, self.pending = self.pending or [], []
        written = self.written
        for key, dest, src in pending:
            if written is not None:
                written.append(key)
            if isinstance(src, torch.Tensor):
                dest.copy_(src)
            else:  # verified bytes of a whole host-dense destination
                np.copyto(_host_bytes(dest), np.frombuffer(src, np.uint8))

    def direct(self, d: Delivery, nbytes: int) -> torch.Tensor | None:
        """The memory that delivery ``d`` (of ``nbytes``) fills, when it is this rank's, on the
        host and contiguous, so that a whole chunk can be read straight into it; None otherwise."""
        if d.rank != self.rank:
            return None
        t = self.whole(d.item, nbytes)
        if t is None:
            leaf = self.leaves[d.item]
            t = _narrow(leaf.tensor, leaf.offsets, d.offsets, d.sizes)
            if not _host_dense(t):
                return None
        return t

    def whole(self, item: int, nbytes: int) -> torch.Tensor | None:
        """This rank's tensor ``item`` when a delivery of ``nbytes`` fills all of it (a delivery
        lies inside its item's box, so equal sizes mean equal boxes) and it is on the host and
        contiguous; None otherwise."""
        t = self.leaves[item].tensor
        if t.nbytes == nbytes and _host_dense(t):
            return t
        return None

    def deliver(self, d: Delivery, src: torch.Tensor) -> None:
        if d.rank == self.rank:
            leaf = self.leaves[d.item]
            if self.pending is not None:
                self.pending.append((leaf.fqn, _region(leaf, d.offsets, d.sizes), src))
                return
            if self.written is not None:
                self.written.append(leaf.fqn)
            _region(leaf, d.offsets, d.sizes).copy_(src)
        else:
            self.outgoing.setdefault(d.rank, []).append(((d.item, d.offsets, d.sizes), tensor_bytes(src)))

    def accept(self, tag: Any, buf: Any) -> None:
        item, offsets, sizes = tag
        leaf = self.leaves[item]
        src = tensor_from_bytes(buf, leaf.dtype, tuple(sizes))
        if self.pending is not None:
            self.pending.append((leaf.fqn, _region(leaf, offsets, sizes), src))
            self.received += 1
            return
        if self.written is not None:
            self.written.append(leaf.fqn)
        _region(leaf, offsets, sizes).copy_(src)
        self.received += 1


def _verifiable(runs: list[tuple[int, int]], ch) -> list[tuple[int, int]]:
    """Widen partial reads to what a checksum covers: whole blocks, or the whole (small) chunk."""
    if runs == [(0, ch.nbytes)] or ch.checksum is None:
        return runs
    if not ch.block_checksums:
        return [(0, ch.nbytes)]
    return merge_runs([(s // BLOCK_BYTES * BLOCK_BYTES, min(-(-e // BLOCK_BYTES) * BLOCK_BYTES, ch.nbytes))
                       for s, e in runs])


class ChunkReader(abc.ABC):
    @abc.abstractmethod
    def read(self, cr: ChunkRead, out: Deliverer) -> int:
        """Deliver every part of the chunk ``cr``; return the bytes read from the source."""

    def read_all(self, reads: Iterable[ChunkRead], out: Deliverer) -> int:
        """Deliver every chunk of ``reads`` (a rank's whole load plan); return the bytes read."""
        return sum(self.read(cr, out) for cr in reads)


def _mismatch(ch, lo: int, hi: int) -> CheckpointError:
    return _damaged(ch.key, ch.file, ch.byte_offset + lo, ch.byte_offset + hi, ch.offsets)


def _damaged(key: str, file: str, start: int, end: int, offsets) -> CheckpointDamagedError:
    return CheckpointDamagedError(
        f"{key}: checksum mismatch in {file} at bytes {start}..{end} (piece at {list(offsets)}); the checkpoint "
        f"is damaged: restore it from another copy", file=file, key=key, byte_range=(start, end))


def _keyed(exc: CheckpointError, key: str) -> CheckpointError:
    """A storage layer error about a file, as one about the tensor ``key`` read from it (same type)."""
    return exc.copy(f"{key}: {exc}", key=key) if isinstance(exc, CheckpointDamagedError) else exc.copy(f"{key}: {exc}")


def _files_of(md) -> set[str]:
    """The names of every data file a checkpoint's metadata refers to."""
    columns = getattr(md.tensors, "columns", None)
    if isinstance(columns, ChunkColumns):
        return set(columns.files)
    files: set[str] = set()
    for t in md.tensors.values():
        names = getattr(t.chunks, "files", None)
        files.update(names if names is not None else (c.file for c in t.chunks))
    return files


class FileChunkReader(ChunkReader):
    """Reads stored chunks through a CheckpointStorage: only the needed byte runs, each once.

    A joint read (``ChunkRead.joint``: other ranks read the rest of the chunk) reads exactly its
    runs; a checksum block it covers only in part is not widened: the CRC of its share goes to
    ``shares`` and :func:`check_shares` verifies the block from every reader's shares.

    ``io`` (:class:`~raydcp.options.IOOptions`) sizes the reads: whole chunks from
    ``io.read_pool_min`` bytes on are read and verified in ``io.read_threads`` threads,
    ``io.read_task_bytes`` per task (whole checksum blocks), overlapping reads with checks;
    smaller chunks of one file are read in batches of up to ``io.read_batch_bytes``. Where each
    request is a round trip to a server (``storage.round_trip_reads``: S3 and the like), chunks
    under ``io.read_task_bytes`` are batched too: touching ones come in one range request.

    The pieces ``compressed`` names (:class:`~raydcp.engine.compressed.CompressedPieces`) are
    each read whole, verified and decompressed (:func:`~raydcp.engine.compressed.read_compressed`),
    ``io.read_threads`` at a time, and their parts delivered from the decompressed bytes.

    ``staged`` (for a :class:`Deliverer` made with ``staged=True``): the first phase of a
    two-phase load, for storage whose reads are views of memory it holds
    (``storage.memory_reads``: the memory tier). Every chunk is fetched as views of the source
    (one request per file), verified there (large chunks' blocks in ``io.read_threads``
    threads), and its parts staged on the Deliverer; nothing is written into the tensors.
    """

    def __init__(self, storage, io: IOOptions = DEFAULT_IO, compressed: CompressedPieces | None = None,
                 staged: bool = False):
        self.storage = storage
        self.io = io
        self.compressed = compressed if compressed else None
        self.shares: list[tuple] = []
        self.staged = staged

    def read_all(self, reads: Iterable[ChunkRead], out: Deliverer) -> int:
        """Read a rank's chunks (see :meth:`_read_all`).

        A file found damaged or missing may be a reader racing a writer: a newer save to the
        same path committed after the load was planned and removed the files of the save being
        read. The committed metadata is then read again: where it no longer refers to that file,
        the checkpoint was replaced, not damaged (:class:`CheckpointReplacedError`: load again).
        """
        try:
            return self._read_all(reads, out)
        except CheckpointDamagedError as exc:
            replaced = self._replaced(exc)
            if replaced is None:
                raise
            raise replaced from None

    def _pool_min(self) -> int:
        """The size from which a whole chunk is read by a task of its own (see the class doc)."""
        if getattr(self.storage, "round_trip_reads", False):
            return max(self.io.read_pool_min, self.io.read_task_bytes)
        return self.io.read_pool_min

    def _replaced(self, exc: CheckpointDamagedError) -> CheckpointReplacedError | None:
        """The error to raise instead of ``exc`` when the checkpoint was replaced while being read."""
        if exc.file is None:
            return None
        try:
            md = decode_metadata(self.storage.read_metadata_bytes(), self.storage.file_url(METADATA_NAME))
            names = _files_of(md)  # an error names a file by its name in the checkpoint or by its URL
            committed = names | {self.storage.file_url(name) for name in names}
        except CheckpointError:  # no longer committed or unreadable: the damage report stands
            return None
        if exc.file in committed:
            return None  # the committed checkpoint still needs that file: it is damaged
        parts = exc.file.rsplit("/", 3)
        read_save = parts[-2] if len(parts) >= 3 and parts[-3] == "data" else None
        return CheckpointReplacedError(
            f"the checkpoint at {self.storage.url} was replaced by a newer save (save {md.save_id!r}) while it "
            f"was being read: {exc.file} belongs to the save this load started from and is gone; nothing is "
            f"damaged: load again to read the new checkpoint",
            path=self.storage.url, read_save=read_save, committed_save=md.save_id)

    def _read_all(self, reads: Iterable[ChunkRead], out: Deliverer) -> int:
        """Read a rank's chunks: whole chunks straight into host tensors, the rest one by one.

        Large whole chunks are read and verified in a small thread pool (reads and CRC32C
        release the GIL, so one task's checks overlap another's reads); small ones are read in
        batches per file, one positional read each into a shared buffer, verified there and
        copied into their tensors, with no per-chunk open, stat or buffer object. A plan given
        as columns (a columnar table of reads) is read from its columns, without a ChunkRead
        per chunk. Compressed pieces are read and decompressed in the same pool, one task each.
        """
        io = self.io
        sorted_reads = _columnar_reads(reads, out, self._pool_min(), self.compressed) or self._sort_reads(reads, out)
        small, large, rest, resolve = sorted_reads
        packed: list[ChunkRead] = []
        if self.compressed is not None:
            packed = [cr for cr in rest if self._packed(cr.source) is not None]
            rest = [cr for cr in rest if self._packed(cr.source) is None] if packed else rest
        nread = sum(e[1] for chunks in small.values() for e in chunks) + sum(ch.nbytes for ch, _ in large)
        if out.pending is not None:
            return nread + self._stage_all(small, large, rest, packed, resolve, out)
        tasks = len(large) + len(packed)
        pool = ThreadPoolExecutor(min(io.read_threads, tasks), thread_name_prefix="raydcp-read") if tasks else None
        task = io.read_task_bytes
        try:
            unpacked = [pool.submit(self._read_packed, cr, out) for cr in packed]
            written = out.written
            pending = [(ch, [pool.submit(self._read_part, ch, view, s, min(s + task, ch.nbytes), written)
                             for s in range(0, ch.nbytes, task)])
                       for ch, view in ((ch, memoryview(_host_bytes(dest))) for ch, dest in large)]
            for name, chunks in small.items():
                self._read_small(name, chunks, resolve, out.written)
            for cr in rest:
                nread += self.read(cr, out)
            nread += sum(f.result() for f in unpacked)
            for ch, futures in pending:
                self._check_blocks(ch, [f.result() for f in futures])
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        return nread

    def _stage_all(self, small: dict, large: list, rest: list, packed: list, resolve, out: Deliverer) -> int:
        """Phase 1 of a staged load (see the class doc) over :meth:`_read_all`'s sorted reads;
        returns the bytes read beside the whole chunks'."""
        task = self.io.read_task_bytes
        by_file: dict[str, list[tuple]] = {}  # (byte offset, nbytes, chunk or None, destination, ref, checksum)
        for name, chunks in small.items():
            by_file.setdefault(name, []).extend((off, nb, None, dest, ref, crc) for off, nb, crc, dest, ref in chunks)
        for ch, dest in large:
            by_file.setdefault(ch.file, []).append((ch.byte_offset, ch.nbytes, ch, dest, None, ch.checksum))
        big = sum(1 for ch, _ in large for _ in range(0, ch.nbytes, task)) + len(packed)
        pool = ThreadPoolExecutor(min(self.io.read_threads, big), thread_name_prefix="raydcp-read") if big else None
        crc = crc32c.crc32c
        try:
            unpacked = [pool.submit(self._read_packed, cr, out) for cr in packed]
            checks = []
            for name, entries in by_file.items():
                try:
                    views = self.storage.read_ranges(name, [(e[0], e[0] + e[1]) for e in entries])
                except CheckpointError as exc:
                    first = entries[0][2] or (resolve(entries[0][4]) if resolve else entries[0][4])
                    raise _keyed(exc, first.key) from None
                for (_, nb, ch, dest, ref, expected), view in zip(entries, views):
                    if ch is None:  # a small chunk: verified here
                        ch = resolve(ref) if resolve else ref
                        if expected is not None and crc(view) != expected:
                            raise _mismatch(ch, 0, nb)
                    else:
                        checks.append((ch, [pool.submit(self._check_range, ch, view, s, min(s + task, nb))
                                            for s in range(0, nb, task)]))
                    out.stage(ch.key, dest, view)
            nread = self._stage_rest(rest, out)
            nread += sum(f.result() for f in unpacked)
            for ch, futures in checks:
                self._check_blocks(ch, [f.result() for f in futures])
        finally:
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)
        return nread

    def _packed(self, ch) -> tuple[int, int] | None:
        """``(codec id, stored length)`` of a compressed piece, None for a raw one."""
        return None if self.compressed is None else self.compressed.get(ch.file, ch.byte_offset)

    def _read_packed(self, cr: ChunkRead, out: Deliverer) -> int:
        """Read a compressed piece whole, deliver its parts; return the stored bytes read."""
        whole, nread = read_compressed(self.storage, cr.source, *self._packed(cr.source))
        ch = cr.source
        for d in cr.deliveries:
            out.deliver(d, _narrow(whole, ch.offsets, d.offsets, d.sizes))
        return nread

    def _sort_reads(self, reads: Iterable[ChunkRead], out: Deliverer):
        """Split ``reads`` into small whole chunks by file (``(byte offset, nbytes, checksum,
        destination, chunk)``), large whole chunks ``(chunk, destination)`` and the rest
        (compressed pieces among them)."""
        small: dict[str, list[tuple]] = {}
        large: list[tuple[Any, torch.Tensor]] = []
        rest: list[ChunkRead] = []
        pool_min = self._pool_min()
        for cr in reads:
            ch = cr.source
            nbytes = ch.nbytes
            if nbytes == 0:
                continue
            dels = cr.deliveries
            if len(dels) == 1 and dels[0].sizes == ch.sizes and self._packed(ch) is None:
                dest = out.direct(dels[0], nbytes)
                if dest is not None:
                    if nbytes < pool_min:
                        small.setdefault(ch.file, []).append((ch.byte_offset, nbytes, ch.checksum, dest, ch))
                    else:
                        large.append((ch, dest))
                    continue
            rest.append(cr)
        return small, large, rest, None

    def _read_part(self, ch, view: memoryview, start: int, end: int, written: list[str] | None = None) -> list[int]:
        """Read bytes [start, end) of chunk ``ch`` into ``view`` (the whole chunk's memory) and
        verify them: block by block where the chunk has block checksums (their CRCs are returned,
        to be combined into the chunk's), else the whole chunk against its checksum. ``written``:
        see :class:`Deliverer`."""
        if written is not None:
            written.append(ch.key)
        try:
            self.storage.read_into(ch.file, ch.byte_offset + start, view[start:end])
        except CheckpointError as exc:
            raise _keyed(exc, ch.key) from None
        return self._check_range(ch, view, start, end)

    @staticmethod
    def _check_range(ch, view: memoryview, start: int, end: int) -> list[int]:
        """Verify bytes [start, end) of chunk ``ch``, whose bytes ``view`` holds (see :meth:`_read_part`)."""
        if ch.checksum is None:
            return []
        crc = crc32c.crc32c
        if not ch.block_checksums:
            if crc(view[start:end]) != ch.checksum:
                raise _mismatch(ch, start, end)
            return []
        out = []
        for lo in range(start, end, BLOCK_BYTES):
            hi = min(lo + BLOCK_BYTES, end)
            c = crc(view[lo:hi])
            if c != ch.block_checksums[lo // BLOCK_BYTES]:
                raise _mismatch(ch, lo, hi)
            out.append(c)
        return out

    @staticmethod
    def _check_blocks(ch, parts: list[list[int]]) -> None:
        """Combine the block CRCs of a chunk's parts (:meth:`_check_range`, in order) and check
        them against the chunk's checksum."""
        if ch.block_checksums and ch.checksum is not None:
            blocks = [b for p in parts for b in p]
            if combine_block_checksums(blocks, ch.nbytes, BLOCK_BYTES) != ch.checksum:
                raise _mismatch(ch, 0, ch.nbytes)

    def _read_small(self, name: str, chunks: list[tuple], resolve: Callable[[Any], Any] | None,
                    written: list[str] | None = None) -> None:
        """Read small whole chunks ``(byte offset, nbytes, checksum, destination, ref)`` of file
        ``name`` in batches: each batch into one buffer, touching chunks with one read, then each
        chunk verified and copied into its tensor. ``resolve(ref)`` gives the chunk (a
        SourceChunk) to name in errors; without ``resolve``, ``ref`` is the chunk. ``written``:
        see :class:`Deliverer`."""
        crc = crc32c.crc32c
        memmove = ctypes.memmove
        batch_bytes = self.io.read_batch_bytes
        chunks.sort(key=_first)  # in file order: sequential reads, touching ones merged
        i, n = 0, len(chunks)
        while i < n:
            j, size = i, 0
            while j < n and (j == i or size + chunks[j][1] <= batch_bytes):
                size += chunks[j][1]
                j += 1
            batch = chunks[i:j]
            buf = np.empty(size, np.uint8)
            view = memoryview(buf)
            base = buf.ctypes.data
            requests = []  # (file offset, where in the buffer) of each read of touching chunks
            start = pos = end = 0
            for off, nb, _, _, _ in batch:
                if off != end:
                    if pos > start:
                        requests.append((end - (pos - start), view[start:pos]))
                    start = pos
                pos += nb
                end = off + nb
            requests.append((end - (pos - start), view[start:pos]))
            try:
                self.storage.read_into_many(name, requests)
            except CheckpointError:
                for _, nb, _, dest, ref in batch:  # name the first chunk that cannot be read
                    self._read_part(resolve(ref) if resolve else ref, memoryview(_host_bytes(dest)), 0, nb, written)
                raise
            pos = 0
            for _, nb, expected, dest, ref in batch:
                if expected is not None and crc(view[pos:pos + nb]) != expected:
                    raise _mismatch(resolve(ref) if resolve else ref, 0, nb)
                if written is not None:
                    written.append((resolve(ref) if resolve else ref).key)
                memmove(dest.data_ptr(), base + pos, nb)
                pos += nb
            i = j

    def read(self, cr: ChunkRead, out: Deliverer) -> int:
        ch = cr.source
        if ch.nbytes == 0:
            return 0
        if self._packed(ch) is not None:
            return self._read_packed(cr, out)
        if len(cr.deliveries) == 1 and out.pending is None:
            d = cr.deliveries[0]
            if d.rank == out.rank and d.sizes == ch.sizes and self._read_direct(cr, d, out):
                return ch.nbytes
        runs = self._runs(cr)
        return self._deliver_runs(cr, runs, self._fetch(ch, runs[2]), out)

    @staticmethod
    def _runs(cr: ChunkRead) -> tuple[list, bool, list[tuple[int, int]]]:
        """What :meth:`read` reads of chunk ``cr``: (each delivery's byte runs, whether it is a
        joint read, the runs to read: merged, widened to whole checksum blocks unless joint)."""
        ch = cr.source
        isz = itemsize(ch.dtype)
        per_delivery = [byte_runs(ch.offsets, ch.sizes, d.offsets, d.sizes, isz) for d in cr.deliveries]
        joint = getattr(cr, "joint", False) and ch.checksum is not None
        runs = merge_runs([r for rs in per_delivery for r in rs])
        if not joint:
            runs = _verifiable(runs, ch)
        return per_delivery, joint, runs

    def _deliver_runs(self, cr: ChunkRead, runs: tuple, bufs: Sequence[Any], out: Deliverer) -> int:
        """Verify the bytes ``bufs`` read of chunk ``cr`` (one per run of :meth:`_runs`'s
        ``runs``) and deliver its parts from them; return the bytes read."""
        ch = cr.source
        per_delivery, joint, runs = runs
        if runs == [(0, ch.nbytes)]:  # the whole chunk: verify it, then slice deliveries from it
            self._verify(ch, bufs[0])
            whole = tensor_from_bytes(bufs[0], ch.dtype, ch.sizes)
            for d in cr.deliveries:
                out.deliver(d, _narrow(whole, ch.offsets, d.offsets, d.sizes))
        else:  # parts of the chunk: verify the blocks read, assemble each delivery from them
            for (s, e), buf in zip(runs, bufs):
                if joint:
                    self._verify_share(ch, s, e, buf)
                else:
                    self._verify_blocks(ch, s, e, buf)
            starts = [s for s, _ in runs]
            for d, drs in zip(cr.deliveries, per_delivery):
                parts = []
                for s, e in drs:
                    j = bisect.bisect_right(starts, s) - 1
                    base = runs[j][0]
                    parts.append(memoryview(bufs[j])[s - base:e - base])
                data = parts[0] if len(parts) == 1 else b"".join(parts)
                out.deliver(d, tensor_from_bytes(data, ch.dtype, d.sizes))
        return sum(e - s for s, e in runs)

    def _stage_rest(self, rest: Sequence[ChunkRead], out: Deliverer) -> int:
        """:meth:`read` of every chunk of ``rest`` (a staged load's), their runs fetched in one
        request per file (views, for storage whose reads are memory it holds)."""
        todo = [(cr, self._runs(cr)) for cr in rest if cr.source.nbytes and self._packed(cr.source) is None]
        by_file: dict[str, list[tuple[int, int]]] = {}
        for cr, (_, _, runs) in todo:
            ch = cr.source
            by_file.setdefault(ch.file, []).extend((ch.byte_offset + s, ch.byte_offset + e) for s, e in runs)
        views: dict[str, Iterator] = {}
        for name, ranges in by_file.items():
            try:
                views[name] = iter(self.storage.read_ranges(name, ranges))
            except CheckpointError as exc:
                first = next(cr.source for cr, _ in todo if cr.source.file == name)
                raise _keyed(exc, first.key) from None
        nread = 0
        for cr, runs in todo:
            got = views[cr.source.file]
            nread += self._deliver_runs(cr, runs, [next(got) for _ in runs[2]], out)
        return nread + sum(self.read(cr, out) for cr in rest if self._packed(cr.source) is not None)

    def _fetch(self, ch, runs):
        try:
            return self.storage.read_ranges(ch.file, [(ch.byte_offset + s, ch.byte_offset + e) for s, e in runs])
        except CheckpointError as exc:
            raise _keyed(exc, ch.key) from None

    def _read_direct(self, cr: ChunkRead, d: Delivery, out: Deliverer) -> bool:
        """Read a whole chunk straight into this rank's tensor memory when it is contiguous on the host."""
        dest = _region(out.leaves[d.item], d.offsets, d.sizes)
        if dest.device.type != "cpu" or not dest.is_contiguous():
            return False
        ch = cr.source
        view = dest.reshape(-1).view(torch.uint8).numpy()
        if out.written is not None:
            out.written.append(ch.key)
        try:
            self.storage.read_into(ch.file, ch.byte_offset, memoryview(view))
        except CheckpointError as exc:
            raise _keyed(exc, ch.key) from None
        self._verify(ch, view)
        return True

    def _verify_share(self, ch, start: int, end: int, buf) -> None:
        """Verify the checksum blocks bytes [start, end) of ``ch`` cover whole; keep the CRCs of
        the shares of the others (a chunk without block checksums is one block)."""
        view = memoryview(buf)
        block = BLOCK_BYTES if ch.block_checksums else ch.nbytes
        for b in range(start // block, -(-end // block)):
            lo_b, hi_b = b * block, min((b + 1) * block, ch.nbytes)
            lo, hi = max(start, lo_b), min(end, hi_b)
            expected = ch.block_checksums[b] if ch.block_checksums else ch.checksum
            crc = checksum(view[lo - start:hi - start])
            if (lo, hi) == (lo_b, hi_b):
                if crc != expected:
                    raise _mismatch(ch, lo, hi)
            else:
                self.shares.append((ch.key, tuple(ch.offsets), ch.file, ch.byte_offset + lo_b, hi_b - lo_b,
                                    lo - lo_b, hi - lo_b, crc, expected))

    @staticmethod
    def _verify_blocks(ch, start: int, end: int, buf) -> None:
        view = memoryview(buf)
        for b in range(start // BLOCK_BYTES, -(-end // BLOCK_BYTES)):
            lo, hi = b * BLOCK_BYTES, min((b + 1) * BLOCK_BYTES, ch.nbytes)
            if checksum(view[lo - start:hi - start]) != ch.block_checksums[b]:
                raise _mismatch(ch, lo, hi)

    @staticmethod
    def _verify(ch, buf) -> None:
        if ch.checksum is not None and checksum(buf) != ch.checksum:
            raise _mismatch(ch, 0, ch.nbytes)


def check_shares(shares: Iterable[tuple]) -> None:
    """Verify the checksum blocks that several ranks read in shares (``FileChunkReader.shares``
    of every rank): the shares of each block must tile it, and their CRCs, combined in order,
    must give the block's stored checksum."""
    blocks: dict[tuple[str, int], list[tuple]] = {}
    for share in shares:
        blocks.setdefault((share[2], share[3]), []).append(share)
    for (file, at), parts in blocks.items():
        parts.sort(key=lambda p: p[5])
        key, offsets, _, _, length, _, _, _, expected = parts[0]
        pos, crc = 0, None
        for p in parts:
            if p[5] != pos:
                break
            crc = p[7] if crc is None else crc32c_combine(crc, p[7], p[6] - p[5])
            pos = p[6]
        if pos != length:
            raise CheckpointError(
                f"{key}: bytes {at}..{at + length} of {file} (piece at {list(offsets)}) were read in parts "
                f"that do not cover them, so their checksum cannot be checked; this is a bug in the load plan")
        if crc != expected:
            raise _damaged(key, file, at, at + length, offsets)


def _first(x: tuple) -> Any:
    return x[0]


def _host_dense(t: torch.Tensor) -> bool:
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _host_bytes(t: torch.Tensor) -> np.ndarray:
    """A writable uint8 array over the memory of a host-contiguous tensor."""
    return t.detach().reshape(-1).view(torch.uint8).numpy()


class LiveChunkReader(ChunkReader):
    """Serves chunks from tensors this rank holds in memory (in-memory reshard)."""

    def __init__(self, pieces: Callable[[str], torch.Tensor]):
        self.pieces = pieces  # key -> this rank's piece of that tensor

    def read(self, cr: ChunkRead, out: Deliverer) -> int:
        ch = cr.source
        whole = self.pieces(ch.key)
        for d in cr.deliveries:
            out.deliver(d, _narrow(whole, ch.offsets, d.offsets, d.sizes))
        return 0
