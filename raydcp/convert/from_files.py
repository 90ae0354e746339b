"""Imports from single-process file formats into a raydcp checkpoint: safetensors and torch.save.

``from_safetensors``: a Hugging Face model folder (``model.safetensors.index.json`` naming the
shards, or every ``*.safetensors`` file of the folder when there is no index) or one
``.safetensors`` file. Each file's header is checked as strictly as the safetensors library checks
it (:mod:`raydcp.convert._st_header`) before any tensor is built; the plain values an export by
:func:`raydcp.convert.to_safetensors` stored under ``raydcp_values`` come back as plain values.

``from_torch_save``: one ``torch.save`` file, read with ``torch.load(weights_only=True)`` (nothing
but tensors and plain containers is unpickled); it must hold a dict.

Both save in this process (one participant), taking the whole state at once: memory is about the
checkpoint's size. Both take a :class:`~raydcp.convert.keys.KeySelection`.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any

import torch

from ..codec import decode_value, dtype_from_name
from ..engine import save_with
from ..errors import CheckpointDamagedError, CheckpointError
from ..options import SaveOptions
from ..transport import LocalTransport
from ._io import ConvertResult, Destination, Progress
from ._st_header import parse_header, strict_json
from .files import INDEX_NAME, VALUES_KEY
from .keys import KeySelection

__all__ = ["from_safetensors", "from_torch_save"]

# safetensors' dtype names -> torch
_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
              "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64}


def _shards(src: Destination) -> list[str]:
    """The safetensors files of ``src`` (a file, or a folder with or without its index)."""
    fs, path = src.fs, src.path
    with src.guard("read"):
        if fs.isfile(path):
            return [path]
        if not fs.isdir(path):
            raise CheckpointError(f"no safetensors file or folder at {src.url}: check the path")
        if fs.exists(src.join(INDEX_NAME)):
            index = _json(fs.cat_file(src.join(INDEX_NAME)), src.display(src.join(INDEX_NAME)))
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise CheckpointError(f"{src.display(src.join(INDEX_NAME))}: no weight_map of key -> file name")
            names = sorted(set(weight_map.values()))
            bad = [n for n in names if "/" in n or n in ("", ".", "..")]
            if bad:
                raise CheckpointError(f"{src.display(src.join(INDEX_NAME))}: shard names outside the folder: {bad[:3]}")
            return [src.join(n) for n in names]
        files = sorted(p for p in fs.ls(path, detail=False) if p.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{src.url} holds no .safetensors file and no {INDEX_NAME}")
    return files


def _json(data: bytes, where: str) -> dict:
    try:
        value = strict_json(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointDamagedError(f"{where}: not UTF-8 text ({exc.reason} at byte {exc.start})", file=where) \
            from None
    except ValueError as exc:
        raise CheckpointDamagedError(f"{where}: not valid JSON ({exc})", file=where) from None
    if not isinstance(value, dict):
        raise CheckpointDamagedError(f"{where}: not a JSON object", file=where)
    return value


def _read_shard(src: Destination, path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """The tensors of one safetensors file and its ``__metadata__``, the header checked first."""
    where = src.display(path)
    with src.guard("read"):
        data = src.fs.cat_file(path)
    entries, meta, data_start = parse_header(data, where)
    unsupported = [e for e in entries if e.dtype not in _ST_DTYPES]
    if unsupported:
        e = unsupported[0]
        raise CheckpointError(f"{where}: tensor {e.name!r} has dtype {e.dtype}, which raydcp cannot store "
                              f"(it stores {', '.join(_ST_DTYPES)}); convert that tensor first or leave the file out")
    body = memoryview(data)[data_start:]
    out: dict[str, torch.Tensor] = {}
    for e in entries:
        dtype = _ST_DTYPES[e.dtype]
        out[e.name] = torch.frombuffer(bytearray(body[e.begin:e.end]), dtype=torch.uint8).view(dtype) \
            .reshape(e.shape) if e.end > e.begin else torch.empty(e.shape, dtype=dtype)
    return out, meta


def _apply(flat: dict[str, Any], select: KeySelection) -> tuple[dict[str, Any], int]:
    names = select.names(flat)
    out = {}
    for key, new in names.items():
        v = flat[key]
        if isinstance(v, torch.Tensor):
            dtype = select.cast(key, str(v.dtype).removeprefix("torch."))
            v = v if dtype_from_name(dtype) == v.dtype else v.to(dtype_from_name(dtype))
        out[new] = v
    return out, len(flat) - len(names)


def from_safetensors(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                     progress: Progress | None = None, select: KeySelection | None = None,
                     options: SaveOptions | None = None) -> ConvertResult:
    """Save the safetensors file or folder ``src`` as a raydcp checkpoint at ``dst`` (with ``options``)."""
    source = Destination(src, storage_options)
    shards = _shards(source)
    Destination(dst, storage_options).check_free(directory=True, overwrite=overwrite)
    flat: dict[str, Any] = {}
    values: dict[str, Any] = {}
    done = 0
    with source.guard("look up"):
        sizes = [source.fs.size(p) or 0 for p in shards]
    total = sum(sizes)
    if progress:
        progress(0, total)
    for path, size in zip(shards, sizes):
        tensors, meta = _read_shard(source, path)
        dup = sorted(set(tensors) & set(flat))
        if dup:
            raise CheckpointError(f"{source.display(path)}: {dup[0]} is also in another shard")
        flat.update(tensors)
        if isinstance(meta.get(VALUES_KEY), str):
            try:
                values.update({k: decode_value(v) for k, v in json.loads(meta[VALUES_KEY]).items()})
            except Exception as exc:
                raise CheckpointError(f"{source.display(path)}: unreadable {VALUES_KEY} ({exc})") from None
        done += size
        if progress:
            progress(done, total)
    values = {k: v for k, v in values.items() if k not in flat}
    state, dropped = _apply({**flat, **values}, select or KeySelection())
    return _save(source.url, dst, state, storage_options, dropped, options)


def from_torch_save(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                    progress: Progress | None = None, select: KeySelection | None = None,
                    options: SaveOptions | None = None) -> ConvertResult:
    """Save the dict in the ``torch.save`` file ``src`` as a raydcp checkpoint at ``dst`` (with ``options``)."""
    source = Destination(src, storage_options)
    with source.guard("read"):
        if not source.fs.isfile(source.path):
            raise CheckpointError(f"no torch.save file at {source.url}: check the path")
        data = source.fs.cat_file(source.path)
    Destination(dst, storage_options).check_free(directory=True, overwrite=overwrite)
    try:
        obj = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as exc:  # never unpickled unrestricted
        raise CheckpointError(f"{source.url}: not loadable with torch.load(weights_only=True): "
                              f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{source.url} holds a {type(obj).__name__}, not a state dict")
    if progress:
        progress(len(data), len(data))
    flat = _flatten(obj)
    state, dropped = _apply(flat, select or KeySelection())
    return _save(source.url, dst, state, storage_options, dropped, options)


def _flatten(obj: dict, prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys (what raydcp.save does too), so key filters see every FQN."""
    out: dict[str, Any] = {}
    for k, v in obj.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _save(src_url: str, dst, state: dict[str, Any], storage_options: dict | None, dropped: int,
          options: SaveOptions | None = None) -> ConvertResult:
    written = save_with(LocalTransport(), state, os.fspath(dst), storage_options=storage_options, options=options)
    return ConvertResult(src_url, str(dst), "raydcp", len(written.tensors), len(written.values), written.total_bytes,
                         sorted(written.files), dropped=dropped)
