"""Exports to single-process file formats: Hugging Face style safetensors shards, and torch.save.

safetensors: ``model-00001-of-0000N.safetensors`` files of at most ``max_shard_bytes`` each (a
tensor larger than that gets a shard of its own) and ``model.safetensors.index.json`` mapping
every key to its shard, as ``transformers``' ``save_pretrained`` writes them (the index is
written even for one shard). Shards are planned from the metadata, then each shard's tensors are
loaded with one ``raydcp.load`` and written before the next: memory is about one shard.
Plain values cannot be tensors in safetensors: they go, as one JSON object of raydcp's tagged
plain-value encoding (``raydcp.codec.encode_value``), into the first shard's metadata and the
index's ``metadata`` under ``raydcp_values``.

torch-save: one file holding a flat ``{fqn: tensor or plain value}`` dict, which
``torch.load(path, weights_only=True)`` reads. ``torch.save`` takes the whole dict at once, so the
whole checkpoint is in memory while the file is written.
"""
from __future__ import annotations

import json
import re

import torch

from ..codec import dtype_from_name, encode_value
from ..errors import CheckpointError
from ._io import DEFAULT_BUDGET, ConvertResult, Destination, Progress, TensorSource
from .keys import KeySelection

__all__ = ["to_safetensors", "to_torch_save", "INDEX_NAME", "VALUES_KEY", "shard_name"]

INDEX_NAME = "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
VALUES_KEY = "raydcp_values"


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def to_safetensors(src, dst, *, max_shard_bytes: int = 5 * 10**9, storage_options: dict | None = None,
                   overwrite: bool = False, progress: Progress | None = None,
                   select: KeySelection | None = None) -> ConvertResult:
    """Write the raydcp checkpoint ``src`` as safetensors shards plus an index in directory ``dst``
    (the keys ``select`` keeps, renamed and cast as it says)."""
    import safetensors.torch as st

    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    source = TensorSource(src, storage_options, select=select)
    supported = set(getattr(st, "_TYPES", {}).values())  # safetensors' dtype table, where it has one
    bad = [f"{k} ({source.dest_dtype(k)})" for k in source.keys
           if supported and dtype_from_name(source.dest_dtype(k)) not in supported]
    if bad:
        raise CheckpointError(
            f"safetensors cannot store the dtype of {len(bad)} tensor(s): {', '.join(sorted(bad)[:10])}")
    out = Destination(dst, storage_options)
    out.check_free(directory=True, overwrite=overwrite)
    out.makedirs()

    shards = source.groups(source.keys, max_shard_bytes)
    n = len(shards) or 1
    kept = source.values
    values = json.dumps({k: encode_value(v) for k, v in kept.items()}, separators=(",", ":"))
    result = ConvertResult(str(src), out.url, "safetensors", len(source.keys), len(kept), source.nbytes(),
                           dropped=len(source.dropped))
    weight_map: dict[str, str] = {}
    total, done = result.nbytes, 0
    if progress:
        progress(0, total)
    for i, keys in enumerate(shards or [[]], start=1):
        name = shard_name(i, n)
        tensors = source.load_group(keys)
        meta = {"format": "pt"}
        if i == 1 and kept:
            meta[VALUES_KEY] = values
        path = out.join(name)
        try:
            if out.local:
                st.save_file(tensors, path, metadata=meta)
            else:
                out.write_bytes(path, st.save(tensors, metadata=meta))
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"could not write {out.display(path)}: {type(exc).__name__}: {exc}") from exc
        weight_map.update({k: name for k in tensors})
        result.files.append(name)
        done += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if progress:
            progress(done, total)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    if kept:
        index["metadata"][VALUES_KEY] = {k: encode_value(v) for k, v in kept.items()}
    out.write_bytes(out.join(INDEX_NAME), (json.dumps(index, indent=2) + "\n").encode())
    result.files.append(INDEX_NAME)
    _remove_stale_shards(out, set(result.files))
    return result


def _remove_stale_shards(out: Destination, keep: set[str]) -> None:
    """Shards of an earlier export with another shard count would sit beside the new ones."""
    with out.guard("clean up"):
        for path in out.fs.ls(out.path, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if _SHARD.fullmatch(name) and name not in keep:
                out.fs.rm_file(path)


def to_torch_save(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                  budget_bytes: int = DEFAULT_BUDGET, progress: Progress | None = None,
                  select: KeySelection | None = None) -> ConvertResult:
    """Write the raydcp checkpoint ``src`` as one ``torch.save`` file of a flat {fqn: tensor or value} dict."""
    source = TensorSource(src, storage_options, budget_bytes=budget_bytes, select=select)
    out = Destination(dst, storage_options)
    out.check_free(directory=False, overwrite=overwrite)
    flat: dict = dict(source.iter_tensors(progress=progress))
    flat.update(source.values)
    flat = dict(sorted(flat.items()))
    try:
        parent = out.path.rsplit("/", 1)[0] if "/" in out.path else ""
        if parent:
            out.fs.makedirs(parent, exist_ok=True)
        with out.open(out.path, "wb") as f:
            torch.save(flat, f)
    except Exception as exc:
        raise CheckpointError(f"could not write {out.url}: {type(exc).__name__}: {exc}") from exc
    return ConvertResult(str(src), out.url, "torch-save", len(source.keys), len(source.values), source.nbytes(),
                         [out.url], dropped=len(source.dropped))
