"""Collective save: flatten -> local plan -> global plan -> parallel writes -> commit last."""
from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any, Callable, Iterable, Iterator

import crc32c
import numpy as np
import torch

from ..codec import checksum, combine_block_checksums
from ..errors import CheckpointError, CoordinatorLostError, RankFailure
from ..metadata import BLOCK_BYTES, Metadata
from ..options import DEFAULT_IO, DEFAULT_SAVE, IOOptions, SaveOptions
from ..planner import LocalSavePlan, RankWritePlan, SavePlanOptions, TensorSpec, WriteItem
from ..planner.save import ALIGN
from ..state import FlatState, flatten_state
from ..storage import CheckpointStorage
from ..storage.capacity import release_save
from ..transport import Transport
from .compressed import PieceRows, compressed_file_buffers
from .delta import DeltaSave, DeltaWrite, digest_file_name, digest_record, remember_commit, resolve_base, writer_of
from .protocol import commit_round, name_storage_error, plan_round
from .save_records import StorageRecord

__all__ = ["save_with", "local_save_plan", "StagedState", "write_rank_files", "plan_options"]

_ZEROS = bytes(ALIGN)


class StagedState:
    """A rank's local plan and the data of its pieces, one per plan item.

    ``data`` is one flat uint8 view per piece (on the piece's device until staged). A
    synchronous save writes straight from the pieces' tensors, so the views are made only
    when something asks for ``data`` (staging for an asynchronous save does).
    """

    def __init__(self, plan: LocalSavePlan, data: list[torch.Tensor] | None = None, *,
                 tensors: list[torch.Tensor] | None = None):
        if data is None and tensors is None:
            raise ValueError("StagedState needs data or tensors")
        self.plan = plan
        self._data = data
        self._tensors = tensors

    @property
    def data(self) -> list[torch.Tensor]:
        if self._data is None:
            self._data = [_byte_view(t) for t in self._tensors]
        return self._data

    @data.setter
    def data(self, value: list[torch.Tensor]) -> None:
        self._data = value

    def sources(self) -> list[torch.Tensor]:
        """Per item, a tensor holding exactly the piece's bytes (any dtype, maybe not contiguous)."""
        return self._data if self._data is not None else self._tensors


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def local_save_plan(rank: int, flat: FlatState, *, compare_replicas: bool) -> StagedState:
    """Describe what this rank holds. Replicas get a checksum where that is cheap (host tensors)."""
    tensors, items, sources = {}, [], []
    leaves = flat.tensors
    for fqn in sorted(leaves):
        leaf = leaves[fqn]
        t = leaf.tensor
        tensors[fqn] = TensorSpec(leaf.dtype, leaf.global_shape)
        crc = checksum(_byte_view(t)) if compare_replicas and leaf.replicable and t.is_cpu else None
        items.append(WriteItem(fqn, leaf.offsets, tuple(t.shape), t.nbytes, crc))
        sources.append(t)
    return StagedState(LocalSavePlan(rank, tensors, tuple(items), dict(flat.values)), tensors=sources)


def _packable(t: torch.Tensor) -> bool:
    """Whether a piece's bytes can be copied straight from its memory (host, dense, no lazy conj/neg)."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _file_buffers(ids: list[int], offsets: list[int], sizes: list[int], sources, crcs: list, blocks: list,
                  read: Callable[[int, int, int, int], None] | None = None,
                  io: IOOptions = DEFAULT_IO) -> Iterator[Any]:
    """The buffers of one data file, whose pieces are the items ``ids`` at byte ``offsets``, in
    order; runs in the file's writing thread.

    Every piece is checksummed here, just before it is written (``crcs[item]``, ``blocks[item]``):
    host pieces of up to ``io.pack_max`` bytes are copied into shared buffers of up to
    ``io.pack_bytes`` and checksummed there; larger ones are written from their own memory
    ``io.write_bytes`` at a time, each 1 MiB block checksummed just before it is written and the
    piece's checksum combined from its blocks, so every byte is read once, while it is in cache.

    With ``read`` the pieces' bytes are not in this process (``sources`` is not used):
    ``read(item, start, nbytes, address)`` copies bytes ``[start, start + nbytes)`` of
    piece ``item`` to ``address``. Every piece is then packed or copied ``io.write_bytes`` at a
    time into two buffers of this file's in turn: the storage reads one buffer ahead
    (``write_file``'s ``read_ahead``), so a buffer is reused only once the one after it is asked for.
    """
    crc = crc32c.crc32c
    memmove = ctypes.memmove
    pack_max, pack_bytes, write_bytes = io.pack_max, io.pack_bytes, io.write_bytes
    pos, i, n = 0, 0, len(ids)
    chunks: list[np.ndarray] = []  # with ``read``: where large pieces are copied, a chunk at a time, in turn
    turn = 0
    while i < n:
        item = ids[i]
        nbytes = sizes[item]
        src = sources[item] if read is None else None
        if nbytes <= pack_max and (read is not None or _packable(src)):
            j, end = i + 1, offsets[i] + nbytes
            while j < n:
                nb = sizes[ids[j]]
                if (nb > pack_max or offsets[j] + nb - pos > pack_bytes
                        or (read is None and not _packable(sources[ids[j]]))):
                    break
                end = offsets[j] + nb
                j += 1
            arr = np.zeros(end - pos, dtype=np.uint8)  # zero: the alignment gaps are zero bytes
            view = memoryview(arr)
            base = arr.ctypes.data
            for k in range(i, j):
                item = ids[k]
                nb = sizes[item]
                off = offsets[k] - pos
                if read is None:
                    memmove(base + off, sources[item].data_ptr(), nb)
                else:
                    read(item, 0, nb, base + off)
                crcs[item] = crc(view[off:off + nb])
            yield arr
            pos, i = end, j
            continue
        i += 1
        off = offsets[i - 1]
        if off > pos:
            yield _ZEROS[: off - pos]
        if read is None:
            raw = _byte_view(src)
            view = memoryview((raw if raw.is_cpu else raw.cpu()).numpy())
        if nbytes <= BLOCK_BYTES and read is None:
            crcs[item] = crc(view)
            yield view
        else:
            bl: list[int] = []
            for s in range(0, nbytes, write_bytes):
                e = min(s + write_bytes, nbytes)
                if read is not None:
                    if len(chunks) < 2:
                        chunks.append(np.empty(write_bytes, dtype=np.uint8))
                    chunk, turn = chunks[turn % len(chunks)], turn + 1
                    read(item, s, e - s, chunk.ctypes.data)
                    part = memoryview(chunk)[: e - s]
                else:
                    part = view[s:e]
                bl.extend(crc(part[b:b + BLOCK_BYTES]) for b in range(0, e - s, BLOCK_BYTES))
                yield part
            if nbytes <= BLOCK_BYTES:
                crcs[item] = bl[0]
            else:
                crcs[item] = combine_block_checksums(bl, nbytes, BLOCK_BYTES)
                blocks[item] = tuple(bl)
        pos = off + nbytes


def _file_layouts(files) -> list[tuple[str, list[int], list[int]]]:
    """``(name, item indices, byte offsets)`` of each file of a rank's write plan: from its
    ``(name, slots)`` pairs, or straight from the columns of a columnar plan (no slot objects)."""
    cols = [getattr(files, a, None) for a in ("names", "items", "byte_offsets", "bounds")]
    if all(c is not None for c in cols):
        names, items, offs, bounds = (c.tolist() if hasattr(c, "tolist") else list(c) for c in cols)
        return [(name, items[bounds[f]:bounds[f + 1]], offs[bounds[f]:bounds[f + 1]]) for f, name in enumerate(names)]
    return [(name, [s.item for s in slots], [s.byte_offset for s in slots]) for name, slots in files]


def write_rank_files(storage: CheckpointStorage, plan: RankWritePlan, staged: StagedState,
                     read: Callable[[str, int, int, int, int], None] | None = None, *,
                     io: IOOptions = DEFAULT_IO, compression: str | None = None,
                     delta: DeltaSave | None = None) -> StorageRecord:
    """Write this rank's files (``io.write_threads`` at once) and return their storage record
    (step 2 of the save protocol, :mod:`raydcp.engine.protocol`): one row per piece.

    Each file's pieces are checksummed in its writing thread as they are written
    (:func:`_file_buffers`, with the sizes of ``io``), overlapped with the writes of the other
    files. ``read``, for pieces held by another process, is ``read(file name, item, start,
    nbytes, address)``. With ``compression`` each piece is compressed on its own
    (:mod:`raydcp.engine.compressed`) and the files are laid out as written. With ``delta`` (a
    save with a base, :mod:`raydcp.engine.delta`) the pieces equal to the base's are referenced,
    not written, and the rank's digest file is written beside its data files.
    """
    layouts = _file_layouts(plan.files)
    if delta is None:
        return _write_layouts(storage, layouts, staged, read, io, compression)
    return _write_delta(storage, plan, layouts, staged, read, io, compression, delta)


def _write_delta(storage: CheckpointStorage, plan: RankWritePlan, planned: list[tuple[str, list[int], list[int]]],
                 staged: StagedState, read: Callable[[str, int, int, int, int], None] | None, io: IOOptions,
                 compression: str | None, delta: DeltaSave) -> StorageRecord:
    """:func:`write_rank_files` of a delta save: each planned file's pieces hashed and looked up in
    the base (:class:`~raydcp.engine.delta.DeltaWrite`), then the changed ones written, file by file
    in ``io.write_threads`` threads; the reused ones recorded as references; the digest file last."""
    items = staged.plan.items
    sources = staged.sources() if read is None else None
    work = DeltaWrite(storage, delta.base, plan.rank, plan.save_id, items, sources, read)
    sizes = [it.nbytes for it in items]
    crcs: list[Any] = [None] * len(items)
    blocks: list[tuple[int, ...]] = [()] * len(items)

    def one(layout: tuple[str, list[int], list[int]]) -> tuple[str, list[int], list[int]]:
        name, ids, _ = layout
        todo, offs = work.decide(name, ids)
        if todo and compression is None:
            storage.write_file(name, _file_buffers(todo, offs, sizes, sources, crcs, blocks,
                                                   None if read is None else partial(read, name), io),
                               read_ahead=True)
        return name, todo, offs

    # the smallest files first: the pieces that changed (adapters, optimizer state) are written while
    # the large unchanged ones are still being hashed
    by_size = sorted(planned, key=lambda layout: sum(sizes[i] for i in layout[1]))
    try:
        work.hash([(name, ids) for name, ids, _ in by_size])
        with ThreadPoolExecutor(max(1, min(io.write_threads, len(planned)))) as pool:
            done = {layout[0]: layout for layout in pool.map(one, by_size)}
    finally:
        work.close()
    kept = [done[name] for name, _, _ in planned if done[name][1]]  # in the plan's order
    if compression is None:
        written = StorageRecord.written(staged.plan, kept, crcs, blocks)
    else:
        written = _write_compressed(storage, kept, staged, read, io, compression)
    reused, reused_ids = work.finish()
    record = StorageRecord.concat([written, reused])
    if planned:
        order = [i for _, ids, _ in kept for i in ids] + reused_ids
        storage.write_file(digest_file_name(planned[0][0]),
                           [digest_record(delta.writer, plan.save_id, record, [work.digests[i] for i in order])])
    return record


def _write_layouts(storage: CheckpointStorage, layouts: list[tuple[str, list[int], list[int]]], staged: StagedState,
                   read: Callable[[str, int, int, int, int], None] | None, io: IOOptions,
                   compression: str | None) -> StorageRecord:
    """Write the files ``layouts`` (name, item indices, byte offsets) and return their record."""
    if compression is not None:
        return _write_compressed(storage, layouts, staged, read, io, compression)
    items = staged.plan.items
    sources = staged.sources() if read is None else None
    sizes = [it.nbytes for it in items]
    crcs: list[Any] = [None] * len(items)
    blocks: list[tuple[int, ...]] = [()] * len(items)
    storage.write_files({name: _file_buffers(ids, offs, sizes, sources, crcs, blocks,
                                             None if read is None else partial(read, name), io)
                         for name, ids, offs in layouts}, max_workers=io.write_threads, read_ahead=True)
    return StorageRecord.written(staged.plan, layouts, crcs, blocks)  # columnar (no object per piece), in file order


def _write_compressed(storage: CheckpointStorage, layouts: list[tuple[str, list[int], list[int]]],
                      staged: StagedState, read: Callable[[str, int, int, int, int], None] | None, io: IOOptions,
                      compression: str) -> StorageRecord:
    """:func:`write_rank_files` with every piece compressed (where that makes it smaller)."""
    items = staged.plan.items
    sizes = [it.nbytes for it in items]
    rows = PieceRows(len(items))
    if read is None:
        sources = staged.sources()

        def piece_of(name: str, item: int) -> memoryview:
            raw = _byte_view(sources[item])
            return memoryview((raw if raw.is_cpu else raw.cpu()).numpy())
    else:
        def piece_of(name: str, item: int) -> memoryview:
            buf = np.empty(sizes[item], np.uint8)
            if sizes[item]:
                read(name, item, 0, sizes[item], buf.ctypes.data)
            return memoryview(buf)

    storage.write_files({name: compressed_file_buffers(ids, sizes, partial(piece_of, name), rows, io, compression)
                         for name, ids, _ in layouts}, max_workers=io.write_threads)
    # columnar, in file order; the pieces lie where the writer put them, not where the plan did
    written = [(name, ids, [rows.offsets[i] for i in ids]) for name, ids, _ in layouts]
    return StorageRecord.written(staged.plan, written, rows.crcs, rows.blocks, rows.codecs, rows.stored)


def save_with(
    transport: Transport,
    state_dict: dict,
    checkpoint_id: str,
    storage_options: dict | None = None,
    options: SaveOptions | None = None,
    staged: StagedState | None = None,
    writer: str | None = None,
) -> Metadata:
    """The synchronous save for one rank (every rank of ``transport`` calls it together).

    Flattens the state into a local plan, then runs the save protocol of
    :mod:`raydcp.engine.protocol`: plan (files of up to ``options.max_file_bytes``), write
    (all of this rank's files at once, with ``options.io``), commit. Any failure on any rank
    fails every rank with one CheckpointError and commits nothing. ``writer``: who saves, for a
    delta save's ``base="previous"`` (default: the Group's name, else this process).
    """
    options = DEFAULT_SAVE if options is None else options
    rank = transport.rank
    local: Any
    delta: DeltaSave | None = None
    try:
        if staged is None:
            staged = local_save_plan(rank, flatten_state(state_dict), compare_replicas=transport.world_size > 1)
        local = staged.plan
        delta = delta_save(transport, checkpoint_id, storage_options, options, writer)
    except Exception as exc:
        local = RankFailure.from_exception(rank, exc)
    plan, header = plan_round(transport, local, plan_options(options), checkpoint_id=checkpoint_id,
                              storage_options=storage_options)
    storage = CheckpointStorage(checkpoint_id, storage_options)
    try:
        written: Any = (write_rank_files(storage, plan, staged, io=options.io, compression=options.compression,
                                         delta=delta), header)
    except Exception as exc:
        written = RankFailure.from_exception(rank, name_storage_error(exc, checkpoint_id))
    try:
        md = commit_round(transport, written, checkpoint_id, storage_options)
    except CheckpointError as exc:
        discard_after_failure(storage, [plan], exc)
        raise
    if delta is not None:
        remember_commit(storage, delta.writer)
    return md


def delta_save(transport: Transport, checkpoint_id: str, storage_options: dict | None,
               options: SaveOptions, writer: str | None = None) -> DeltaSave | None:
    """The base of a save with ``options.base`` as this rank sees it (None: no base asked for);
    ``writer`` names who saves for ``base="previous"`` (default: the transport's Group, else this process)."""
    if options.base is None:
        return None
    writer = writer or writer_of(transport)
    return DeltaSave(resolve_base(CheckpointStorage(checkpoint_id, storage_options), options.base, writer), writer)


def plan_options(options: SaveOptions, *, save_id: str | None = None, cap: int | None = None) -> SavePlanOptions:
    """The save plan's options for a save with ``options``: files of up to ``max_file_bytes``
    (and no larger than a staging ``cap``, where one is given); ``save_id`` fixed or random."""
    max_file = options.max_file_bytes if cap is None else min(cap, options.max_file_bytes)
    return SavePlanOptions(max_file_bytes=max_file, save_id=save_id)


def rank_file_names(plan: RankWritePlan) -> list[str]:
    """The data files a rank's write plan names (whether or not they were written yet)."""
    return [name for name, _, _ in _file_layouts(plan.files)]


def discard_after_failure(storage: CheckpointStorage, plans: Iterable[RankWritePlan | None],
                          error: BaseException) -> None:
    """A save failed on this rank after planning: remove the files its ``plans`` name, so a
    failed save (a full disk, a lost race) leaves nothing behind and the next save has the room.

    Not where the coordinator was lost (it may have committed before it went): the next save to
    the path removes the files then, if they are garbage. The room the save reserved at its plan
    step (:mod:`raydcp.storage.capacity`) is given back in every case. Best effort: never hides
    ``error``.
    """
    for save_id in {plan.save_id for plan in plans if plan is not None}:
        try:
            release_save(storage, save_id)
        except Exception:
            pass
    if isinstance(error, CoordinatorLostError):
        return
    names = [n for plan in plans if plan is not None for n in rank_file_names(plan)]
    try:
        storage.remove_files(names)
    except Exception:
        pass
