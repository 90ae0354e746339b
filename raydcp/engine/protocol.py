"""The save protocol, published once: three named steps and the records they pass.

Every save of raydcp -- the synchronous save, both asynchronous persisters (the helper
process and the Ray persister actor) and the rounds of a multi-round save -- runs these
steps, in this order, over a :class:`~raydcp.transport.Transport`:

1. **plan** -- every rank calls :func:`plan_round` with its local plan (metadata only);
   the coordinator runs :func:`reduce_plan` (``plan_save``: validation, replicas written
   once, bytes balanced) and hands each rank its :class:`~raydcp.planner.RankWritePlan`,
   and rank 0 the :class:`SaveHeader` of the checkpoint. Where the backend's room is per
   place (``raymem://``), the coordinator then reserves the room for every rank's files
   (:mod:`raydcp.storage.capacity`): a save that does not fit fails here, on every rank.
2. **write** -- each rank writes its files (``raydcp.engine.save.write_rank_files``, in
   one or several batches of whole files) and keeps one columnar :class:`StorageRecord`
   per batch: file, byte range and checksums of every piece it wrote.
3. **commit** -- every rank calls :func:`commit_round` with its records (rank 0 also with
   the header); the coordinator runs :func:`reduce_commit`: the metadata is built from the
   records (:func:`tensor_metas`), written last and atomically, and the files of earlier
   saves to the path are removed. Every rank gets the Metadata.

A rank that fails at any step still takes part, sending a
:class:`~raydcp.errors.RankFailure`: every rank then raises one CheckpointError and
nothing is committed. Multi-round saves (:mod:`raydcp.engine.rounds`) run steps 1 and 2
once per round and gather the records instead of committing; their driver commits all
rounds at once.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from functools import partial
from itertools import chain
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ..errors import CheckpointError, RankFailure, StorageError
from ..metadata import ChunkColumns, Metadata, TensorMetas
from ..metadata_format import decode_metadata, encode_metadata
from ..planner import LocalSavePlan, PackedNames, RankWritePlan, SavePlanOptions, TensorSpec, plan_save
from ..planner.arrays import sorted_runs
from ..planner.types import digest
from ..storage import CheckpointStorage
from ..storage import capacity
from ..storage import is_transient
from ..storage.commits import LOG_DIR, begin_save, commit_generation, current_generation, prune, remove_save_files
from ..transport import Transport

__all__ = ["SaveHeader", "StorageRecord", "reduce_plan", "reduce_commit", "commit_metadata", "tensor_metas",
           "plan_round", "commit_round", "commit_checkpoint", "name_storage_error", "PLAN_STEP", "COMMIT_STEP"]

PLAN_STEP = "save: plan"
COMMIT_STEP = "save: commit"


@dataclass(frozen=True)
class SaveHeader:
    """What the commit needs beyond the ranks' records: the checkpoint's id, size and contents."""

    save_id: str
    world_size: int
    tensors: Mapping[str, TensorSpec]
    values: Mapping[str, Any]


class StorageRecord:
    """Where one rank wrote its pieces: one row per piece, held as arrays (no object per piece).

    Row ``i``: the box ``offsets[i, :ndim[i]]``, ``sizes[i, :ndim[i]]`` of tensor ``keys[key[i]]``
    (boxes padded to the record's width with offset 0 and size 1) is bytes
    ``[byte_offsets[i], byte_offsets[i] + nbytes[i])`` of file ``files[file[i]]``, with CRC32C
    ``crcs[i]`` and, for a piece over one checksum block, the blocks' CRCs
    ``block_values[block_bounds[i]:block_bounds[i + 1]]``. ``keys_digest`` identifies the list
    ``keys`` (equal lists, equal digests): the commit maps each distinct list to the checkpoint's
    tensors once, and ``keys`` travels packed (:class:`~raydcp.planner.PackedNames`), so the
    coordinator makes no string per key of a list it has already seen.

    Where a piece was compressed, ``codec[i]`` (uint8: 0 raw, else the 1-based position in
    :data:`raydcp.metadata.COMPRESSIONS`) and ``stored[i]`` (int64: the bytes in the file, which
    ``crcs[i]`` covers; ``byte_offsets[i] + stored[i]`` ends the piece) are given for every row;
    both are None where every piece is raw, so a raw record carries no extra column.
    """

    __slots__ = ("keys", "keys_digest", "key", "ndim", "offsets", "sizes", "files", "file", "byte_offsets",
                 "nbytes", "crcs", "block_values", "block_bounds", "codec", "stored")

    def __init__(self, keys: Sequence[str] = (), key=None, ndim=None, offsets=None, sizes=None,
                 files: Sequence[str] = (), file=None, byte_offsets=None, nbytes=None, crcs=None,
                 block_values=None, block_bounds=None, codec=None, stored=None, keys_digest: bytes | None = None):
        n = 0 if key is None else len(key)

        def col(a, dtype=np.int64):
            return np.zeros(n, dtype) if a is None else np.asarray(a, dtype)

        self.keys = keys if isinstance(keys, PackedNames) else tuple(keys)
        self.keys_digest = keys_digest if keys_digest is not None else digest(tuple(self.keys))
        self.key, self.ndim, self.file = col(key), col(ndim), col(file)
        self.offsets = np.zeros((n, 1), np.int64) if offsets is None else np.asarray(offsets, np.int64)
        self.sizes = np.ones(self.offsets.shape, np.int64) if sizes is None else np.asarray(sizes, np.int64)
        self.files = tuple(files)
        self.byte_offsets, self.nbytes, self.crcs = col(byte_offsets), col(nbytes), col(crcs)
        self.block_values = np.zeros(0, np.uint32) if block_values is None else np.asarray(block_values, np.uint32)
        self.block_bounds = np.zeros(n + 1, np.int64) if block_bounds is None else np.asarray(block_bounds, np.int64)
        if (codec is None) != (stored is None):
            raise ValueError("a storage record's codec and stored columns come together")
        self.codec = self.stored = None
        if codec is not None:
            codec = np.asarray(codec, np.uint8)
            if codec.any():  # else every piece is raw: no columns
                self.codec, self.stored = codec, np.asarray(stored, np.int64)
        if (any(len(c) != n for c in (self.ndim, self.file, self.byte_offsets, self.nbytes, self.crcs))
                or self.offsets.ndim != 2 or len(self.offsets) != n or self.sizes.shape != self.offsets.shape
                or len(self.block_bounds) != n + 1
                or (self.codec is not None and (len(self.codec) != n or len(self.stored) != n))):
            raise ValueError("the columns of a storage record differ in length")

    def __len__(self) -> int:
        return len(self.key)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @property
    def width(self) -> int:
        return self.offsets.shape[1]

    @property
    def stored_lengths(self) -> np.ndarray:
        """The bytes each piece takes in its file: ``stored`` where pieces were compressed, else ``nbytes``."""
        return self.nbytes if self.stored is None else self.stored

    def rows(self) -> Iterator[tuple]:
        """``(key, offsets, sizes, file, byte offset, nbytes, crc, blocks)`` per piece (journals, tools)."""
        keys, files = self.keys, self.files
        bv, bb = self.block_values.tolist(), self.block_bounds.tolist()
        for i, (k, nd, o, s, f, b, n, c) in enumerate(zip(
                self.key.tolist(), self.ndim.tolist(), self.offsets.tolist(), self.sizes.tolist(),
                self.file.tolist(), self.byte_offsets.tolist(), self.nbytes.tolist(), self.crcs.tolist())):
            yield keys[k], tuple(o[:nd]), tuple(s[:nd]), files[f], b, n, c, tuple(bv[bb[i]:bb[i + 1]])

    @classmethod
    def from_rows(cls, rows: Sequence[tuple], codec: Sequence[int] | None = None,
                  stored: Sequence[int] | None = None) -> "StorageRecord":
        """A record from ``(key, offsets, sizes, file, byte offset, nbytes, crc, blocks)`` tuples and,
        where pieces were compressed, each row's codec id and stored length."""
        n = len(rows)
        if not n:
            if codec or stored:
                raise ValueError("the columns of a storage record differ in length")
            return cls()
        cols = list(zip(*rows))
        keys = {k: i for i, k in enumerate(dict.fromkeys(cols[0]))}
        files = {f: i for i, f in enumerate(dict.fromkeys(cols[3]))}
        ndim = np.fromiter(map(len, cols[1]), np.int64, n)
        if (np.fromiter(map(len, cols[2]), np.int64, n) != ndim).any():
            raise ValueError("a piece's offsets and sizes differ in length")
        width = max(1, int(ndim.max()))
        offsets, sizes = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
        for i, (o, s) in enumerate(zip(cols[1], cols[2])):
            offsets[i, :len(o)], sizes[i, :len(s)] = o, s
        blen = np.fromiter(map(len, cols[7]), np.int64, n)
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(blen, out=bounds[1:])
        return cls(tuple(keys), [keys[k] for k in cols[0]], ndim, offsets, sizes, tuple(files),
                   [files[f] for f in cols[3]], cols[4], cols[5], cols[6],
                   np.fromiter(chain.from_iterable(cols[7]), np.uint32, int(bounds[-1])), bounds, codec, stored)

    @classmethod
    def written(cls, plan: LocalSavePlan, layouts: Sequence[tuple[str, Sequence[int], Sequence[int]]],
                crcs: Sequence[int], blocks: Sequence[tuple[int, ...]], codec: Sequence[int] | None = None,
                stored: Sequence[int] | None = None) -> "StorageRecord":
        """What a rank wrote (step 2): ``layouts`` lists ``(file name, item indices, byte offsets)``
        per file, ``crcs[i]`` and ``blocks[i]`` are item i's checksum and block checksums and, where
        pieces were compressed, ``codec[i]`` and ``stored[i]`` its codec id and stored length. Rows in
        file order, taken from the plan's columns (:class:`~raydcp.planner.ItemColumns`); from its
        items where the columns cannot stand for them."""
        if codec is not None and not any(codec):
            codec = stored = None  # every piece raw
        cols = getattr(plan, "columns", None)
        if cols is not None and len(cols.key) == len(plan.items) and (not len(cols.key) or int(cols.ndim.min()) >= 0):
            return cls._of_columns(cols, layouts, crcs, blocks, codec, stored)
        items = plan.items
        ids = [i for _, file_ids, _ in layouts for i in file_ids]
        return cls.from_rows([(items[i].key, items[i].offsets, items[i].sizes, name, off, items[i].nbytes, crcs[i],
                               blocks[i]) for name, file_ids, offs in layouts for i, off in zip(file_ids, offs)],
                             None if codec is None else [codec[i] for i in ids],
                             None if stored is None else [stored[i] for i in ids])

    @classmethod
    def _of_columns(cls, columns, layouts, crcs, blocks, codec=None, stored=None) -> "StorageRecord":
        counts = [len(ids) for _, ids, _ in layouts]
        n = sum(counts)
        ids = np.fromiter(chain.from_iterable(ids for _, ids, _ in layouts), np.int64, n)
        idl = ids.tolist()
        if codec is not None:
            codec, stored = np.asarray(codec, np.uint8)[ids], np.asarray(stored, np.int64)[ids]
        blen = np.fromiter((len(blocks[i]) for i in idl), np.int64, n)
        bounds = np.zeros(n + 1, np.int64)
        np.cumsum(blen, out=bounds[1:])
        return cls(PackedNames.of(columns.keys), columns.key[ids], columns.ndim[ids], np.take(columns.offsets, ids, 0),
                   np.take(columns.sizes, ids, 0), [name for name, _, _ in layouts],
                   np.repeat(np.arange(len(layouts)), counts),
                   np.fromiter(chain.from_iterable(offs for _, _, offs in layouts), np.int64, n), columns.nbytes[ids],
                   np.fromiter((crcs[i] for i in idl), np.int64, n),
                   np.fromiter(chain.from_iterable(blocks[i] for i in idl), np.uint32, int(bounds[-1])), bounds,
                   codec, stored, keys_digest=columns.keys_digest)

    @classmethod
    def concat(cls, records: Sequence["StorageRecord"]) -> "StorageRecord":
        """One record holding the rows of ``records`` in order (batches of a rank, rounds of a save)."""
        records = [r for r in records if len(r)]
        if len(records) == 1:
            return records[0]
        if not records:
            return cls()
        keys: dict[str, int] = {}
        key_maps: dict[bytes, np.ndarray] = {}
        files: dict[str, int] = {}
        for r in records:
            if r.keys_digest not in key_maps:
                key_maps[r.keys_digest] = np.array([keys.setdefault(k, len(keys)) for k in r.keys] or [0], np.int64)
        width = max(r.width for r in records)
        parts = [_pad(r.offsets, width, 0) for r in records], [_pad(r.sizes, width, 1) for r in records]
        fmaps = [np.array([files.setdefault(f, len(files)) for f in r.files] or [0], np.int64) for r in records]
        bounds = np.zeros(sum(map(len, records)) + 1, np.int64)
        np.cumsum(np.concatenate([np.diff(r.block_bounds) for r in records]), out=bounds[1:])
        codec = stored = None
        if any(r.codec is not None for r in records):  # raw records' rows: codec 0, stored length nbytes
            codec = np.concatenate([np.zeros(len(r), np.uint8) if r.codec is None else r.codec for r in records])
            stored = np.concatenate([r.stored_lengths for r in records])
        same_keys = len(key_maps) == 1
        return cls(records[0].keys if same_keys else tuple(keys),
                   np.concatenate([key_maps[r.keys_digest][r.key] for r in records]),
                   np.concatenate([r.ndim for r in records]), np.concatenate(parts[0]), np.concatenate(parts[1]),
                   tuple(files), np.concatenate([m[r.file] for m, r in zip(fmaps, records)]),
                   *(np.concatenate([getattr(r, c) for r in records]) for c in ("byte_offsets", "nbytes", "crcs")),
                   np.concatenate([r.block_values[r.block_bounds[0]:r.block_bounds[-1]] for r in records]), bounds,
                   codec, stored, keys_digest=records[0].keys_digest if same_keys else None)

    def __eq__(self, other) -> bool:
        if not isinstance(other, StorageRecord):
            return NotImplemented
        return (len(self) == len(other) and list(self.rows()) == list(other.rows())
                and (self.codec is None) == (other.codec is None)
                and (self.codec is None or (np.array_equal(self.codec, other.codec)
                                            and np.array_equal(self.stored, other.stored))))

    __hash__ = None

    def __repr__(self) -> str:
        return f"StorageRecord({len(self)} pieces in {len(self.files)} files, {self.total_bytes} bytes)"

    def __reduce__(self):
        keys = PackedNames.of(self.keys)
        return (_storage_record, (keys, self.key, self.ndim, self.offsets, self.sizes, self.files, self.file,
                                  self.byte_offsets, self.nbytes, self.crcs, self.block_values, self.block_bounds,
                                  self.codec, self.stored, self.keys_digest))


def _storage_record(*args) -> StorageRecord:
    return StorageRecord(*args[:-1], keys_digest=args[-1])


def _pad(boxes: np.ndarray, width: int, fill: int) -> np.ndarray:
    if boxes.shape[1] == width:
        return boxes
    out = np.full((len(boxes), width), fill, np.int64)
    out[:, :boxes.shape[1]] = boxes
    return out


# -- step 1: plan ------------------------------------------------------------------------------
def reduce_plan(options: SavePlanOptions, local_plans: Sequence[LocalSavePlan],
                destination: tuple[str, dict | None] | None = None) -> list:
    """On the coordinator: the global plan; per rank ``(RankWritePlan, SaveHeader on rank 0 else None)``.

    ``destination`` ``(checkpoint_id, storage_options)``: the save begins there (its id is taken
    on the path's current commit and recorded, :func:`~raydcp.storage.commits.begin_save`) unless
    ``options`` fix the save id; where the backend reserves room per place
    (:mod:`raydcp.storage.capacity`), the room for every rank's files is reserved last, so a save
    that does not fit fails every rank here, before any byte is staged or written.
    """
    storage = sites = None
    began = False
    if destination is not None:
        local_plans, sites = _same_destination(destination[0], local_plans)
        storage = CheckpointStorage(*destination)
        if options.save_id is None:
            options, began = replace(options, save_id=begin_save(storage)), True
    gp = plan_save(local_plans, options)
    if storage is not None and capacity.reserves_capacity(storage):
        _reserve(storage, gp.save_id, gp.ranks, local_plans, sites, began)
    header = SaveHeader(gp.save_id, gp.world_size, dict(gp.tensors), dict(gp.values))
    return [(gp.ranks[r], header if r == 0 else None) for r in range(gp.world_size)]


def _reserve(storage: CheckpointStorage, save_id: str, plans: Sequence[RankWritePlan],
             local_plans: Sequence[LocalSavePlan], sites: Sequence[Any], began: bool) -> None:
    """Reserve the bytes of every rank's files at the rank's writer site; on refusal the save's
    begin record goes too (nothing of the save remains) and the error fails every rank."""
    need: dict[Any, int] = {}
    for plan, lp, site in zip(plans, local_plans, sites):
        need[site] = need.get(site, 0) + planned_file_bytes(plan, lp.columns.nbytes)
    try:
        capacity.reserve_save(storage, save_id, need)
    except CheckpointError:
        if began:
            try:
                storage.remove_files([f"{LOG_DIR}/begun-{save_id}"])
            except CheckpointError:
                pass  # the next commit's prune removes it
        raise


def planned_file_bytes(plan: RankWritePlan, nbytes) -> int:
    """The bytes of the files ``plan`` writes (alignment gaps included); ``nbytes[i]`` is item i's size."""
    files = plan.files
    cols = [getattr(files, a, None) for a in ("items", "byte_offsets", "bounds")]
    if all(c is not None for c in cols):  # a columnar plan (FileTable): no slot objects
        items, offs, bounds = (np.asarray(c, np.int64) for c in cols)
        last = bounds[1:] - 1
        last = last[last >= bounds[:-1]]
        return int((offs[last] + np.asarray(nbytes, np.int64)[items[last]]).sum())
    return sum(slots[-1].byte_offset + int(nbytes[slots[-1].item]) for _, slots in files if slots)


def plan_round(transport: Transport, local: Any, options: SavePlanOptions = SavePlanOptions(),
               step: str = PLAN_STEP, checkpoint_id: str | None = None,
               storage_options: dict | None = None) -> tuple[RankWritePlan, SaveHeader | None]:
    """Step 1 on a rank: send ``local`` (a LocalSavePlan or RankFailure), get this rank's plan back.
    With ``checkpoint_id`` the save begins at that path (see :func:`reduce_plan`); every rank says
    where it saves and where its writes land (:func:`raydcp.storage.capacity.writer_site`)."""
    if checkpoint_id is None:
        return transport.reduce_scatter(step, local, partial(reduce_plan, options))
    destination = (str(checkpoint_id), storage_options)
    if not isinstance(local, RankFailure):  # every rank says where it saves: unrelated saves never mix
        try:
            storage = CheckpointStorage(*destination)
            local = (storage.url, local, capacity.writer_site(storage))
        except Exception as exc:  # fails every rank at the plan step, naming this one
            local = RankFailure.from_exception(transport.rank, exc)
    return transport.reduce_scatter(step, local, partial(reduce_plan, options, destination=destination))


def _same_destination(checkpoint_id: str, values: Sequence[tuple]) -> tuple[list, list]:
    """The ranks' local plans and writer sites, once every rank named the same checkpoint; else one
    error naming them."""
    paths = [v[0] for v in values]
    if len(set(paths)) > 1:
        detail = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths))
        raise CheckpointError(
            f"the ranks of one save name different checkpoints ({detail}): every rank of a collective save "
            "must pass the same checkpoint_id; two unrelated saves may be sharing one Group name; nothing "
            "was written")
    return [v[1] for v in values], [v[2] for v in values]


# -- step 3: commit ----------------------------------------------------------------------------
def reduce_commit(checkpoint_id: str, storage_options: dict | None, values: Sequence[tuple]) -> list:
    """On the coordinator: ``values[r] = (StorageRecord, SaveHeader or None)``; commits, returns the
    Metadata for every rank. Two steps: :func:`commit_metadata`, then :func:`commit_checkpoint`."""
    md = commit_metadata(values)
    commit_checkpoint(CheckpointStorage(checkpoint_id, storage_options), md)
    return [md] * len(values)


def commit_metadata(values: Sequence[tuple]) -> Metadata:
    """The Metadata a commit records, from ``values[r] = (StorageRecord, SaveHeader or None)``: rank 0's
    header and every rank's storage record (:func:`tensor_metas`, columns only)."""
    header: SaveHeader = values[0][1]
    return Metadata(
        save_id=header.save_id,
        world_size=header.world_size,
        created_at=time.time(),
        tensors=tensor_metas(header.tensors, [records for records, _ in values]),
        values=dict(header.values),
    )


def commit_checkpoint(storage: CheckpointStorage, md: Metadata, *, own_leftovers: bool = False) -> int:
    """Commit ``md`` at ``storage`` (compare-and-swap on its commit log), then remove what no
    commit reaches any more; returns the new generation. ConcurrentSaveError if another save
    committed since this one began (nothing committed). ``own_leftovers``: also remove the files
    of this save's own directory that ``md`` does not reference (journal, abandoned rounds)."""
    replaced = _replaced_save_id(storage)
    generation = commit_generation(storage, md.save_id, encode_metadata(md))
    prune(storage, generation, md.save_id, replaced)
    if own_leftovers:
        try:
            remove_save_files(storage, md.save_id.split("/", 1)[0], keep=md.files)
        except CheckpointError:
            pass  # garbage for a later commit, not a failed save
    return generation


def _replaced_save_id(storage: CheckpointStorage) -> str | None:
    """The save id of a checkpoint committed before the path had a commit log (else its saves'
    records name what to remove)."""
    if current_generation(storage) != 0 or not storage.is_committed():
        return None
    try:
        return decode_metadata(storage.read_metadata_bytes(), storage.url).save_id
    except CheckpointError:
        return None


def commit_round(transport: Transport, written: Any, checkpoint_id: str, storage_options: dict | None,
                 step: str = COMMIT_STEP) -> Metadata:
    """Step 3 on a rank: send ``(StorageRecord, header)`` (or a RankFailure); every rank gets the Metadata."""
    return transport.reduce_scatter(step, written, partial(reduce_commit, checkpoint_id, storage_options))


def tensor_metas(tensors: Mapping[str, TensorSpec], records: Sequence[StorageRecord]) -> TensorMetas:
    """Every tensor's metadata from the ranks' storage records: one set of chunk columns for all
    tensors (:class:`ChunkColumns`), grouped by tensor and each tensor's chunks sorted by offsets.

    Built from the records' arrays, written once into arrays allocated once: no object per chunk
    or per tensor, and one Python step per record (a rank's list of keys is mapped to the
    checkpoint's tensors once per distinct list, by its digest). A row of a tensor no rank
    planned, or whose box has another number of dimensions than its tensor, is a CheckpointError.
    """
    keys = list(tensors)
    specs = list(tensors.values())
    k = len(keys)
    ndim = np.fromiter((len(s.shape) for s in specs), np.int64, k)
    width = max(1, int(ndim.max()) if k else 1)
    records = [r for r in records if len(r)]
    n = sum(map(len, records))
    key, file, boff, nbytes, crc, blen, row_nd = (np.empty(n, np.int64) for _ in range(7))
    off, size = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
    files: dict[str, int] = {}
    bvals: list[np.ndarray] = []
    codec = stored = None  # only where some rank compressed a piece: raw rows codec 0, stored nbytes
    if any(r.codec is not None for r in records):
        codec, stored = np.zeros(n, np.uint8), np.empty(n, np.int64)
    maps: dict[bytes, np.ndarray] = {}
    kid: dict[str, int] | None = None
    a = 0
    for r in records:
        b = a + len(r)
        m = maps.get(r.keys_digest)
        if m is None:
            kid = kid if kid is not None else {name: i for i, name in enumerate(keys)}
            unknown = [name for name in r.keys if name not in kid]
            if unknown:
                raise CheckpointError(f"save: commit: a rank wrote pieces of {unknown[:5]}, which are not tensors of "
                                      "this save's plan; nothing was committed")
            m = maps[r.keys_digest] = np.array([kid[name] for name in r.keys] or [0], np.int64)
        np.take(m, r.key, out=key[a:b])
        w = min(r.width, width)  # past its tensor's dimensions (checked below) a box is padding
        off[a:b, :w], size[a:b, :w] = r.offsets[:, :w], r.sizes[:, :w]
        row_nd[a:b] = r.ndim
        if len(r.files) == 1:  # the usual record: one file
            file[a:b] = files.setdefault(r.files[0], len(files))
        else:
            fm = np.array([files.setdefault(name, len(files)) for name in r.files] or [0], np.int64)
            np.take(fm, r.file, out=file[a:b])
        boff[a:b], nbytes[a:b], crc[a:b] = r.byte_offsets, r.nbytes, r.crcs
        if codec is not None:
            stored[a:b] = r.stored_lengths
            if r.codec is not None:
                codec[a:b] = r.codec
        lo, hi = int(r.block_bounds[0]), int(r.block_bounds[-1])
        np.subtract(r.block_bounds[1:], r.block_bounds[:-1], out=blen[a:b])
        if hi > lo:
            bvals.append(r.block_values[lo:hi])
        a = b
    if n and not np.array_equal(np.take(ndim, key), row_nd):
        raise _wrong_dimensions(keys, ndim, key, row_nd)
    del row_nd
    # stable: by tensor, then offsets (where every rank wrote pieces of the same tensors, no sort)
    order, sorted_cols = sorted_runs([key, *(off[:, d] for d in range(width))], len(records))
    if n and not (order[1:] - order[:-1] == 1).all():  # not in order already (pieces of several ranks)
        start = np.zeros(n + 1, np.int64)
        np.cumsum(blen, out=start[1:])  # where each row's block checksums start, before sorting
        file, boff, nbytes, crc, blen = (np.take(x, order) for x in (file, boff, nbytes, crc, blen))
        key = sorted_cols[0]
        for d, c in enumerate(sorted_cols[1:]):
            off[:, d] = c
        size = np.take(size, order, axis=0)
        if codec is not None:
            codec, stored = np.take(codec, order), np.take(stored, order)
        if bvals:
            values = np.concatenate(bvals)
            bvals = [values[np.repeat(start[:-1][order] - (np.cumsum(blen) - blen), blen) + np.arange(len(values))]]
    bval = np.concatenate(bvals) if bvals else np.zeros(0, np.uint32)
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(blen, out=bounds[1:])
    rows = np.searchsorted(key, np.arange(k + 1))
    cols = ChunkColumns(rows, ndim, off, size, list(files), file, boff, nbytes, crc, bval, bounds, codec, stored)
    return TensorMetas(keys, [s.dtype for s in specs], [s.shape for s in specs], cols)


def _wrong_dimensions(keys: list[str], ndim: np.ndarray, key: np.ndarray, row_ndim: np.ndarray) -> CheckpointError:
    i = int(np.argmax(np.take(ndim, key) != row_ndim))
    return CheckpointError(f"save: commit: a rank wrote a piece of {keys[int(key[i])]!r} with {int(row_ndim[i])} "
                           f"dimensions, the tensor has {int(ndim[key[i]])}; nothing was committed")


def name_storage_error(exc: Exception, checkpoint_id: str) -> Exception:
    """A write's OSError as a CheckpointError naming the checkpoint and what to check."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return StorageError(f"writing {checkpoint_id}: {exc}; check the path, permissions and free space",
                            retriable=is_transient(exc), path=str(checkpoint_id))
    return exc
