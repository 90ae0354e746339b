"""Conversion between raydcp checkpoints and other formats.

- :func:`to_torch_dcp` / :func:`from_torch_dcp`: torch.distributed.checkpoint's FileSystemWriter
  format (``.metadata`` + ``.distcp`` files); DCP's metadata pickle is only ever read through a
  restricted unpickler (:mod:`raydcp.convert.dcp_pickle`).
- :func:`to_safetensors`: Hugging Face style shards plus ``model.safetensors.index.json``.
- :func:`to_torch_save`: one ``torch.save`` file of a flat ``{fqn: tensor or plain value}`` dict.

Every function returns a :class:`ConvertResult` and raises only :class:`raydcp.CheckpointError`.
Memory: the exports to DCP and safetensors hold one bounded group of tensors (one shard) at a
time; ``to_torch_save`` and ``from_torch_dcp`` hold the whole checkpoint, because ``torch.save``
and ``raydcp.save`` take a whole state dict at once.
"""
from ._io import ConvertResult, TensorSource, parse_size
from .files import to_safetensors, to_torch_save
from .torch_dcp import from_torch_dcp, to_torch_dcp

__all__ = ["ConvertResult", "TensorSource", "parse_size", "to_torch_dcp", "from_torch_dcp",
           "to_safetensors", "to_torch_save", "FORMATS"]

FORMATS = ("torch-dcp", "safetensors", "torch-save")
