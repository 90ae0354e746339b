"""Conversion between raydcp checkpoints and torch.distributed.checkpoint (DCP) checkpoints.

To DCP: the files DCP's FileSystemWriter writes by default, one ``__R_0.distcp`` per rank
that saved the source (each holding that rank's pieces, each the ``torch.save`` of the piece at
the byte range its storage record names; plain values in rank 0's file) and the ``.metadata``
pickle of DCP's own metadata types, written last. Pieces are loaded a bounded group at a time
and streamed into their file, so memory stays about ``max(budget, largest piece)``. Keys are
raydcp's flat dotted FQNs, which are the FQNs DCP itself gives a nested state dict, so torch's
``dcp.load`` of the nested dict finds them.

From DCP: the ``.metadata`` pickle is read only through the restricted unpickler of
:mod:`raydcp.convert.dcp_pickle`; each saved chunk is the ``torch.save`` of a tensor at the byte
range its storage record names, read with ``torch.load(weights_only=True)``; non-tensor entries
are ``torch.save``'d objects, also read with ``weights_only=True`` and kept when they are plain
values (others are skipped and reported). Chunks are assembled into whole tensors and saved with
``raydcp.save``, which takes the whole state at once: memory is about the checkpoint's size.
"""
from __future__ import annotations

import gc
import io
import math
import os
import pickle
import re
from typing import Any

import torch

from ..codec import dtype_from_name, dtype_name, is_plain_value
from ..engine import load_with, save_with
from ..errors import CheckpointError
from ..options import SaveOptions
from ..planner.tiling import piece_problems
from ..storage import CheckpointStorage
from ..transport import LocalTransport
from ._io import DEFAULT_BUDGET, ConvertResult, Destination, Progress, TensorSource
from ..state import Shard
from .dcp_pickle import read_dcp_metadata
from .keys import KeySelection

__all__ = ["to_torch_dcp", "from_torch_dcp"]

_RANK_FILE = re.compile(r"(?:^|/)r(\d+)-f\d+\.bin$")  # raydcp's data file names: data/<save id>/r00003-f000.bin


def _saving_rank(file: str, world_size: int) -> int | None:
    m = _RANK_FILE.search(file)
    return int(m.group(1)) if m and int(m.group(1)) < world_size else None


def _rank_pieces(source: TensorSource) -> dict[int, list[tuple[str, Any]]]:
    """Every stored piece of the kept tensors, by the rank that saved it (from its data file's
    name; pieces of files named otherwise, e.g. a reshard's, are spread over the ranks by bytes)."""
    md = source.metadata
    world = max(1, md.world_size)
    by_rank: dict[int, list[tuple[str, Any]]] = {r: [] for r in range(world)}
    load = [0] * world
    for key in source.keys:
        chunks = list(md.tensors[key].chunks)
        if not chunks:  # an empty tensor stored without a piece: DCP needs one chunk for it
            by_rank[0].append((key, None))
        for c in chunks:
            r = _saving_rank(c.file, world)
            if r is None:
                r = min(range(world), key=lambda i: (load[i], i))
            load[r] += c.nbytes
            by_rank[r].append((key, c))
    return by_rank


def _piece_groups(pieces: list[tuple[str, Any]], sizes: dict, budget: int) -> list[list[tuple[str, Any]]]:
    """Consecutive groups of at most ``budget`` bytes, each holding a key at most once."""
    groups: list[list[tuple[str, Any]]] = []
    size, keys = 0, set()
    for key, c in pieces:
        n = sizes[key] if c is None else c.nbytes
        if not groups or size + n > budget or key in keys:
            groups.append([])
            size, keys = 0, set()
        groups[-1].append((key, c))
        size += n
        keys.add(key)
    return groups


def to_torch_dcp(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                 budget_bytes: int = DEFAULT_BUDGET, progress: Progress | None = None,
                 select: KeySelection | None = None) -> ConvertResult:
    """Write the raydcp checkpoint ``src`` as a torch DCP checkpoint at ``dst``: one
    ``__R_0.distcp`` file per rank that saved ``src``, holding that rank's pieces, and ``.metadata``."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, TensorProperties, TensorStorageMetadata)

    source = TensorSource(src, storage_options, budget_bytes=budget_bytes, select=select)
    md = source.metadata
    gaps = [p for k in source.keys for p in piece_problems(k, md.tensors[k].shape,
                                                             [(c.offsets, c.sizes) for c in md.tensors[k].chunks])]
    if gaps:
        raise CheckpointError(f"{source.checkpoint_id}: the metadata's pieces do not form whole tensors "
                              f"(run `raydcp verify`): {'; '.join(gaps[:5])}")
    out = Destination(dst, storage_options)
    out.check_free(directory=True, overwrite=overwrite)
    out.makedirs()
    names = source.names
    entries: dict[str, Any] = {}
    for key in source.keys:
        t = md.tensors[key]
        entries[names[key]] = TensorStorageMetadata(TensorProperties(dtype=dtype_from_name(source.dest_dtype(key))),
                                                    torch.Size(t.shape), [])
    storage_data: dict = {}
    total, done = source.nbytes(), 0
    sizes = {k: source.dest_nbytes(k) for k in source.keys}
    files = []
    if progress:
        progress(0, total)
    for rank, pieces in _rank_pieces(source).items():
        values = source.values if rank == 0 else {}
        if not pieces and not values:
            continue
        name = f"__{rank}_0.distcp"
        path = out.join(name)
        with out.guard("write"), out.open(path, "wb") as f:
            pos = 0

            def put(obj: Any) -> tuple[int, int]:
                nonlocal pos
                buf = io.BytesIO()
                torch.save(obj, buf)
                f.write(buf.getbuffer())
                start, pos = pos, pos + buf.tell()
                return start, pos - start

            for group in _piece_groups(pieces, sizes, source.budget):
                for key, data in _load_pieces(source, group):
                    new, c = names[key], data[1]
                    offsets = tuple(c.offsets) if c is not None else (0,) * len(md.tensors[key].shape)
                    start, length = put(data[0])
                    entries[new].chunks.append(ChunkStorageMetadata(torch.Size(offsets), data[0].size()))
                    storage_data[MetadataIndex(new, torch.Size(offsets), 0)] = _StorageInfo(name, start, length)
                    done += data[0].numel() * data[0].element_size()
                    if progress:
                        progress(done, total)
                data = None  # nothing of this group stays alive while the next one loads; torch.save
                gc.collect(1)  # leaves reference cycles that hold the tensors it wrote until collected
            for key, value in sorted(values.items()):
                start, length = put(value)
                entries[key] = BytesStorageMetadata()
                storage_data[MetadataIndex(key)] = _StorageInfo(name, start, length)
        files.append(name)
    for e in entries.values():
        if isinstance(e, TensorStorageMetadata):  # dcp.load finds a chunk by its index in this list
            e.chunks.sort(key=lambda ch: tuple(ch.offsets))
    for index in list(storage_data):
        if index.offset is not None:
            chunks = entries[index.fqn].chunks
            pos = next(i for i, ch in enumerate(chunks) if tuple(ch.offsets) == tuple(index.offset))
            storage_data[MetadataIndex(index.fqn, index.offset, pos)] = storage_data.pop(index)
    dcp_md = Metadata(state_dict_metadata=dict(sorted(entries.items())),
                      planner_data={k: (k,) for k in entries}, storage_data=storage_data)
    out.write_bytes(out.join(".metadata"), pickle.dumps(dcp_md))
    _remove_stale_distcp(out, set(files))
    return ConvertResult(str(src), out.url, "torch-dcp", len(source.keys), len(source.values), total,
                         sorted(files) + [".metadata"], dropped=len(source.dropped))


def _load_pieces(source: TensorSource, group: list[tuple[str, Any]]):
    """``(key, (piece in the destination dtype, chunk))`` for the pieces of ``group``, loaded at once."""
    md = source.metadata
    state = {}
    for key, c in group:
        t = md.tensors[key]
        dtype = dtype_from_name(t.dtype)
        if c is None:
            state[key] = torch.empty(t.shape, dtype=dtype)
        else:
            state[key] = Shard(torch.empty(tuple(c.sizes), dtype=dtype), tuple(c.offsets), tuple(t.shape))
    load_with(LocalTransport(), dict(state), source.checkpoint_id, strict=False, storage_options=source.storage_options,
              warn_skipped=False, fresh=True)  # a group of the keys, on purpose (the others come later); new
    # tensors, dropped if it fails: no undo copy
    for key, c in group:
        piece = state.pop(key)
        piece = piece.tensor if isinstance(piece, Shard) else piece
        dtype = source.dest_dtype(key)
        if dtype != md.tensors[key].dtype:
            piece = piece.to(dtype_from_name(dtype))
        yield key, (piece, c)


def _remove_stale_distcp(out: Destination, keep: set[str]) -> None:
    """Files of an earlier export with more ranks would sit beside the new ones."""
    with out.guard("clean up"):
        for path in out.fs.ls(out.path, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".distcp") and name not in keep:
                out.fs.rm_file(path)


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:500]}" if text else type(exc).__name__


def from_torch_dcp(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                   progress: Progress | None = None, options: SaveOptions | None = None) -> ConvertResult:
    """Save the torch DCP checkpoint ``src`` as a raydcp checkpoint at ``dst`` (with ``options``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = CheckpointStorage(src, storage_options)
    md = read_dcp_metadata(storage)
    Destination(dst, storage_options).check_free(directory=True, overwrite=overwrite)
    records = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info
               for idx, info in md.storage_data.items()}
    result = ConvertResult(storage.url, os.fspath(dst), "raydcp")
    entries = sorted(md.state_dict_metadata.items())
    file_sizes: dict[str, int | None] = {}
    total = sum(_check_sizes(storage, fqn, e, records, file_sizes)
                for fqn, e in entries if isinstance(e, TensorStorageMetadata))
    flat: dict[str, Any] = {}
    done = 0
    if progress:
        progress(0, total)
    for fqn, entry in entries:
        if isinstance(entry, TensorStorageMetadata):
            flat[fqn] = _read_tensor(storage, fqn, entry, records)
            done += flat[fqn].numel() * flat[fqn].element_size()
            result.tensors += 1
            if progress:
                progress(done, total)
        else:
            value, why = _read_value(storage, fqn, records)
            if why is None:
                flat[fqn] = value
                result.values += 1
            else:
                result.skipped[fqn] = why
    written = save_with(LocalTransport(), _nest(flat, md.planner_data), os.fspath(dst), storage_options=storage_options,
                        options=options)
    result.nbytes = written.total_bytes
    result.files = sorted(written.files)
    return result


def _nest(flat: dict[str, Any], planner_data: Any) -> dict[str, Any]:
    """Rebuild the saved state dict's nesting from DCP's planner data (FQN -> path, ints being list
    indices), so raydcp flattens it by its own rules: a list of dicts without tensors, which DCP
    splits into ``x.0.lr`` entries, becomes one plain value ``x`` again, as raydcp saves it. Flat
    keys where the planner data is absent or does not fit."""
    paths = planner_data if isinstance(planner_data, dict) else {}
    root: dict = {}
    try:
        for fqn, value in flat.items():
            path = paths.get(fqn, (fqn,))
            if not (isinstance(path, tuple) and path and all(type(p) in (str, int) for p in path)
                    and ".".join(map(str, path)) == fqn):
                path = (fqn,)
            node = root
            for part in path[:-1]:
                node = node.setdefault(part, {})
                if not isinstance(node, dict):
                    raise ValueError(fqn)
            if path[-1] in node:
                raise ValueError(fqn)
            node[path[-1]] = value
        return _lists(root)
    except ValueError:  # paths that collide: keep DCP's flat keys
        return dict(flat)


def _lists(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    out = {k: _lists(v) for k, v in node.items()}
    if out and all(type(k) is int for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    if len({str(k) for k in out}) != len(out):
        raise ValueError("keys collide")
    return {str(k): v for k, v in out.items()}


def _record(storage: CheckpointStorage, fqn: str, offsets, records: dict):
    info = records.get((fqn, offsets))
    if info is None:
        raise CheckpointError(f"{storage.url}: {fqn} (chunk at {list(offsets) if offsets else '-'}) has no "
                              "storage record in the DCP metadata; the checkpoint is damaged")
    if getattr(info, "transform_descriptors", None):
        raise CheckpointError(f"{storage.url}: {fqn} was written with stream transforms {info.transform_descriptors} "
                              "(e.g. compression), which raydcp cannot read; save it with the default FileSystemWriter")
    return info


def _check_sizes(storage: CheckpointStorage, fqn: str, entry, records: dict, sizes: dict) -> int:
    """The tensor's bytes, once every chunk's claimed size is backed by its storage record and the
    record by its file: hostile metadata (2**62 elements) fails here, before anything is allocated."""
    itemsize = entry.properties.dtype.itemsize
    whole = math.prod(entry.size) * itemsize  # Python ints: no overflow
    stored = 0
    for c in entry.chunks:
        need = math.prod(c.sizes) * itemsize
        info = _record(storage, fqn, tuple(c.offsets), records)
        if need > info.length:
            raise CheckpointError(
                f"{storage.url}: {fqn}: the DCP metadata claims a chunk of {list(c.sizes)} {entry.properties.dtype} "
                f"elements ({need} bytes) at {list(c.offsets)}, but its storage record holds only {info.length} "
                f"bytes of {info.relative_path}; the metadata is damaged or forged, nothing was read")
        if info.relative_path not in sizes:
            sizes[info.relative_path] = storage.file_size(info.relative_path)
        size = sizes[info.relative_path]
        if size is None or info.offset + info.length > size:
            have = "is missing" if size is None else f"holds {size} bytes"
            raise CheckpointError(
                f"{storage.file_url(info.relative_path)} ({fqn}): the storage record needs bytes "
                f"{info.offset}..{info.offset + info.length}, the file {have}; the checkpoint is damaged")
        stored += need
    if whole > stored:
        raise CheckpointError(
            f"{storage.url}: {fqn}: the DCP metadata claims {list(entry.size)} {entry.properties.dtype} "
            f"({whole} bytes) but its chunks hold {stored} bytes; the metadata is damaged or forged, nothing was read")
    return whole


def _read_bytes(storage: CheckpointStorage, fqn: str, info) -> io.BytesIO:
    (view,) = storage.read_ranges(info.relative_path, [(info.offset, info.offset + info.length)])
    if bytes(view[:2]) != b"PK":  # torch.save's zip format; DCP's safetensors format is not read here
        raise CheckpointError(
            f"{storage.file_url(info.relative_path)} at bytes {info.offset}..{info.offset + info.length} ({fqn}): "
            "not torch.save data (a DCP checkpoint written with serialization_format=SAFETENSORS, or damaged)"
        )
    return io.BytesIO(view)


def _read_tensor(storage: CheckpointStorage, fqn: str, entry, records: dict) -> torch.Tensor:
    shape, dtype = tuple(entry.size), entry.properties.dtype
    dtype_name(dtype)  # a CheckpointError naming the dtype if raydcp cannot store it
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in entry.chunks]
    problems = piece_problems(fqn, shape, boxes)
    if problems:
        raise CheckpointError(f"{storage.url}: the DCP checkpoint's chunks do not form whole tensors: {problems[0]}")
    out = None
    for offsets, sizes in boxes:
        info = _record(storage, fqn, offsets, records)
        buf = _read_bytes(storage, fqn, info)
        try:
            piece = torch.load(buf, map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CheckpointError(f"{storage.file_url(info.relative_path)} ({fqn}): cannot read the saved chunk: "
                                  f"{_describe(exc)}") from None
        if not isinstance(piece, torch.Tensor) or piece.dtype != dtype or tuple(piece.shape) != sizes:
            got = f"{piece.dtype}{list(piece.shape)}" if isinstance(piece, torch.Tensor) else type(piece).__name__
            raise CheckpointError(f"{storage.file_url(info.relative_path)} ({fqn}): the chunk at {list(offsets)} holds "
                                  f"{got}, the metadata says {dtype}{list(sizes)}; the checkpoint is damaged")
        if sizes == shape:
            return piece.contiguous()
        if out is None:
            out = torch.empty(shape, dtype=dtype)
        view = out
        for d, (o, n) in enumerate(zip(offsets, sizes)):
            view = view.narrow(d, o, n)
        view.copy_(piece)
    return out if out is not None else torch.empty(shape, dtype=dtype)


def _read_value(storage: CheckpointStorage, fqn: str, records: dict) -> tuple[Any, str | None]:
    info = _record(storage, fqn, None, records)
    buf = _read_bytes(storage, fqn, info)
    try:
        value = torch.load(buf, map_location="cpu", weights_only=True)
    except Exception as exc:  # not loadable without running code: never unpickled unrestricted
        return None, f"not loadable with torch.load(weights_only=True) ({_describe(exc)[:200]})"
    if not is_plain_value(value):
        return None, f"a {type(value).__name__}, not a plain value raydcp stores"
    return value, None
