"""A ShardGroup's pieces as tensors: cut from a whole tensor, or allocated to load into.

Which box each rank holds is :mod:`raydcp.planner.layouts` (pure); this module only makes the
tensors. Pieces are ``raydcp.Shard``; replicated tensors are plain tensors.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch

from ...codec import dtype_from_name
from ...planner.layouts import Specs, piece_box
from ...state import Shard

__all__ = ["take_piece", "empty_state"]


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
