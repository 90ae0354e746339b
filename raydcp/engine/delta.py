"""Delta saves: write only the pieces that changed since a base checkpoint, reference the rest.

A save with ``SaveOptions(base=...)`` runs the save protocol as usual; in the write step each rank
(:func:`split_reused`):

1. hashes every piece it was planned to write (:data:`DIGEST`: xxh3-128 of its bytes, pieces over
   16 MiB as the xxh3-128 of their 16 MiB blocks' digests, so that every block of every piece is
   hashed in parallel, by as many threads as there are cores, the rank's smallest files first);
2. looks the piece up in the base: the same tensor and box, a chunk whose digest (recorded by the
   save that wrote it, in its *digest file*) equals the new one. Unchanged is decided by content
   only: a changed byte changes the digest, and a chunk without a recorded digest is written;
3. pins every base directory it will reference (:mod:`raydcp.storage.references`), then checks
   that none is being removed and that every file it will reference is still there (else it
   writes those pieces itself);
4. writes the other pieces (the rank's files laid out again without the reused ones), and records
   the reused ones as rows naming the base's file and byte range, with the base chunk's checksums:
   the metadata's ``files`` then include ``../<base>/data/...`` names (format 3.0);
5. writes its digest file, ``data/<save_id>/r<rank>-f<first file>.xxh3``, with the digest of every
   piece it wrote or referenced, so the next delta save can compare against this one.

References are always direct: a delta of a delta names the file where the bytes lie, so a load
reads each piece from one place, however many deltas deep. ``base="previous"`` is the newest
checkpoint that the same writer (the Group's name, else this process) committed with digests
under the same parent directory; none found, the save is a full one (with digests).
"""
from __future__ import annotations

import json
import logging
import os
import posixpath
import struct
import threading
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import xxhash

from ..codec import checksum
from ..errors import CheckpointDamagedError, CheckpointError, CheckpointNotFoundError
from ..metadata import COMPRESSIONS, ChunkTable, Metadata
from ..metadata_format import decode_metadata
from ..planner.save import ALIGN
from ..storage import CheckpointStorage
from ..storage import references as refs
from ..storage.retention import list_committed
from . import written_pages
from .save_records import StorageRecord

__all__ = ["PROCESS_WRITER", "writer_of", "DeltaBase", "resolve_base", "DeltaWrite", "digest_file_name",
           "remember_commit", "DeltaSave", "digest_record", "writer_environment"]

# group-less saves of this process: "previous" is what this process committed (its helper
# processes, which persist its asynchronous saves, get its name in their environment)
_WRITER_ENV = "RAYDCP_DELTA_WRITER"
PROCESS_WRITER = os.environ.get(_WRITER_ENV) or f"process-{uuid.uuid4().hex}"
_MAGIC = b"RAYDCPX\n"
_PREFIX = struct.Struct("<8sIQ")  # magic, CRC32C of the body, body length
_LAST: dict[tuple[str, str], str] = {}
DIGEST = "xxh3-128/16MiB"
"""How a piece's digest is made (the digest file's ``digest``): the xxh3-128 of its bytes, or for a
piece over :data:`DIGEST_BLOCK` bytes the xxh3-128 of the concatenated xxh3-128 digests of its
blocks of :data:`DIGEST_BLOCK` bytes (the last one shorter). A digest file made another way (no
``digest`` in its header: whole pieces) is not compared with."""
DIGEST_BLOCK = 16 << 20
_log = logging.getLogger(__name__)  # (parent url, writer) -> the last checkpoint this process saw it commit


def writer_of(transport: Any) -> str:
    """Who writes a save, for ``base="previous"``: the Group's name, else this process."""
    group = getattr(transport, "group", None)
    name = getattr(group, "name", None)
    return f"group-{name}" if isinstance(name, str) and name else PROCESS_WRITER


def writer_environment() -> dict[str, str]:
    """The environment a helper process persisting this process's saves gets: its writer's name."""
    return {_WRITER_ENV: PROCESS_WRITER}


def digest_file_name(first_file: str) -> str:
    """The digest file beside a rank's data files (``data/<sid>/r00000-f000.bin`` -> ``...f000.xxh3``)."""
    return first_file[: -len(".bin")] + ".xxh3" if first_file.endswith(".bin") else first_file + ".xxh3"


def _encode_digests(writer: str, save_id: str, files: Sequence[str], offsets: np.ndarray, digests: bytes) -> bytes:
    head = json.dumps({"writer": writer, "save_id": save_id, "files": list(files), "digest": DIGEST}).encode()
    body = struct.pack("<I", len(head)) + head + offsets.astype("<i8").tobytes() + digests
    return _PREFIX.pack(_MAGIC, checksum(body), len(body)) + body


def _decode_digests(data: bytes, source: str) -> tuple[dict, np.ndarray, np.ndarray]:
    """``(header, (file index, byte offset) rows, digests)`` of a digest file; damage is an error."""
    try:
        magic, crc, length = _PREFIX.unpack_from(data)
        body = memoryview(data)[_PREFIX.size:]
        if magic != _MAGIC or len(body) != length or checksum(body) != crc:
            raise ValueError("bad magic, length or checksum")
        (hlen,) = struct.unpack_from("<I", body)
        head = json.loads(bytes(body[4:4 + hlen]))
        rest = body[4 + hlen:]
        n = len(rest) // 32
        if len(rest) != n * 32:
            raise ValueError("rows of the wrong length")
        rows = np.frombuffer(rest[: n * 16], "<i8").reshape(n, 2)
        return head, rows, np.frombuffer(rest[n * 16:], np.uint8).reshape(n, 16)
    except (ValueError, struct.error, TypeError) as exc:
        raise CheckpointDamagedError(f"digest file {source} is damaged ({exc})", file=source) from None


@dataclass
class _Chunk:
    file: str       # relative to the base
    byte_offset: int
    nbytes: int
    crc: int
    blocks: tuple
    codec: int
    stored: int


class DeltaBase:
    """A committed base checkpoint as one rank of a delta save sees it: its chunks by tensor and
    box, and (read when first needed, this rank's first) the digests its writers recorded."""

    def __init__(self, storage: CheckpointStorage, md: Metadata, writer: str):
        self.storage, self.metadata, self.writer = storage, md, writer
        self._digests: dict[tuple[str, int], bytes] | None = None
        self._names: list[str] | None = None  # the base's digest files
        self._read_all = False
        self._lock = threading.Lock()

    @property
    def url(self) -> str:
        return self.storage.url

    def chunk(self, key: str, offsets: tuple, sizes: tuple) -> _Chunk | None:
        """The base's chunk of tensor ``key`` with exactly this box, or None (looked up in the
        tensor's columns: no object per chunk of the base)."""
        tm = self.metadata.tensors.get(key)
        if tm is None:
            return None
        chunks = tm.chunks
        if isinstance(chunks, ChunkTable):
            if not len(chunks) or chunks.offsets.shape[1] != len(offsets):
                return None
            hit = np.flatnonzero((chunks.offsets == np.asarray(offsets, np.int64)).all(1)
                                 & (chunks.sizes == np.asarray(sizes, np.int64)).all(1))
            if not len(hit):
                return None
            c = chunks[int(hit[0])]
        else:
            c = next((c for c in chunks if tuple(c.offsets) == offsets and tuple(c.sizes) == sizes), None)
            if c is None:
                return None
        codec = 0 if c.compression is None else COMPRESSIONS.index(c.compression) + 1
        return _Chunk(c.file, c.byte_offset, c.nbytes, c.checksum, tuple(c.block_checksums), codec, c.stored_length)

    def digest(self, path: str, byte_offset: int, rank: int) -> bytes | None:
        """The digest the base's writers recorded for the chunk at ``byte_offset`` of file ``path``
        (resolved, so the digests recorded by the save that wrote a file and by later deltas agree),
        or None. Rank ``rank``'s own digest files are read first (a rank of an unchanged layout finds
        all its pieces there); the other ranks' only on a miss."""
        with self._lock:  # files are decided in several threads: one loads, the others wait for it
            if self._digests is None:
                self._digests, self._read_all = {}, False
                self._load(lambda n: n.rsplit("/", 1)[-1].startswith(f"r{rank:05d}-"))
            got = self._digests.get((path, byte_offset))
            if got is None and not self._read_all:
                self._read_all = True
                self._load(lambda n: not n.rsplit("/", 1)[-1].startswith(f"r{rank:05d}-"))
                got = self._digests.get((path, byte_offset))
            return got

    def _load(self, which: Callable[[str], bool]) -> None:
        sid = self.metadata.save_id.split("/", 1)[0]
        if self._names is None:
            self._names = [n for n in self.storage.list_files(f"data/{sid}/") if n.endswith(".xxh3")]
        for name in filter(which, self._names):
            try:
                head, rows, digs = _decode_digests(self.storage.read_file(name), self.storage.file_url(name))
            except CheckpointError as exc:  # its pieces are written again, never guessed
                _log.warning("%s; the pieces it covers are written in full by this save", exc)
                continue
            if head.get("digest") != DIGEST:  # made another way: never equal by construction, so not read
                _log.info("digest file %s was made as %r, not %r: the pieces it covers are written in full",
                          self.storage.file_url(name), head.get("digest", "xxh3-128"), DIGEST)
                continue
            files = [refs.resolve(self.storage.path, str(f)) for f in head.get("files", [])]
            for (f, off), d in zip(rows.tolist(), digs):
                if 0 <= f < len(files):
                    self._digests[(files[f], off)] = d.tobytes()


def _hash_blocks(view: memoryview, first: int, last: int) -> list[bytes]:
    """The digests of blocks ``first``..``last - 1`` of ``view``."""
    return [xxhash.xxh3_128_digest(view[b * DIGEST_BLOCK:(b + 1) * DIGEST_BLOCK]) for b in range(first, last)]


def _read_blocks(read: Callable[[int, int, int], None], nbytes: int, first: int, last: int) -> list[bytes]:
    """The digests of blocks ``first``..``last - 1`` of a piece read through ``read(start, nbytes,
    address)`` (a piece held by another process)."""
    buf = np.empty(min(DIGEST_BLOCK, max(nbytes, 1)), np.uint8)
    out = []
    for b in range(first, last):
        s, e = b * DIGEST_BLOCK, min((b + 1) * DIGEST_BLOCK, nbytes)
        if e > s:
            read(s, e - s, buf.ctypes.data)
        out.append(xxhash.xxh3_128_digest(memoryview(buf)[: e - s]))
    return out


def _block_count(nbytes: int) -> int:
    return max(1, -(-nbytes // DIGEST_BLOCK))


def _combine(nbytes: int, blocks: Sequence[bytes]) -> bytes:
    """A piece's digest (:data:`DIGEST`) from its blocks' digests."""
    return blocks[0] if nbytes <= DIGEST_BLOCK else xxhash.xxh3_128_digest(b"".join(blocks))


def _host_bytes(source: Any) -> memoryview:
    """The raw bytes of a tensor in host memory (copied there if it is on a device or not contiguous)."""
    t = source.detach()
    if not t.is_cpu:
        t = t.cpu()
    return memoryview(t.contiguous().reshape(-1).view(_uint8()).numpy())


def _uint8():
    import torch

    return torch.uint8


def resolve_base(storage: CheckpointStorage, base: str | os.PathLike, writer: str) -> DeltaBase | None:
    """The base of a delta save to ``storage``: ``base`` itself (which must be committed, on the same
    filesystem), or for ``"previous"`` the newest checkpoint committed with digests by ``writer``
    beside ``storage`` (None: there is none, the save is a full one)."""
    if base == "previous":
        return _previous(storage, writer)
    try:
        bs = CheckpointStorage(base, storage.storage_options)
    except CheckpointError as exc:
        raise CheckpointError(f"SaveOptions(base={os.fspath(base)!r}): {exc}") from exc
    if type(bs.fs) is not type(storage.fs) or bs.fs.protocol != storage.fs.protocol:
        raise CheckpointError(
            f"SaveOptions(base={bs.url!r}) lies on another filesystem than {storage.url}: a delta checkpoint "
            "references its base's files, so both must be on one filesystem; save a full checkpoint there "
            "(no base), or give a base on the same filesystem")
    if posixpath.normpath(bs.path) == posixpath.normpath(storage.path):
        raise CheckpointError(
            f"SaveOptions(base={bs.url!r}) is the path being saved: the new save replaces it, so it cannot "
            "be its base; save to a new directory (e.g. one per step) with base='previous'")
    md = _committed(bs)
    if md is None:
        raise CheckpointNotFoundError(
            f"SaveOptions(base={bs.url!r}): no committed checkpoint there; give the path of a committed "
            "checkpoint, or base='previous'")
    return DeltaBase(bs, md, writer)


def _committed(storage: CheckpointStorage) -> Metadata | None:
    try:
        if not storage.is_committed():
            return None
        return decode_metadata(storage.read_metadata_bytes(), storage.file_url("raydcp.meta"))
    except CheckpointNotFoundError:
        return None


def _previous(storage: CheckpointStorage, writer: str) -> DeltaBase | None:
    parent = posixpath.dirname(storage.path.rstrip("/"))
    parent_storage = storage.at(parent)
    own = posixpath.normpath(storage.path)
    remembered = _LAST.get((parent_storage.url, writer))
    candidates: list[str] = []
    if remembered is not None:
        candidates.append(remembered)
    try:
        found = list_committed(parent_storage.url, storage.storage_options, links=False)
    except CheckpointError:
        found = []
    candidates += [c.url for c in reversed(found)]
    for url in dict.fromkeys(candidates):
        cand = CheckpointStorage(url, storage.storage_options)
        if posixpath.normpath(cand.path) == own:
            continue
        md = _committed(cand)
        if md is None:
            continue
        sid = md.save_id.split("/", 1)[0]
        try:
            names = [n for n in cand.list_files(f"data/{sid}/") if n.endswith(".xxh3")]
            if not names:
                continue
            head, _, _ = _decode_digests(cand.read_file(names[0]), cand.file_url(names[0]))
        except CheckpointError as exc:
            _log.warning("%s; %s is not used as a base", exc, cand.url)
            continue
        if head.get("writer") == writer:
            return DeltaBase(cand, md, writer)
    return None


@dataclass(frozen=True)
class DeltaSave:
    """What one rank's write step of a delta save needs: the base (None: a full save that records
    digests) and who writes (for ``base="previous"``)."""

    base: DeltaBase | None
    writer: str


def remember_commit(storage: CheckpointStorage, writer: str) -> None:
    """After a save with digests committed: ``"previous"`` by ``writer`` beside it is it."""
    parent = storage.at(posixpath.dirname(storage.path.rstrip("/")))
    _LAST[(parent.url, writer)] = storage.url


_TRACK_MIN = 1 << 20  # smaller pieces are hashed, not tracked: hashing them costs less than a registration
_KNOWN_MAX = 1 << 16
# (address, bytes) -> (the tracker, its scan, the blocks' digests as of that scan)
_KNOWN: dict[tuple[int, int], tuple[Any, int, list[bytes]]] = {}
_known_lock = threading.Lock()


_HOT_SCANS = 8
_HOT: dict[tuple[int, int], tuple[Any, int]] = {}  # (address, bytes) -> (the tracker, the scan it was untracked at)


def _bounded(table: dict, key: Any, value: Any) -> None:
    table.pop(key, None)
    table[key] = value
    while len(table) > _KNOWN_MAX:
        del table[next(iter(table))]


def _remember(key: tuple[int, int], tracking: Any, epoch: int, blocks: list[bytes]) -> None:
    with _known_lock:
        _bounded(_KNOWN, key, (tracking, epoch, blocks))


class DeltaWrite:
    """Steps 1-3 of one rank's write step of a delta save, file by file, so that a file's pieces
    are decided (hashed, looked up) and the ones that changed written while the next file's are
    hashed: ``hash`` once with the planned files in the order they will be decided, ``decide``
    per planned file (from any thread), then ``finish`` once (``close`` in any case).

    Hashing runs in its own threads, as many as there are cores (it is CPU- and memory-bound), over
    blocks of :data:`DIGEST_BLOCK` bytes in the order the files are decided: a large piece is hashed
    by every core at once, and a file's decision waits only for its own pieces' blocks.

    Every base directory the rank may reference is pinned first, with the base's files there,
    and kept only if it is not being removed and its files are all still there; ``finish``
    narrows each pin to the files the rank references (and removes the pins of directories it
    references nothing in), so retention keeps exactly those.
    """

    def __init__(self, storage: CheckpointStorage, base: DeltaBase | None, rank: int, save_id: str,
                 items: Sequence, sources: Sequence | None, read: Callable[[str, int, int, int, int], None] | None):
        self.storage, self.base, self.rank, self.save_id = storage, base, rank, save_id
        self.items, self.sources, self.read = items, sources, read
        self.digests: dict[int, bytes] = {}
        self._threads = max(1, min(len(os.sched_getaffinity(0)), 8))
        self._hashing = ThreadPoolExecutor(self._threads, thread_name_prefix="raydcp-hash")
        self._blocks: dict[int, list[Future]] = {}  # item -> its blocks' digests, in runs of blocks
        self._tracked: dict[int, tuple[int, int]] = {}  # item -> (address, bytes): its digest is remembered
        self._tracking: written_pages.WrittenPages | None = None
        self._epoch = 0  # the write-tracking scan this save's digests are as of
        self.reused: dict[int, tuple[_Chunk, str]] = {}  # item -> base chunk, its file named from the new checkpoint
        self.owners: dict[str, CheckpointStorage] = {}  # pinned owner (relative to the new checkpoint) -> its storage
        self.pinned: dict[str, set[str]] = {}  # the files each pin names now
        if base is not None:
            self._pin_bases()

    def _pin_bases(self) -> None:
        files: dict[str, set[str]] = {}
        for name in self.base.metadata.files:
            ref = refs.reference_to(self.storage.path, self.base.storage.path, name)
            owner_rel = refs.owner_of(ref)
            files.setdefault(owner_rel, set()).add(ref)
        for owner_rel, names in files.items():
            owner = self.storage.at(posixpath.normpath(f"{self.storage.path}/{owner_rel}"))
            try:
                refs.write_pin(owner, posixpath.relpath(self.storage.path, owner.path), self.save_id, self.rank,
                               [f[len(owner_rel) + 1:] for f in names])
                if refs.tombstoned(owner) or any(self.storage.file_size(f) is None for f in names):
                    self._unpin(owner)
                    continue  # being removed, or already partly gone: its pieces are written
            except CheckpointError:
                continue  # not reachable as it should be: its pieces are written
            self.owners[owner_rel] = owner
            self.pinned[owner_rel] = names

    def _unpin(self, owner: CheckpointStorage) -> None:
        try:
            owner.remove_files([refs.pin_name(self.save_id, self.rank)])
        except CheckpointError:
            pass  # a pin left behind keeps files longer, never fewer

    def hash(self, files: Sequence[tuple[str, Sequence[int]]]) -> None:
        """Start hashing the pieces of ``files`` (name, items), in this order, block by block.

        For a piece in this process's memory, the kernel's write tracking
        (:mod:`raydcp.engine.written_pages`) says which of its blocks nobody wrote since this
        process last hashed them: those keep their digests and are not read."""
        tracking = self._tracking = written_pages.tracker() if self.sources is not None else None
        self._epoch = tracking.scan() if tracking is not None else 0
        for name, ids in files:
            for i in ids:
                known = self._known(tracking, i) if tracking is not None else None
                self._blocks[i] = self._submit(name, i, known)

    def _known(self, tracking: written_pages.WrittenPages, i: int) -> list[bytes | None] | None:
        """Piece ``i``'s block digests that still hold (None where a block must be hashed), or None
        when it is not tracked; a trackable piece is tracked from now on (its digests remembered
        once hashed), unless it was rewritten whole since the last time: a piece trained at every
        step would only pay a fault per page per checkpoint, so it is hashed, untracked, for the
        next :data:`_HOT_SCANS` saves."""
        src, nbytes = self.sources[i], self.items[i].nbytes
        if nbytes < _TRACK_MIN or not written_pages.trackable(src):
            return None
        key, count = (src.data_ptr(), nbytes), _block_count(nbytes)
        with _known_lock:
            by, epoch, blocks = _KNOWN.get(key, (None, 0, None))
            hot = _HOT.get(key)
        if hot is not None and hot[0] is tracking and self._epoch - hot[1] < _HOT_SCANS:
            return None
        known: list[bytes | None] = [None] * count
        if by is tracking and len(blocks) == count:  # another tracker's scans (a forked parent's) say nothing here
            known = [d if tracking.unchanged_since(key[0] + b * DIGEST_BLOCK, min(DIGEST_BLOCK, nbytes - b * DIGEST_BLOCK),
                                                   epoch) else None for b, d in enumerate(blocks)]
            if all(d is None for d in known):
                tracking.untrack(*key)
                with _known_lock:
                    _KNOWN.pop(key, None)
                    _bounded(_HOT, key, (tracking, self._epoch))
                return None
        if not tracking.track(*key):
            return None
        self._tracked[i] = key
        return known

    def _submit(self, name: str, i: int, known: list[bytes | None] | None = None) -> list[Future | bytes]:
        """Piece ``i``'s blocks' digests: the ``known`` ones, and futures of lists of the others'."""
        nbytes = self.items[i].nbytes
        count = _block_count(nbytes)
        if self.read is not None:
            def read(s: int, n: int, a: int, _i: int = i) -> None:
                self.read(name, _i, s, n, a)

            runs = min(count, self._threads)  # a buffer of a block each
            bounds = [count * r // runs for r in range(runs + 1)]
            return [self._hashing.submit(_read_blocks, read, nbytes, lo, hi) for lo, hi in zip(bounds, bounds[1:])]
        src = self.sources[i]
        if not src.is_cpu or not src.is_contiguous():  # one copy to host, then its blocks in turn
            return [self._hashing.submit(lambda: _hash_blocks(_host_bytes(src), 0, count))]
        view = _host_bytes(src)  # a view, no copy
        known = known or [None] * count
        return [d if d is not None else self._hashing.submit(_hash_blocks, view, b, b + 1) for b, d in enumerate(known)]

    def close(self) -> None:
        """Stop hashing (what was not started is dropped)."""
        self._hashing.shutdown(wait=True, cancel_futures=True)

    def decide(self, name: str, ids: Sequence[int]) -> tuple[list[int], list[int]]:
        """The items of planned file ``name`` to write, and their byte offsets in it laid out again."""
        items = self.items
        for i in ids:
            parts = self._blocks.pop(i, None) or self._submit(name, i)
            blocks = [b for p in parts for b in ((p,) if isinstance(p, bytes) else p.result())]
            d = self.digests[i] = _combine(items[i].nbytes, blocks)
            if i in self._tracked:  # every block as of this save's scan (the known ones: unwritten since)
                _remember(self._tracked.pop(i), self._tracking, self._epoch, blocks)
            if self.base is None:
                continue
            it = items[i]
            c = self.base.chunk(it.key, tuple(it.offsets), tuple(it.sizes))
            if c is None or c.nbytes != it.nbytes:
                continue
            ref = refs.reference_to(self.storage.path, self.base.storage.path, c.file)
            if refs.owner_of(ref) in self.owners and \
                    self.base.digest(refs.resolve(self.base.storage.path, c.file), c.byte_offset, self.rank) == d:
                self.reused[i] = (c, ref)
        todo = [i for i in ids if i not in self.reused]
        offs, pos = [], 0
        for i in todo:
            pos = -(-pos // ALIGN) * ALIGN
            offs.append(pos)
            pos += items[i].nbytes
        return todo, offs

    def finish(self) -> tuple[StorageRecord, list[int]]:
        """The reused pieces' rows (the base chunks' files, ranges and checksums) and their items,
        in the record's order; each pin narrowed to what is referenced."""
        used: dict[str, set[str]] = {}
        for _, ref in self.reused.values():
            used.setdefault(refs.owner_of(ref), set()).add(ref)
        for owner_rel, owner in self.owners.items():
            if owner_rel not in used:
                self._unpin(owner)
            elif used[owner_rel] != self.pinned[owner_rel]:
                refs.write_pin(owner, posixpath.relpath(self.storage.path, owner.path), self.save_id, self.rank,
                               [f[len(owner_rel) + 1:] for f in used[owner_rel]])
        items = self.items
        rows = [(items[i].key, tuple(items[i].offsets), tuple(items[i].sizes), ref, c.byte_offset, c.nbytes, c.crc,
                 c.blocks) for i, (c, ref) in self.reused.items()]
        record = StorageRecord.from_rows(rows, [c.codec for c, _ in self.reused.values()] if rows else None,
                                         [c.stored for c, _ in self.reused.values()] if rows else None)
        return record, list(self.reused)


def digest_record(writer: str, save_id: str, record: StorageRecord, digests: Sequence[bytes]) -> bytes:
    """The digest file's bytes for the rows of ``record`` (in order), ``digests[row]`` each."""
    return _encode_digests(writer, save_id, record.files, np.stack([record.file, record.byte_offsets], 1)
                           if len(record) else np.zeros((0, 2), np.int64), b"".join(digests))
