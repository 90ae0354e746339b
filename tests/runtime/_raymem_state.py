"""A two-rank state saved to raymem:// by rank threads, for the memory tier's tests on one node."""
from __future__ import annotations

import uuid

import torch

import raydcp
from raydcp.engine.save import save_with

from ..engine.helpers import run_ranks

ROWS, COLS = 64, 128


def raymem_fs():
    import fsspec

    return fsspec.filesystem("raymem")


def this_node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


def two_rank_state(rank: int, seed: int) -> dict:
    """Rank ``rank``'s half (by rows) of a ROWS x COLS tensor drawn from ``seed``, and the seed."""
    w = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(seed))
    lo = rank * ROWS // 2
    return {"w": raydcp.Shard(w[lo:lo + ROWS // 2].clone(), (lo, 0), (ROWS, COLS)), "seed": seed}


def save_two_ranks(url: str, seed: int, options: dict | None = None) -> list:
    """Save the two ranks' state to ``url`` as threads; returns each rank's error (None where it saved)."""
    return run_ranks(2, lambda t: save_with(t, two_rank_state(t.rank, seed), url, options or {}), timeout_s=120)[1]


def fresh_name(ray_session, prefix: str):
    """A raymem NAME no test used, on a node whose holder answers; removed afterwards (a fixture's body)."""
    from raydcp.runtime.memstore import placement

    ray_session.get(placement.holder(this_node()).ping.remote())
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    yield name
    raymem_fs().rm(name, recursive=True)
