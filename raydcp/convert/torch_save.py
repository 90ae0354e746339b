"""Export to one ``torch.save`` file holding a flat ``{fqn: tensor or plain value}`` dict.

``torch.load(path, weights_only=True)`` reads it. ``torch.save`` takes the whole dict at once,
so the whole checkpoint is in memory while the file is written.
"""
from __future__ import annotations

import torch

from ..errors import CheckpointError
from ._dest import ConvertResult, Destination
from ._source import DEFAULT_BUDGET, Progress, TensorSource

__all__ = ["to_torch_save"]


def to_torch_save(src, dst, *, storage_options: dict | None = None, overwrite: bool = False,
                  budget_bytes: int = DEFAULT_BUDGET, progress: Progress | None = None) -> ConvertResult:
    """Write the raydcp checkpoint ``src`` as one ``torch.save`` file of a flat {fqn: tensor or value} dict."""
    source = TensorSource(src, storage_options, budget_bytes=budget_bytes)
    md = source.metadata
    out = Destination(dst, storage_options)
    out.check_free(directory=False, overwrite=overwrite)
    flat: dict = dict(source.iter_tensors(progress=progress))
    flat.update(md.values)
    flat = dict(sorted(flat.items()))
    try:
        parent = out.path.rsplit("/", 1)[0] if "/" in out.path else ""
        if parent:
            out.fs.makedirs(parent, exist_ok=True)
        with out.open(out.path, "wb") as f:
            torch.save(flat, f)
    except Exception as exc:
        raise CheckpointError(f"could not write {out.url}: {type(exc).__name__}: {exc}") from exc
    return ConvertResult(str(src), out.url, "torch-save", len(md.tensors), len(md.values), source.nbytes(),
                         [out.url])
