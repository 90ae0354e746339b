"""The save protocol, published once: three named steps and the records they pass.

Every save of raydcp -- the synchronous save, both asynchronous persisters (the helper
process and the Ray persister actor) and the rounds of a multi-round save -- runs these
steps, in this order, over a :class:`~raydcp.transport.Transport`:

1. **plan** -- every rank calls :func:`plan_round` with its local plan (metadata only);
   the coordinator runs :func:`reduce_plan` (``plan_save``: validation, replicas written
   once, bytes balanced) and hands each rank its :class:`~raydcp.planner.RankWritePlan`,
   and rank 0 the :class:`SaveHeader` of the checkpoint.
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
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from ..errors import CheckpointError, RankFailure, StorageError
from ..metadata import ChunkColumns, Metadata, TensorMetas
from ..metadata_format import decode_metadata, encode_metadata
from ..planner import LocalSavePlan, RankWritePlan, SavePlanOptions, TensorSpec, plan_save
from ..storage import CheckpointStorage
from ..storage._common import is_transient
from ..storage.commits import begin_save, commit_generation, current_generation, prune, remove_save_files
from ..transport import Transport

__all__ = ["SaveHeader", "StorageRecord", "reduce_plan", "reduce_commit", "tensor_metas", "plan_round",
           "commit_round", "commit_checkpoint", "name_storage_error", "PLAN_STEP", "COMMIT_STEP"]

PLAN_STEP = "save: plan"
COMMIT_STEP = "save: commit"


@dataclass(frozen=True)
class SaveHeader:
    """What the commit needs beyond the ranks' records: the checkpoint's id, size and contents."""

    save_id: str
    world_size: int
    tensors: Mapping[str, TensorSpec]
    values: Mapping[str, Any]


@dataclass(frozen=True)
class StorageRecord:
    """Where one rank wrote its pieces: one row per piece, held as columns (no object per piece).

    Row ``i``: piece ``offsets[i]`` (size ``sizes[i]``) of tensor ``keys[i]`` is bytes
    ``[byte_offsets[i], byte_offsets[i] + nbytes[i])`` of file ``files[i]``, with CRC32C
    ``crcs[i]`` and, for pieces over one checksum block, the blocks' CRCs ``blocks[i]``.
    Where pieces were compressed, ``codecs[i]`` (0: raw, else the 1-based position in
    :data:`raydcp.metadata.COMPRESSIONS`) and ``stored[i]`` (the bytes in the file, which
    ``crcs[i]`` covers) are given for every row; both empty where every piece is raw.
    """

    keys: Sequence[str] = ()
    offsets: Sequence[tuple[int, ...]] = ()
    sizes: Sequence[tuple[int, ...]] = ()
    files: Sequence[str] = ()
    byte_offsets: Sequence[int] = ()
    nbytes: Sequence[int] = ()
    crcs: Sequence[int] = ()
    blocks: Sequence[tuple[int, ...]] = ()
    codecs: Sequence[int] = ()
    stored: Sequence[int] = ()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def total_bytes(self) -> int:
        return int(sum(self.nbytes))

    def rows(self) -> Iterator[tuple]:
        """``(key, offsets, sizes, file, byte offset, nbytes, crc, blocks)`` per piece (journals, tools)."""
        return zip(self.keys, self.offsets, self.sizes, self.files, self.byte_offsets, self.nbytes, self.crcs,
                   self.blocks)

    @classmethod
    def from_rows(cls, rows: Sequence[tuple]) -> "StorageRecord":
        if not rows:
            return cls()
        return cls(*(list(c) for c in zip(*rows)))

    @classmethod
    def concat(cls, records: Sequence["StorageRecord"]) -> "StorageRecord":
        """One record holding the rows of ``records`` in order (batches of a rank, rounds of a save)."""
        records = [r for r in records if len(r)]
        if len(records) == 1:
            return records[0]
        packed: tuple = ()
        if any(r.codecs for r in records):  # raw records' rows: codec 0, stored length nbytes
            packed = ([v for r in records for v in (r.codecs or [0] * len(r))],
                      [v for r in records for v in (r.stored or r.nbytes)])
        return cls(*([v for r in records for v in getattr(r, f)] for f in _FIELDS), *packed)


_FIELDS = ("keys", "offsets", "sizes", "files", "byte_offsets", "nbytes", "crcs", "blocks")


# -- step 1: plan ------------------------------------------------------------------------------
def reduce_plan(options: SavePlanOptions, local_plans: Sequence[LocalSavePlan],
                destination: tuple[str, dict | None] | None = None) -> list:
    """On the coordinator: the global plan; per rank ``(RankWritePlan, SaveHeader on rank 0 else None)``.

    ``destination`` ``(checkpoint_id, storage_options)``: the save begins there (its id is taken
    on the path's current commit and recorded, :func:`~raydcp.storage.commits.begin_save`) unless
    ``options`` fix the save id.
    """
    if destination is not None:
        local_plans = _same_destination(destination[0], local_plans)
        if options.save_id is None:
            options = replace(options, save_id=begin_save(CheckpointStorage(*destination)))
    gp = plan_save(local_plans, options)
    header = SaveHeader(gp.save_id, gp.world_size, dict(gp.tensors), dict(gp.values))
    return [(gp.ranks[r], header if r == 0 else None) for r in range(gp.world_size)]


def plan_round(transport: Transport, local: Any, options: SavePlanOptions = SavePlanOptions(),
               step: str = PLAN_STEP, checkpoint_id: str | None = None,
               storage_options: dict | None = None) -> tuple[RankWritePlan, SaveHeader | None]:
    """Step 1 on a rank: send ``local`` (a LocalSavePlan or RankFailure), get this rank's plan back.
    With ``checkpoint_id`` the save begins at that path (see :func:`reduce_plan`)."""
    if checkpoint_id is None:
        return transport.reduce_scatter(step, local, partial(reduce_plan, options))
    destination = (str(checkpoint_id), storage_options)
    if not isinstance(local, RankFailure):  # every rank says where it saves: unrelated saves never mix
        local = (CheckpointStorage(*destination).url, local)
    return transport.reduce_scatter(step, local, partial(reduce_plan, options, destination=destination))


def _same_destination(checkpoint_id: str, values: Sequence[tuple]) -> list:
    """The ranks' local plans, once every rank named the same checkpoint; else one error naming them."""
    paths = [v[0] for v in values]
    if len(set(paths)) > 1:
        detail = ", ".join(f"rank {r}: {p!r}" for r, p in enumerate(paths))
        raise CheckpointError(
            f"the ranks of one save name different checkpoints ({detail}): every rank of a collective save "
            "must pass the same checkpoint_id; two unrelated saves may be sharing one Group name; nothing "
            "was written")
    return [v[1] for v in values]


# -- step 3: commit ----------------------------------------------------------------------------
def reduce_commit(checkpoint_id: str, storage_options: dict | None, values: Sequence[tuple]) -> list:
    """On the coordinator: ``values[r] = (StorageRecord, SaveHeader or None)``; commits, returns the
    Metadata for every rank."""
    header: SaveHeader = values[0][1]
    md = Metadata(
        save_id=header.save_id,
        world_size=header.world_size,
        created_at=time.time(),
        tensors=tensor_metas(header.tensors, [records for records, _ in values]),
        values=dict(header.values),
    )
    commit_checkpoint(CheckpointStorage(checkpoint_id, storage_options), md)
    return [md] * len(values)


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
    tensors (:class:`ChunkColumns`), grouped by tensor and each tensor's chunks sorted by offsets;
    no object per chunk or per tensor."""
    keys = list(tensors)
    specs = list(tensors.values())
    n = sum(len(r) for r in records)
    width = max(1, *(len(s.shape) for s in specs)) if specs else 1
    ndim = np.fromiter((len(s.shape) for s in specs), np.int64, len(specs))
    if n == 0:
        empty = np.zeros(0, np.int64)
        cols = ChunkColumns(np.zeros(len(keys) + 1, np.int64), ndim, np.zeros((0, width), np.int64),
                            np.ones((0, width), np.int64), [], empty, empty, empty, empty, np.zeros(0, np.uint32),
                            np.zeros(1, np.int64))
        return TensorMetas(keys, [s.dtype for s in specs], [s.shape for s in specs], cols)
    rec = StorageRecord.concat(records)
    rkey, roff, rsize, rfile, rboff, rnbytes, rcrc, rblocks = (getattr(rec, f) for f in _FIELDS)
    kid = {k: i for i, k in enumerate(keys)}
    key = np.fromiter(map(kid.__getitem__, rkey), np.int64, n)
    if all(len(o) == width for o in roff):
        off, size = np.array(roff, np.int64).reshape(n, width), np.array(rsize, np.int64).reshape(n, width)
    else:  # tensors of fewer dimensions: pad their boxes (offset 0, size 1)
        off, size = np.zeros((n, width), np.int64), np.ones((n, width), np.int64)
        for i, (o, sz) in enumerate(zip(roff, rsize)):
            off[i, :len(o)], size[i, :len(sz)] = o, sz
    names: dict[str, int] = {}
    file = np.fromiter((names.setdefault(f, len(names)) for f in rfile), np.int64, n)
    blen = np.fromiter(map(len, rblocks), np.int64, n)
    bval = np.fromiter((b for bl in rblocks for b in bl), np.uint32, int(blen.sum()))
    order = np.lexsort([off[:, d] for d in range(width - 1, -1, -1)] + [key])
    start = np.zeros(n + 1, np.int64)
    np.cumsum(blen, out=start[1:])
    blen = blen[order]
    if len(bval):
        bval = bval[np.repeat(start[:-1][order] - (np.cumsum(blen) - blen), blen) + np.arange(len(bval))]
    bounds = np.zeros(n + 1, np.int64)
    np.cumsum(blen, out=bounds[1:])
    key, off, size, file = key[order], off[order], size[order], file[order]
    boff, nbytes, crc = (np.array(c, np.int64)[order] for c in (rboff, rnbytes, rcrc))
    rows = np.searchsorted(key, np.arange(len(keys) + 1))
    codec = stored = None
    if rec.codecs:
        codec, stored = np.array(rec.codecs, np.uint8)[order], np.array(rec.stored, np.int64)[order]
    cols = ChunkColumns(rows, ndim, off, size, list(names), file, boff, nbytes, crc, bval, bounds, codec, stored)
    return TensorMetas(keys, [s.dtype for s in specs], [s.shape for s in specs], cols)


def name_storage_error(exc: Exception, checkpoint_id: str) -> Exception:
    """A write's OSError as a CheckpointError naming the checkpoint and what to check."""
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return StorageError(f"writing {checkpoint_id}: {exc}; check the path, permissions and free space",
                            retriable=is_transient(exc), path=str(checkpoint_id))
    return exc
