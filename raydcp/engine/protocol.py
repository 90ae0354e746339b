"""The save protocol, published once: three named steps.

Every save of raydcp -- the synchronous save, both asynchronous persisters (the helper
process and the Ray persister actor) and the rounds of a multi-round save -- runs these
steps, in this order, over a :class:`~raydcp.transport.Transport`:

1. **plan** -- every rank calls :func:`plan_round` with its local plan (metadata only);
   the coordinator runs :func:`reduce_plan` (``plan_save``: validation, replicas written
   once, bytes balanced) and hands each rank its :class:`~raydcp.planner.RankWritePlan`,
   and rank 0 the :class:`~raydcp.engine.save_records.SaveHeader` of the checkpoint. Where the
   backend's room is per place (``raymem://``), the coordinator then reserves the room for
   every rank's files (:mod:`raydcp.storage.capacity`): a save that does not fit fails
   here, on every rank.
2. **write** -- each rank writes its files (``raydcp.engine.save.write_rank_files``, in
   one or several batches of whole files) and keeps one columnar
   :class:`~raydcp.engine.save_records.StorageRecord` per batch: file, byte range and checksums
   of every piece it wrote.
3. **commit** -- every rank calls :func:`commit_round` with its records (rank 0 also with
   the header); the coordinator runs :func:`reduce_commit`: the metadata is built from the
   records (:func:`tensor_metas`), written last and atomically, and the files of earlier
   saves to the path are removed. Every rank gets the Metadata.

A rank that fails at any step still takes part, sending a
:class:`~raydcp.errors.RankFailure`: every rank then raises one CheckpointError and
nothing is committed. Multi-round saves (:mod:`raydcp.engine.rounds`) run steps 1 and 2
once per round and gather the records instead of committing; their driver commits all
rounds at once. The records the steps pass are defined in :mod:`raydcp.engine.save_records`.
"""
from __future__ import annotations

import time
from dataclasses import replace
from functools import partial
from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import CheckpointError, RankFailure, StorageError
from ..metadata import ChunkColumns, Metadata, TensorMetas
from ..metadata_format import decode_metadata, encode_metadata
from ..planner import LocalSavePlan, PlanCache, RankWritePlan, SavePlanOptions, TensorSpec, plan_save
from ..planner.arrays import sorted_runs
from ..storage import CheckpointStorage
from ..storage import capacity
from ..storage import is_transient
from ..storage.commits import LOG_DIR, begin_save, commit_generation, current_generation, prune, remove_save_files
from ..transport import Reusing, Transport
from .save_records import SaveHeader, StorageRecord

__all__ = ["reduce_plan", "reduce_commit", "commit_metadata", "tensor_metas", "plan_round", "commit_round",
           "commit_checkpoint", "name_storage_error", "PLAN_STEP", "COMMIT_STEP"]

PLAN_STEP = "save: plan"
COMMIT_STEP = "save: commit"


# -- step 1: plan ------------------------------------------------------------------------------
def reduce_plan(options: SavePlanOptions, local_plans: Sequence[LocalSavePlan],
                destination: tuple[str, dict | None] | None = None, cache: PlanCache | None = None) -> list:
    """On the coordinator: the global plan; per rank ``(RankWritePlan, SaveHeader on rank 0 else None)``.

    ``destination`` ``(checkpoint_id, storage_options)``: the save begins there (its id is taken
    on the path's current commit and recorded, :func:`~raydcp.storage.commits.begin_save`) unless
    ``options`` fix the save id; where the backend reserves room per place
    (:mod:`raydcp.storage.capacity`), the room for every rank's files is reserved last, so a save
    that does not fit fails every rank here, before any byte is staged or written. ``cache``: what
    the coordinator keeps of the group's last plan (:class:`~raydcp.planner.PlanCache`), reused
    where every rank's layout is the same (each step of a training run).
    """
    storage = sites = None
    began = False
    if destination is not None:
        local_plans, sites = _same_destination(destination[0], local_plans)
        storage = CheckpointStorage(*destination)
        if options.save_id is None:
            options, began = replace(options, save_id=begin_save(storage)), True
    gp = plan_save(local_plans, options, cache)
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
        return transport.reduce_scatter(step, local, Reusing(reduce_plan, options))
    destination = (str(checkpoint_id), storage_options)
    if not isinstance(local, RankFailure):  # every rank says where it saves: unrelated saves never mix
        try:
            storage = CheckpointStorage(*destination)
            local = (storage.url, local, capacity.writer_site(storage))
        except Exception as exc:  # fails every rank at the plan step, naming this one
            local = RankFailure.from_exception(transport.rank, exc)
    return transport.reduce_scatter(step, local, Reusing(reduce_plan, options, destination=destination))


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
