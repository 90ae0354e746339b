"""Conversion between raydcp checkpoints and torch.distributed.checkpoint (DCP) checkpoints.

To DCP: torch's own ``dcp.save`` writes the checkpoint (FileSystemWriter for a local path,
FsspecWriter for a URL) in this one process, without a process group, so torch's ``dcp.load``
reads it. The state dict handed to ``dcp.save`` holds meta-device placeholders; the planner
fetches each real tensor from raydcp only when DCP writes it, a bounded group at a time
(:class:`~raydcp.convert._io.TensorSource`), and DCP writes one file per tensor, so memory
stays about ``max(budget, largest tensor)``. Keys are raydcp's flat dotted FQNs, which are the
FQNs DCP itself gives a nested state dict, so ``dcp.load`` of the nested dict finds them.

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
import os
import warnings
from typing import Any

import torch

from ..codec import dtype_from_name, dtype_name, is_plain_value
from ..engine import save
from ..errors import CheckpointError
from ..planner.tiling import piece_problems
from ..storage import CheckpointStorage
from ._io import DEFAULT_BUDGET, ConvertResult, Destination, Progress, TensorSource
from .dcp_pickle import read_dcp_metadata

__all__ = ["to_torch_dcp", "from_torch_dcp"]


def to_torch_dcp(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                 budget_bytes: int = DEFAULT_BUDGET, progress: Progress | None = None) -> ConvertResult:
    """Write the raydcp checkpoint ``src`` as a torch DCP checkpoint at ``dst``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    source = TensorSource(src, storage_options, budget_bytes=budget_bytes)
    out = Destination(dst, storage_options)
    out.check_free(directory=True, overwrite=overwrite)
    md = source.metadata
    order = source.keys
    groups = source.groups(order)
    group_of = {k: i for i, g in enumerate(groups) for k in g}
    total, done = source.nbytes(), 0
    cache: dict[str, torch.Tensor] = {}

    def fetch(key: str) -> torch.Tensor:
        nonlocal cache, done
        if key not in cache:
            cache = {}  # drop the previous group before loading the next; torch.save leaves
            gc.collect(1)  # reference cycles that keep the tensors DCP wrote alive until collected
            cache = source.load_group(groups[group_of[key]])
        t = cache.pop(key)
        done += t.numel() * t.element_size()
        if progress:
            progress(done, total)
        return t

    class _LazyPlanner(DefaultSavePlanner):
        def resolve_data(self, write_item):
            if write_item.index.fqn in group_of:
                return fetch(write_item.index.fqn)
            return super().resolve_data(write_item)

    state: dict[str, Any] = {
        k: torch.empty(md.tensors[k].shape, dtype=dtype_from_name(md.tensors[k].dtype), device="meta") for k in order
    }
    state.update(md.values)
    # one file per tensor: DCP keeps every tensor of a file alive until the file is closed
    if out.local:
        out.makedirs()
        writer = dcp.FileSystemWriter(out.path, single_file_per_rank=False)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(out.url, single_file_per_rank=False, **(storage_options or {}))
    if progress:
        progress(0, total)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, storage_writer=writer, planner=_LazyPlanner())
    except CheckpointError:
        raise
    except Exception as exc:
        raise CheckpointError(f"torch DCP could not write {out.url}: {_describe(exc)}") from exc
    files = sorted(p.rsplit("/", 1)[-1] for p in out.fs.ls(out.path, detail=False))
    return ConvertResult(str(src), out.url, "torch-dcp", len(order), len(md.values), total, files)


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:500]}" if text else type(exc).__name__


def from_torch_dcp(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                   progress: Progress | None = None) -> ConvertResult:
    """Save the torch DCP checkpoint ``src`` as a raydcp checkpoint at ``dst``."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    storage = CheckpointStorage(src, storage_options)
    md = read_dcp_metadata(storage)
    Destination(dst, storage_options).check_free(directory=True, overwrite=overwrite)
    records = {(idx.fqn, tuple(idx.offset) if idx.offset is not None else None): info
               for idx, info in md.storage_data.items()}
    result = ConvertResult(storage.url, os.fspath(dst), "raydcp")
    entries = sorted(md.state_dict_metadata.items())
    total = sum(e.size.numel() * e.properties.dtype.itemsize
                for _, e in entries if isinstance(e, TensorStorageMetadata))
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
    written = save(_nest(flat, md.planner_data), dst, storage_options=storage_options)
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
