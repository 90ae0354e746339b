"""How a ShardGroup splits each global tensor among its actors (pure functions, no Ray).

- ``"dim0"`` (default): FSDP2-style, ``torch.chunk`` pieces along dimension 0:
  pieces of ``ceil(n / world)`` rows, so trailing ranks may hold empty pieces.
- ``"dim1"``: the same along dimension 1 for tensors of 2 or more dimensions
  (tensor-parallel style); 1-D tensors fall back to dimension 0.
- ``"replicated"``: every rank holds the whole tensor (a replica, written once).

Scalars (0-D tensors) are replicated under every layout. Pieces are
``raydcp.Shard``; replicated tensors are plain tensors.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from ..codec import dtype_from_name
from ..errors import CheckpointError
from ..state import Shard

__all__ = ["LAYOUTS", "check_layout", "piece_box", "take_piece", "empty_state"]

LAYOUTS = ("dim0", "dim1", "replicated")

# fqn -> (global shape, dtype name)
Specs = Mapping[str, tuple[tuple[int, ...], str]]


def check_layout(layout: Any) -> str:
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def _shard_dim(shape: tuple[int, ...], layout: str) -> int | None:
    if layout == "replicated" or len(shape) == 0:
        return None
    return 1 if layout == "dim1" and len(shape) >= 2 else 0


def piece_box(shape: tuple[int, ...], layout: str, rank: int, world_size: int):
    """``(offsets, sizes)`` of ``rank``'s piece, or None when every rank holds the whole tensor."""
    d = _shard_dim(tuple(shape), check_layout(layout))
    if d is None:
        return None
    n = shape[d]
    step = -(-n // world_size)  # torch.chunk's piece size
    lo = min(rank * step, n)
    hi = min(lo + step, n)
    offsets = tuple(lo if i == d else 0 for i in range(len(shape)))
    sizes = tuple(hi - lo if i == d else s for i, s in enumerate(shape))
    return offsets, sizes


def take_piece(full: torch.Tensor, layout: str, rank: int, world_size: int):
    """``rank``'s part of ``full`` under ``layout``: a Shard (a copy), or ``full`` itself when replicated."""
    box = piece_box(tuple(full.shape), layout, rank, world_size)
    if box is None:
        return full
    t = full
    for d, (o, n) in enumerate(zip(*box)):
        t = t.narrow(d, o, n)
    return Shard(t.clone(), box[0], tuple(full.shape))


def empty_state(specs: Specs, value_keys: Iterable[str], layout: str, rank: int, world_size: int,
                device: torch.device | str = "cpu") -> dict:
    """A flat state dict to load into: uninitialized pieces for ``rank``, None for each plain value."""
    state: dict[str, Any] = {}
    for fqn, (shape, dtype) in specs.items():
        dt = dtype_from_name(dtype)
        box = piece_box(tuple(shape), layout, rank, world_size)
        if box is None:
            state[fqn] = torch.empty(tuple(shape), dtype=dt, device=device)
        else:
            state[fqn] = Shard(torch.empty(box[1], dtype=dt, device=device), box[0], tuple(shape))
    for key in value_keys:
        state[key] = None
    return state
