"""Conversion between raydcp checkpoints and other formats.

- :func:`to_torch_dcp` / :func:`from_torch_dcp`: torch.distributed.checkpoint's FileSystemWriter
  format (``.metadata`` + ``.distcp`` files); DCP's metadata pickle is only ever read through a
  restricted unpickler (:mod:`raydcp.convert.dcp_pickle`).
- :func:`to_safetensors` / :func:`from_safetensors`: Hugging Face style shards plus
  ``model.safetensors.index.json`` (or one ``.safetensors`` file).
- :func:`to_torch_save`: one ``torch.save`` file of a flat ``{fqn: tensor or plain value}`` dict.

The exports and :func:`from_safetensors` take a :class:`~raydcp.convert.keys.KeySelection`
(drop optimizer state or prefixes, strip a prefix, cast the model's dtype), the one reshard uses.
:mod:`raydcp.convert.detect` recognises these formats where a raydcp checkpoint was expected.

Every function returns a :class:`ConvertResult` and raises only :class:`raydcp.CheckpointError`.
Memory: the exports to DCP and safetensors hold one bounded group of tensors (one shard) at a
time; ``to_torch_save`` and ``from_torch_dcp`` hold the whole checkpoint, because ``torch.save``
and ``raydcp.save`` take a whole state dict at once.
"""
from __future__ import annotations

from ..lazy import lazy_attribute

__all__ = ["ConvertResult", "TensorSource", "parse_size", "to_torch_dcp", "from_torch_dcp", "from_safetensors",
           "from_torch_save",
           "to_safetensors", "to_torch_save", "KeySelection", "FORMATS"]

FORMATS = ("torch-dcp", "safetensors", "torch-save")

# loaded on first use: raydcp.convert.keys, .detect and .sizes need no torch
_LAZY = {"ConvertResult": "._io", "TensorSource": "._io", "parse_size": ".sizes", "to_safetensors": ".files",
         "to_torch_save": ".files", "from_safetensors": ".from_files",
         "from_torch_save": ".from_files", "to_torch_dcp": ".torch_dcp",
         "from_torch_dcp": ".torch_dcp", "KeySelection": ".keys"}


def __getattr__(name: str):
    return lazy_attribute(__name__, _LAZY, name)
