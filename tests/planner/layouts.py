"""Layouts used by planner tests: which box of a global tensor each rank holds, in the
layouts of :mod:`raydcp.planner.layouts` and in grids of blocks (which no ShardGroup uses)."""
from __future__ import annotations

import torch

from raydcp.planner.layouts import chunk_bounds  # noqa: F401 (the tests import it from here)


def rows(shape, world, rank):
    lo, n = chunk_bounds(shape[0], world, rank)
    return (lo, *([0] * (len(shape) - 1))), (n, *shape[1:])


def cols(shape, world, rank):
    lo, n = chunk_bounds(shape[1], world, rank)
    return (0, lo, *([0] * (len(shape) - 2))), (shape[0], n, *shape[2:])


def replicated(shape, world, rank):
    return tuple(0 for _ in shape), tuple(shape)


def blocks(grid):
    def layout(shape, world, rank):
        assert world == grid[0] * grid[1]
        r, c = divmod(rank, grid[1])
        lo0, n0 = chunk_bounds(shape[0], grid[0], r)
        lo1, n1 = chunk_bounds(shape[1], grid[1], c)
        return (lo0, lo1, *([0] * (len(shape) - 2))), (n0, n1, *shape[2:])
    return layout


def piece(t: torch.Tensor, offsets, sizes) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offsets, sizes)):
        t = t.narrow(d, o, n)
    return t
