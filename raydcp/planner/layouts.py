"""Layouts: which box of each global tensor every rank of a group holds (pure: no torch, no Ray).

The one home of the layout arithmetic, used by ``raydcp.ShardGroup`` (which allocates and cuts
pieces with :mod:`raydcp.runtime.shard_group.piece_tensors`) and by the reshard planner (:mod:`raydcp.reshard.plan`):

- ``"dim0"`` (default): FSDP2-style, ``torch.chunk`` pieces along dimension 0:
  pieces of ``ceil(n / world)`` rows, so trailing ranks may hold empty pieces.
- ``"dim1"``: the same along dimension 1 for tensors of 2 or more dimensions
  (tensor-parallel style); 1-D tensors fall back to dimension 0.
- ``"replicated"``: every rank holds the whole tensor (a replica, written once).

Scalars (0-D tensors) are replicated under every layout.
"""
from __future__ import annotations

from typing import Any, Mapping

from ..codec import itemsize
from ..errors import CheckpointError

__all__ = ["LAYOUTS", "Specs", "check_layout", "shard_dim", "chunk_bounds", "piece_box", "reuse_ranks"]

LAYOUTS = ("dim0", "dim1", "replicated")

# fqn -> (global shape, dtype name)
Specs = Mapping[str, tuple[tuple[int, ...], str]]


def check_layout(layout: Any) -> str:
    """``layout`` itself if it is one of :data:`LAYOUTS`, else a CheckpointError listing them."""
    if layout not in LAYOUTS:
        raise CheckpointError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return layout


def shard_dim(shape: tuple[int, ...], layout: str) -> int | None:
    """The dimension ``layout`` splits a tensor of ``shape`` along, or None when it is replicated."""
    if layout == "replicated" or len(shape) == 0:
        return None
    return 1 if layout == "dim1" and len(shape) >= 2 else 0


def chunk_bounds(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(start, length)`` of part ``i`` of ``n`` indices cut in ``parts`` as ``torch.chunk`` does:
    parts of ``ceil(n / parts)``, so trailing parts may be empty."""
    step = -(-n // parts) if n else 0
    lo = min(i * step, n)
    return lo, min(lo + step, n) - lo


def piece_box(shape: tuple[int, ...], layout: str, rank: int, world_size: int):
    """``(offsets, sizes)`` of ``rank``'s piece, or None when every rank holds the whole tensor."""
    shape = tuple(shape)
    d = shard_dim(shape, check_layout(layout))
    if d is None:
        return None
    lo, n = chunk_bounds(shape[d], world_size, rank)
    offsets = tuple(lo if i == d else 0 for i in range(len(shape)))
    sizes = tuple(n if i == d else s for i, s in enumerate(shape))
    return offsets, sizes


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
        total = _numel(shape) * itemsize(dtype)
        if total == 0:
            continue
        keys = []
        for layout, world in ((old_layout, n), (new_layout, m)):
            d = shard_dim(shape, layout)
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
    lo, n = chunk_bounds(length, world, rank)
    return lo, lo + n


def _shared_bytes(total: int, a, len_a: int | None, b, len_b: int | None, same_dim: bool) -> int:
    """Bytes of a tensor of ``total`` bytes held both as piece ``a`` and as piece ``b``."""
    fa = 1.0 if a is None else (a[1] - a[0]) / len_a
    fb = 1.0 if b is None else (b[1] - b[0]) / len_b
    if a is not None and b is not None and same_dim:
        both = max(0, min(a[1], b[1]) - max(a[0], b[0])) / len_a
    else:  # independent dimensions (or a whole tensor on one side): the product of the fractions
        both = fa * fb
    return int(total * both)
