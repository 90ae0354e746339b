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

__all__ = ["LAYOUTS", "check_layout", "piece_box", "take_piece", "empty_state", "reuse_ranks"]

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


def reuse_ranks(specs: Specs, old_layout: str, n: int, new_layout: str, m: int) -> list[int | None]:
    """For each rank of an ``m``-way ``new_layout``, the rank of the ``n``-way ``old_layout`` whose
    actor should take it (or None: a new actor), so that the most bytes stay where they are.

    Every old rank gets a new rank when ``m >= n``; when shrinking, ``m`` of them do. Pairs are
    taken greedily by the bytes they share (ties: the nearer rank), which is optimal for the
    contiguous pieces of one split dimension and good for a mix.
    """
    check_layout(old_layout)
    check_layout(new_layout)
    shared = [[0] * m for _ in range(n)]
    # Tensors split the same way cost the same: group them by (split dim length, bytes per index).
    groups: dict[tuple, int] = {}
    for shape, dtype in specs.values():
        shape = tuple(shape)
        total = _numel(shape) * dtype_from_name(dtype).itemsize
        if total == 0:
            continue
        keys = []
        for layout, world in ((old_layout, n), (new_layout, m)):
            d = _shard_dim(shape, layout)
            keys.append((None, None) if d is None else (d, shape[d]))
        groups[tuple(keys)] = groups.get(tuple(keys), 0) + total
    for ((d_old, len_old), (d_new, len_new)), total in groups.items():
        for i in range(n):
            a = _extent(len_old, d_old, i, n)
            for j in range(m):
                b = _extent(len_new, d_new, j, m)
                shared[i][j] += _shared_bytes(total, a, len_old, b, len_new, d_old == d_new)
    pairs = sorted(((shared[i][j], -abs(i * m - j * n), i, j) for i in range(n) for j in range(m)), reverse=True)
    taken_old, out = set(), [None] * m
    for _, _, i, j in pairs:
        if i not in taken_old and out[j] is None:
            out[j] = i
            taken_old.add(i)
            if len(taken_old) == min(n, m):
                break
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _extent(length: int | None, dim: int | None, rank: int, world: int) -> tuple[int, int] | None:
    """The index range ``rank`` holds along the split dimension (None: the whole tensor)."""
    if dim is None:
        return None
    step = -(-length // world)
    lo = min(rank * step, length)
    return lo, min(lo + step, length)


def _shared_bytes(total: int, a, len_a: int | None, b, len_b: int | None, same_dim: bool) -> int:
    """Bytes of a tensor of ``total`` bytes held both as piece ``a`` and as piece ``b``."""
    fa = 1.0 if a is None else (a[1] - a[0]) / len_a
    fb = 1.0 if b is None else (b[1] - b[0]) / len_b
    if a is not None and b is not None and same_dim:
        both = max(0, min(a[1], b[1]) - max(a[0], b[0])) / len_a
    else:  # independent dimensions (or a whole tensor on one side): the product of the fractions
        both = fa * fb
    return int(total * both)
