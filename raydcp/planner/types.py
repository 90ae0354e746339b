"""Plans are data: frozen dataclasses of plain types, built by pure functions.

Save, for ``world_size`` ranks:
  1. each rank builds a :class:`LocalSavePlan` (what it holds; no tensor data);
  2. the coordinator calls ``plan_save(local_plans)`` -> a :class:`GlobalSavePlan`
     (validated, replicas written once, bytes balanced, small pieces coalesced
     into few files) and hands each rank its :class:`RankWritePlan`;
  3. each rank writes its slots and returns their checksums;
  4. the coordinator builds the metadata and commits it.

Load, for any N saved -> M loading:
  1. each rank builds a :class:`LocalLoadPlan` (the regions it wants);
  2. the coordinator calls ``plan_load(sources, local_plans)`` -> one
     :class:`RankLoadPlan` per rank: which source chunks it reads (each needed
     source byte read by exactly one rank) and where each part goes.

At scale (a million pieces) the coordinator works on arrays, not a Python object per piece (grid
splits, which need a box-by-box check, are the exception): local plans also carry their items as
arrays (:class:`ItemColumns`, built with the plan on its rank), and the plans it returns hold
arrays that read as the tuples above on first use (:class:`FileTable` for ``RankWritePlan.files``,
:class:`ReadTable` for ``RankLoadPlan.reads``).
"""
from __future__ import annotations

import hashlib
from operator import attrgetter
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ..lazy import LazySequence as _Lazy

__all__ = ["digest", 
    "TensorSpec", "WriteItem", "LocalSavePlan", "FileSlot", "RankWritePlan", "GlobalSavePlan",
    "ReadItem", "LocalLoadPlan", "SourceChunk", "Delivery", "ChunkRead", "RankLoadPlan",
    "ItemColumns", "FileTable", "ReadTable", "StoredChunks", "PackedNames", "packed_rows", "layout_digest",
]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WriteItem:
    """A piece a rank holds: the box [offsets, offsets+sizes) of tensor ``key``."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    checksum: int | None = None  # set where comparing replicas is cheap (host tensors)


@dataclass(frozen=True)
class LocalSavePlan:
    rank: int
    tensors: Mapping[str, TensorSpec]
    items: tuple[WriteItem, ...]
    values: Mapping[str, Any]

    def __post_init__(self) -> None:
        # the plan as columns, built where the plan is built (on its rank), so the coordinator
        # plans with array operations instead of a Python object per piece
        object.__setattr__(self, "columns", ItemColumns.of(self.tensors, self.items, with_bytes=True))


@dataclass(frozen=True, slots=True)
class FileSlot:
    """Where one rank writes one piece: ``item`` indexes the rank's LocalSavePlan.items."""

    item: int
    file: str
    byte_offset: int


@dataclass(frozen=True)
class RankWritePlan:
    rank: int
    save_id: str
    files: Sequence[tuple[str, tuple[FileSlot, ...]]]  # file name -> slots in file order (a tuple or FileTable)


@dataclass(frozen=True)
class GlobalSavePlan:
    save_id: str
    world_size: int
    tensors: Mapping[str, TensorSpec]
    values: Mapping[str, Any]
    ranks: tuple[RankWritePlan, ...]
    bytes_per_rank: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReadItem:
    """A region a rank wants: the box [offsets, offsets+sizes) of tensor ``key``."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class LocalLoadPlan:
    rank: int
    tensors: Mapping[str, TensorSpec]  # what the rank expects each key to be
    items: tuple[ReadItem, ...]
    values: tuple[str, ...]            # plain-value keys the rank wants
    strict: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "columns", ItemColumns.of(self.tensors, self.items, with_bytes=False))


@dataclass(frozen=True, slots=True)
class SourceChunk:
    """A piece of source data: a stored chunk (``holders`` None: any rank can read it from
    ``file``) or a live piece held in memory by each rank in ``holders``."""

    key: str
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None = None
    byte_offset: int = 0
    nbytes: int = 0
    checksum: int | None = None
    block_checksums: tuple[int, ...] = ()
    holders: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    """The part ``box`` of a source chunk that rank ``rank`` needs for its item ``item``."""

    rank: int
    item: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ChunkRead:
    source: SourceChunk
    deliveries: tuple[Delivery, ...]
    # the other parts of the chunk are read by other ranks: a checksum block this read covers only
    # in part is verified jointly with them (the readers' CRCs of their shares, combined)
    joint: bool = False


@dataclass(frozen=True)
class RankLoadPlan:
    rank: int
    reads: Sequence[ChunkRead]     # chunks this rank reads and delivers from (a tuple or ReadTable)
    incoming: int                  # deliveries from other ranks this rank will receive
    values: Mapping[str, Any]
    bytes_read: int
    bytes_needed: int


# ----------------------------------------------------------------------------- columnar forms

class ItemColumns:
    """The items of a local plan as arrays: item i is the box ``offsets[i, :ndim[i]]``,
    ``sizes[i, :ndim[i]]`` of key ``keys[key[i]]``; boxes are padded to ``width`` dimensions
    with offset 0 and size 1. ``nbytes`` and ``checksum`` (-1: none) for save plans.
    ``signature`` is a BLAKE2b digest of the sorted (key, dtype, shape) of the plan's tensors and
    ``keys_digest`` one of ``keys``: ranks that agree on every tensor have equal signatures, so the
    coordinator compares 16 bytes per rank instead of every tensor of every rank. ``layout`` is
    one of everything but the checksums (the signature, the keys and every box and byte count):
    ranks whose plans have the layouts of an earlier save have that save's global plan but for
    what the checksums and plain values decide (:class:`~raydcp.planner.PlanCache`)."""

    __slots__ = ("keys", "keys_digest", "key", "ndim", "offsets", "sizes", "nbytes", "checksum", "signature",
                 "layout")

    @classmethod
    def of(cls, tensors: Mapping[str, TensorSpec], items: Sequence, *, with_bytes: bool) -> "ItemColumns":
        c = cls()
        n = len(items)
        names = list(map(_KEY, items))
        index = {k: i for i, k in enumerate(dict.fromkeys(names))}
        c.key = np.arange(n, dtype=np.int64) if len(index) == n else \
            np.fromiter(map(index.__getitem__, names), np.int64, n)
        c.keys = tuple(index)
        c.keys_digest = digest(c.keys)
        offs, sizes = list(map(_OFFSETS, items)), list(map(_SIZES, items))
        c.ndim = np.fromiter(map(len, offs), np.int64, n)
        width = max(1, int(c.ndim.max()) if n else 1)
        try:
            if n and (c.ndim == width).all() and (np.fromiter(map(len, sizes), np.int64, n) == width).all():
                c.offsets = np.array(offs, np.int64).reshape(n, width)
                c.sizes = np.array(sizes, np.int64).reshape(n, width)
            else:
                c.offsets = np.zeros((n, width), np.int64)
                c.sizes = np.ones((n, width), np.int64)
                for i, (o, z) in enumerate(zip(offs, sizes)):
                    if len(z) != len(o):
                        raise ValueError("offsets and sizes differ in length")
                    c.offsets[i, :len(o)] = o
                    c.sizes[i, :len(z)] = z
        except (ValueError, TypeError, OverflowError):
            c.offsets = np.zeros((n, width), np.int64)
            c.sizes = np.ones((n, width), np.int64)
            c.ndim = np.full(n, -1, np.int64)  # not representable: the planners take the general path
        if with_bytes:
            c.nbytes = np.fromiter(map(_NBYTES, items), np.int64, n)
            c.checksum = np.fromiter((-1 if x is None else x for x in map(_CHECKSUM, items)), np.int64, n)
        else:
            c.nbytes = c.checksum = None
        try:
            names = sorted(tensors)
        except TypeError:
            names = sorted(tensors, key=str)
        specs = list(map(tensors.__getitem__, names))
        c.signature = digest((list(map(str, names)), [str(s.dtype) for s in specs],
                               [tuple(map(int, s.shape)) for s in specs]))
        c.layout = layout_digest(c)
        return c


def layout_digest(c: "ItemColumns") -> bytes:
    """The digest of an ItemColumns' layout (its ``layout``, see there): BLAKE2b of the
    signature, the keys' digest and the columns' bytes, each column's length and shape in it."""
    h = hashlib.blake2b(digest_size=16)
    h.update(c.signature)
    h.update(c.keys_digest)
    for a in (c.key, c.ndim, c.offsets, c.sizes, c.nbytes):
        if a is None:
            h.update(b"-")
            continue
        a = np.ascontiguousarray(a, np.int64)
        h.update(repr(a.shape).encode())
        h.update(a.data)
    return h.digest()


_KEY, _OFFSETS, _SIZES = attrgetter("key"), attrgetter("offsets"), attrgetter("sizes")
_NBYTES, _CHECKSUM = attrgetter("nbytes"), attrgetter("checksum")


def digest(obj) -> bytes:
    return hashlib.blake2b(repr(obj).encode(), digest_size=16).digest()


class PackedNames(_Lazy):
    """A tuple of names held as one UTF-8 blob, NUL-separated, until first use.

    What a rank's list of tensor keys travels as (:class:`raydcp.engine.save_records.StorageRecord`):
    a receiver that matches lists by digest, as the commit does, unpickles one bytes object
    per rank instead of a string per key, and splits the blob only for a list it has not seen.
    """

    __slots__ = ("blob", "count")

    def __init__(self, blob: bytes, count: int):
        self.blob, self.count = blob, count
        self._objs = None

    @classmethod
    def of(cls, names: Sequence[str]) -> "PackedNames | tuple":
        """``names`` packed, or as a tuple where a name is not a string or holds a NUL."""
        if isinstance(names, PackedNames):
            return names
        names = tuple(names)
        try:
            joined = "\0".join(names)
        except TypeError:
            return names
        if joined.count("\0") != max(len(names) - 1, 0):
            return names
        return cls(joined.encode("utf-8", "surrogatepass"), len(names))

    def __len__(self) -> int:
        return self.count

    def _build(self) -> tuple:
        return tuple(self.blob.decode("utf-8", "surrogatepass").split("\0")) if self.count else ()

    def __reduce__(self):
        return (PackedNames, (self.blob, self.count))


class FileTable(_Lazy):
    """A rank's write plan as arrays: file f holds the slots ``bounds[f]:bounds[f + 1]``, slot j
    writes the rank's item ``items[j]`` at ``byte_offsets[j]``; reads as ``((name, slots), ...)``."""

    __slots__ = ("names", "items", "byte_offsets", "bounds")

    def __init__(self, names: list[str], items: np.ndarray, byte_offsets: np.ndarray, bounds: list[int]):
        self.names, self.items, self.byte_offsets, self.bounds = names, items, byte_offsets, bounds
        self._objs = None

    def __len__(self) -> int:
        return len(self.names)

    def _build(self) -> tuple:
        items, offs, b = self.items.tolist(), self.byte_offsets.tolist(), self.bounds
        return tuple((name, tuple(FileSlot(i, name, o) for i, o in zip(items[b[f]:b[f + 1]], offs[b[f]:b[f + 1]])))
                     for f, name in enumerate(self.names))

    def __reduce__(self):
        return (FileTable, (self.names, self.items, self.byte_offsets, self.bounds))


class ReadTable(_Lazy):
    """A rank's reads as arrays; reads as a tuple of :class:`ChunkRead`.

    Read i is source chunk i (key ``keys[key[i]]``, box ``offsets[i]``/``sizes[i]`` cut to the key's
    ``ndims``, stored at ``files[file[i]]`` / ``byte_offset[i]``, ``checksum[i]`` (-1: none), block
    checksums ``block_values[block_bounds[i]:block_bounds[i + 1]]``) or, where ``sources`` is given,
    the SourceChunk ``sources[i]``; its deliveries are ``delivery_bounds[i]:delivery_bounds[i + 1]``
    of ``d_rank``, ``d_item``, ``d_offsets``, ``d_sizes`` (these two None where every delivery is
    its whole chunk); ``joint`` (None: all False) marks reads verified jointly (:class:`ChunkRead`)."""

    __slots__ = ("keys", "dtypes", "ndims", "files", "key", "offsets", "sizes", "file", "byte_offset", "nbytes",
                 "checksum", "block_values", "block_bounds", "sources", "delivery_bounds", "d_rank", "d_item",
                 "d_offsets", "d_sizes", "joint", "packed")

    def __init__(self, **fields):
        for name in self.__slots__:
            setattr(self, name, fields.get(name))
        self._objs = None

    @classmethod
    def of_rows(cls, reads: np.ndarray, deliveries: np.ndarray, blocks: np.ndarray | None, joint, keys, dtypes,
                ndims, files) -> "ReadTable":
        """A table over two int64 matrices, one row per read and one per delivery (the layout
        :func:`packed_rows` names), with the block checksums of its reads (None: none): what one
        rank's plan is cut from the matrices of all ranks' reads, and travels as (three arrays,
        where a table of separate columns would travel as a dozen). The columns are views of the
        matrices, made on first use."""
        t = object.__new__(cls)
        t.keys, t.dtypes, t.ndims, t.files, t.joint, t.sources, t._objs = keys, dtypes, ndims, files, joint, None, None
        t.packed = (reads, deliveries, blocks)
        return t

    def __getattr__(self, name: str):
        # a column of a table made by of_rows, not yet viewed: view them all (__slots__ names only)
        packed = object.__getattribute__(self, "packed") if name in _COLUMNS else None
        if packed is None:
            raise AttributeError(name)
        reads, deliveries, blocks = packed
        width = (reads.shape[1] - _R_FIXED) // 2
        n, m = len(reads), len(deliveries)
        db = np.empty(n + 1, np.int64)
        db[:n], db[n] = reads[:, _R_DSTART], m
        bb = np.empty(n + 1, np.int64)
        bb[:n], bb[n] = reads[:, _R_BSTART], 0 if blocks is None else len(blocks)
        boxes = deliveries.shape[1] > _D_FIXED
        self.key, self.file, self.byte_offset = reads[:, 0], reads[:, 1], reads[:, 2]
        self.nbytes, self.checksum = reads[:, 3], reads[:, 4]
        self.offsets, self.sizes = reads[:, _R_FIXED:_R_FIXED + width], reads[:, _R_FIXED + width:]
        self.delivery_bounds, self.block_bounds = db, bb
        self.block_values = np.zeros(0, np.uint32) if blocks is None else blocks
        self.d_rank, self.d_item = deliveries[:, 0], deliveries[:, 1]
        self.d_offsets = deliveries[:, _D_FIXED:_D_FIXED + width] if boxes else None
        self.d_sizes = deliveries[:, _D_FIXED + width:] if boxes else None
        return object.__getattribute__(self, name)

    def __len__(self) -> int:
        return len(self.packed[0]) if self.packed is not None else len(self.key)

    def _build(self) -> tuple:
        nds = [int(x) for x in self.ndims]
        key = self.key.tolist()
        db = self.delivery_bounds.tolist()
        d_rank, d_item = self.d_rank.tolist(), self.d_item.tolist()
        whole = self.d_offsets is None
        d_off, d_size = (None, None) if whole else (self.d_offsets.tolist(), self.d_sizes.tolist())
        if self.sources is not None:
            srcs = self.sources
        else:
            off, size = self.offsets.tolist(), self.sizes.tolist()
            bv, bb = self.block_values.tolist(), self.block_bounds.tolist()
            file, boff = self.file.tolist(), self.byte_offset.tolist()
            nb, crc = self.nbytes.tolist(), self.checksum.tolist()
            srcs = []
            for i, k in enumerate(key):
                nd = nds[k]
                srcs.append(SourceChunk(self.keys[k], self.dtypes[k], tuple(off[i][:nd]), tuple(size[i][:nd]),
                                        self.files[file[i]], boff[i], nb[i], None if crc[i] < 0 else crc[i],
                                        tuple(bv[bb[i]:bb[i + 1]])))
        joint = [False] * len(key) if self.joint is None else [bool(x) for x in self.joint]
        out = []
        for i, k in enumerate(key):
            nd = nds[k]
            if whole:
                out.append(ChunkRead(srcs[i], tuple(Delivery(d_rank[j], d_item[j], srcs[i].offsets, srcs[i].sizes)
                                                    for j in range(db[i], db[i + 1])), joint[i]))
                continue
            out.append(ChunkRead(srcs[i], tuple(
                Delivery(d_rank[j], d_item[j], tuple(d_off[j][:nd]), tuple(d_size[j][:nd]))
                for j in range(db[i], db[i + 1])), joint[i]))
        return tuple(out)

    def __reduce__(self):
        if self.packed is not None:
            return (ReadTable.of_rows, (*self.packed, self.joint, self.keys, self.dtypes, self.ndims, self.files))
        return (_read_table, ({name: getattr(self, name) for name in self.__slots__},))


# the columns of ReadTable.of_rows's matrices: per read key, file, byte offset, nbytes, checksum, its
# first delivery and first block checksum (counted from the table's own), then offsets and sizes;
# per delivery rank, item, then (where deliveries are not their whole chunks) offsets and sizes
_R_FIXED, _R_DSTART, _R_BSTART, _D_FIXED = 7, 5, 6, 2
_COLUMNS = frozenset(("key", "offsets", "sizes", "file", "byte_offset", "nbytes", "checksum", "block_values",
                      "block_bounds", "delivery_bounds", "d_rank", "d_item", "d_offsets", "d_sizes"))


def packed_rows(width: int, boxes: bool) -> tuple[int, int]:
    """The column counts of :meth:`ReadTable.of_rows`'s matrices for boxes of ``width`` dimensions
    (``boxes``: deliveries carry boxes of their own)."""
    return _R_FIXED + 2 * width, _D_FIXED + (2 * width if boxes else 0)


def _read_table(fields: dict) -> ReadTable:
    return ReadTable(**fields)


class StoredChunks(_Lazy):
    """The stored chunks of one tensor as a sequence of :class:`SourceChunk`, over the columns of
    its metadata (a :class:`raydcp.metadata.ChunkTable`); the load planner reads the columns."""

    __slots__ = ("key", "dtype", "table")

    def __init__(self, key: str, dtype: str, table):
        self.key, self.dtype, self.table = key, dtype, table
        self._objs = None

    def __len__(self) -> int:
        return len(self.table)

    def _source(self, c) -> SourceChunk:
        return SourceChunk(self.key, self.dtype, c.offsets, c.sizes, c.file, c.byte_offset, c.nbytes, c.checksum,
                           c.block_checksums)

    def __getitem__(self, i):
        if isinstance(i, slice) or self._objs is not None:
            return self._all()[i]
        return self._source(self.table[i])

    def _build(self) -> tuple:
        return tuple(self._source(c) for c in self.table)
