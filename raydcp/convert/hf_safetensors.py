"""Export to Hugging Face style safetensors shards.

``model-00001-of-0000N.safetensors`` files of at most ``max_shard_bytes`` each (a
tensor larger than that gets a shard of its own) and ``model.safetensors.index.json`` mapping
every key to its shard, as ``transformers``' ``save_pretrained`` writes them (the index is
written even for one shard). Shards are planned from the metadata, then each shard's tensors are
loaded with one ``raydcp.load`` and written before the next: memory is about one shard.
Plain values cannot be tensors in safetensors: they go, as one JSON object of raydcp's tagged
plain-value encoding (``raydcp.codec.encode_value``), into the first shard's metadata and the
index's ``metadata`` under ``raydcp_values``.
"""
from __future__ import annotations

import json

from ..codec import dtype_from_name, encode_value
from ..errors import CheckpointError
from ._dest import ConvertResult, Destination
from ._source import Progress, TensorSource, tensor_nbytes

__all__ = ["to_safetensors", "INDEX_NAME", "VALUES_KEY", "shard_name"]

INDEX_NAME = "model.safetensors.index.json"
VALUES_KEY = "raydcp_values"


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def _plan_shards(source: TensorSource, max_bytes: int) -> list[list[str]]:
    shards: list[list[str]] = []
    size = 0
    for key in source.keys:
        n = tensor_nbytes(source.metadata.tensors[key])
        if not shards or (shards[-1] and size + n > max_bytes):
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += n
    return shards


def to_safetensors(src, dst, *, max_shard_bytes: int = 5 * 10**9, storage_options: dict | None = None,
                   overwrite: bool = False, progress: Progress | None = None) -> ConvertResult:
    """Write the raydcp checkpoint ``src`` as safetensors shards plus an index in directory ``dst``."""
    import safetensors.torch as st

    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise CheckpointError(f"max_shard_bytes must be a positive integer, got {max_shard_bytes!r}")
    source = TensorSource(src, storage_options)
    md = source.metadata
    supported = set(getattr(st, "_TYPES", {}).values())  # safetensors' dtype table, where it has one
    bad = [f"{k} ({t.dtype})" for k, t in md.tensors.items()
           if supported and dtype_from_name(t.dtype) not in supported]
    if bad:
        raise CheckpointError(f"safetensors cannot store the dtype of {len(bad)} tensor(s): {', '.join(sorted(bad)[:10])}")
    out = Destination(dst, storage_options)
    out.check_free(directory=True, overwrite=overwrite)
    out.makedirs()

    shards = _plan_shards(source, max_shard_bytes)
    n = len(shards) or 1
    values = json.dumps({k: encode_value(v) for k, v in md.values.items()}, separators=(",", ":"))
    result = ConvertResult(str(src), out.url, "safetensors", len(md.tensors), len(md.values), source.nbytes())
    weight_map: dict[str, str] = {}
    total, done = result.nbytes, 0
    if progress:
        progress(0, total)
    for i, keys in enumerate(shards or [[]], start=1):
        name = shard_name(i, n)
        tensors = source.load_group(keys)
        meta = {"format": "pt"}
        if i == 1 and md.values:
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
        weight_map.update({k: name for k in keys})
        result.files.append(name)
        done += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
        if progress:
            progress(done, total)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    if md.values:
        index["metadata"][VALUES_KEY] = {k: encode_value(v) for k, v in md.values.items()}
    out.write_bytes(out.join(INDEX_NAME), (json.dumps(index, indent=2) + "\n").encode())
    result.files.append(INDEX_NAME)
    return result
