"""Collective save: flatten -> local plan -> global plan -> parallel writes -> commit last."""
from __future__ import annotations

import ctypes
import time
from functools import partial
from typing import Any, Callable, Iterator, Sequence

import crc32c
import numpy as np
import torch

from ..codec import checksum, combine_block_checksums
from ..errors import CheckpointError, RankFailure
from ..metadata import BLOCK_BYTES, ChunkColumns, Metadata, TensorMetas
from ..metadata_format import encode_metadata
from ..planner import LocalSavePlan, RankWritePlan, SavePlanOptions, TensorSpec, WriteItem, plan_save
from ..planner.save import ALIGN
from ..state import FlatState, flatten_state
from ..storage import CheckpointStorage
from ..transport import Transport

__all__ = ["save_with", "local_save_plan", "StagedState"]

_ZEROS = bytes(ALIGN)
PACK_MAX = 64 << 10      # host pieces up to this size are copied into shared write buffers ...
PACK_BYTES = 4 << 20     # ... of up to this size: one write and no per-piece buffer for many small pieces
WRITE_BYTES = 4 * BLOCK_BYTES  # a large piece is checksummed and written this many bytes at a time
assert WRITE_BYTES % BLOCK_BYTES == 0


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


def _reduce_save_plan(options: SavePlanOptions, local_plans: Sequence[LocalSavePlan]) -> list:
    gp = plan_save(local_plans, options)
    header = (gp.save_id, gp.world_size, dict(gp.tensors), dict(gp.values))
    return [(gp.ranks[r], header if r == 0 else None) for r in range(gp.world_size)]


def _packable(t: torch.Tensor) -> bool:
    """Whether a piece's bytes can be copied straight from its memory (host, dense, no lazy conj/neg)."""
    return t.is_cpu and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _file_buffers(ids: list[int], offsets: list[int], sizes: list[int], sources, crcs: list, blocks: list,
                  read: Callable[[int, int, int, int], None] | None = None) -> Iterator[Any]:
    """The buffers of one data file, whose pieces are the items ``ids`` at byte ``offsets``, in
    order; runs in the file's writing thread.

    Every piece is checksummed here, just before it is written (``crcs[item]``, ``blocks[item]``):
    small host pieces are copied into shared buffers of up to PACK_BYTES and checksummed there;
    large ones are written from their own memory WRITE_BYTES at a time, each 1 MiB block
    checksummed just before it is written and the piece's checksum combined from its blocks, so
    every byte is read once, while it is in cache.

    With ``read`` the pieces' bytes are not in this process (``sources`` is not used):
    ``read(item, start, nbytes, address)`` copies bytes ``[start, start + nbytes)`` of
    piece ``item`` to ``address``. Every piece is then packed or copied WRITE_BYTES at a time
    into one buffer of this file's that is reused for the next chunk once written (the
    storage writes each buffer before it asks for the next, see ``write_file``).
    """
    crc = crc32c.crc32c
    memmove = ctypes.memmove
    pos, i, n = 0, 0, len(ids)
    chunk: np.ndarray | None = None  # with ``read``: where large pieces are copied, a chunk at a time
    while i < n:
        item = ids[i]
        nbytes = sizes[item]
        src = sources[item] if read is None else None
        if nbytes <= PACK_MAX and (read is not None or _packable(src)):
            j, end = i + 1, offsets[i] + nbytes
            while j < n:
                nb = sizes[ids[j]]
                if (nb > PACK_MAX or offsets[j] + nb - pos > PACK_BYTES
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
            for s in range(0, nbytes, WRITE_BYTES):
                e = min(s + WRITE_BYTES, nbytes)
                if read is not None:
                    if chunk is None:
                        chunk = np.empty(WRITE_BYTES, dtype=np.uint8)
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
                     read: Callable[[str, int, int, int, int], None] | None = None) -> list[tuple]:
    """Write this rank's files (in parallel) and return one storage record per piece.

    Each file's pieces are checksummed in its writing thread as they are written
    (:func:`_file_buffers`), overlapped with the writes of the other files. ``read``, for
    pieces held by another process, is ``read(file name, item, start, nbytes, address)``.
    """
    items = staged.plan.items
    sources = staged.sources() if read is None else None
    sizes = [it.nbytes for it in items]
    crcs: list[Any] = [None] * len(items)
    blocks: list[tuple[int, ...]] = [()] * len(items)
    layouts = _file_layouts(plan.files)
    storage.write_files({name: _file_buffers(ids, offs, sizes, sources, crcs, blocks,
                                             None if read is None else partial(read, name))
                         for name, ids, offs in layouts})
    records = []
    for name, ids, offs in layouts:
        for i, off in zip(ids, offs):
            it = items[i]
            records.append((it.key, it.offsets, it.sizes, name, off, it.nbytes, crcs[i], blocks[i]))
    return records


def _reduce_commit(checkpoint_id: str, storage_options: dict | None, values: Sequence[tuple]) -> list:
    header = values[0][1]
    save_id, world_size, tensors, plain = header
    md = Metadata(
        save_id=save_id,
        world_size=world_size,
        created_at=time.time(),
        tensors=_tensor_metas(tensors, [rec for records, _ in values for rec in records]),
        values=plain,
    )
    storage = CheckpointStorage(checkpoint_id, storage_options)
    storage.commit(encode_metadata(md))
    # the files of earlier saves to this path are unreachable now: remove them
    stale = [f for f in storage.list_files("data/") if not f.startswith(f"data/{save_id}/")]
    if stale:
        storage.remove_files(stale)
    return [md] * len(values)


def _tensor_metas(tensors: dict[str, TensorSpec], records: list[tuple]) -> TensorMetas:
    """Every tensor's metadata from the ranks' storage records: one set of chunk columns for all
    tensors (:class:`ChunkColumns`), grouped by tensor and each tensor's chunks sorted by offsets;
    no object per chunk or per tensor."""
    keys = list(tensors)
    specs = list(tensors.values())
    n = len(records)
    width = max(1, *(len(s.shape) for s in specs)) if specs else 1
    ndim = np.fromiter((len(s.shape) for s in specs), np.int64, len(specs))
    if n == 0:
        empty = np.zeros(0, np.int64)
        cols = ChunkColumns(np.zeros(len(keys) + 1, np.int64), ndim, np.zeros((0, width), np.int64),
                            np.ones((0, width), np.int64), [], empty, empty, empty, empty, np.zeros(0, np.uint32),
                            np.zeros(1, np.int64))
        return TensorMetas(keys, [s.dtype for s in specs], [s.shape for s in specs], cols)
    kid = {k: i for i, k in enumerate(keys)}
    rkey, roff, rsize, rfile, rboff, rnbytes, rcrc, rblocks = zip(*records)
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
    cols = ChunkColumns(rows, ndim, off, size, list(names), file, boff, nbytes, crc, bval, bounds)
    return TensorMetas(keys, [s.dtype for s in specs], [s.shape for s in specs], cols)


def save_with(
    transport: Transport,
    state_dict: dict,
    checkpoint_id: str,
    storage_options: dict | None = None,
    options: SavePlanOptions = SavePlanOptions(),
    staged: StagedState | None = None,
) -> Metadata:
    """The save protocol for one rank (every rank of ``transport`` calls it together).

    1. stage: flatten the state and describe it (local plan); 2. reduce_scatter
    "plan": the coordinator validates and builds the global plan; 3. write this
    rank's files; 4. reduce_scatter "commit": the coordinator writes the metadata
    last, atomically, and every rank gets it back. Any failure on any rank fails
    every rank with one CheckpointError and commits nothing.
    """
    rank = transport.rank
    local: Any
    try:
        if staged is None:
            staged = local_save_plan(rank, flatten_state(state_dict), compare_replicas=transport.world_size > 1)
        local = staged.plan
    except Exception as exc:
        local = RankFailure.from_exception(rank, exc)
    plan, header = transport.reduce_scatter("save: plan", local, partial(_reduce_save_plan, options))
    try:
        records: Any = (write_rank_files(CheckpointStorage(checkpoint_id, storage_options), plan, staged), header)
    except Exception as exc:
        records = RankFailure.from_exception(rank, _name_storage_error(exc, checkpoint_id))
    return transport.reduce_scatter("save: commit", records, partial(_reduce_commit, checkpoint_id, storage_options))


def _name_storage_error(exc: Exception, checkpoint_id: str) -> Exception:
    if isinstance(exc, CheckpointError):
        return exc
    if isinstance(exc, OSError):
        return CheckpointError(f"writing {checkpoint_id}: {exc}; check the path, permissions and free space")
    return exc
