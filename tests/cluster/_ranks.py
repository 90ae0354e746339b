"""A rank actor for the multi-node tests: saves and loads its row block of a few tensors.

Lives in an importable module (not a test file) so Ray workers can import it by reference.
"""
from __future__ import annotations

import threading

import numpy as np
import ray
import torch

import raydcp

ROWS, COLS = 24, 64  # a (24, 64) float32 "weight": 6 KiB; rows split over the ranks


def full_state(step: int) -> dict[str, torch.Tensor]:
    """The global tensors of training step ``step`` (every value differs between steps)."""
    g = torch.Generator().manual_seed(1000 + step)
    return {"w": torch.randn(ROWS, COLS, generator=g), "b": torch.randn(COLS, generator=g),
            "e": torch.arange(ROWS * 3, dtype=torch.int64).reshape(ROWS, 3) * (step + 1)}


def rows(rank: int, world: int) -> tuple[int, int]:
    per = -(-ROWS // world)
    return min(rank * per, ROWS), min((rank + 1) * per, ROWS)


class MemRank:
    """One rank; ``save``/``load`` run a collective operation of group ``name``."""

    def __init__(self):
        self._gate = threading.Event()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def _state(self, rank: int, world: int, full: dict[str, torch.Tensor]) -> dict:
        lo, hi = rows(rank, world)
        return {
            "w": raydcp.Shard(full["w"][lo:hi].clone(), (lo, 0), tuple(full["w"].shape)),
            "e": raydcp.Shard(full["e"][lo:hi].clone(), (lo, 0), tuple(full["e"].shape)),
            "b": full["b"].clone(),
            "step": 0,
        }

    def save(self, name: str, rank: int, world: int, ckpt: str, step: int, options: dict | None,
             timeout_s: float = 60.0, gated: bool = False):
        if gated:
            self._gate.wait()
        state = self._state(rank, world, full_state(step))
        state["step"] = step
        group = raydcp.Group(name, rank, world, timeout_s=timeout_s)
        md = raydcp.save(state, ckpt, group=group, storage_options=options)
        return sorted(md.files)

    def open_gate(self):
        self._gate.set()

    def load(self, name: str, rank: int, world: int, ckpt: str, options: dict | None = None,
             timeout_s: float = 60.0) -> dict[str, np.ndarray]:
        lo, hi = rows(rank, world)
        state = {
            "w": raydcp.Shard(torch.zeros(hi - lo, COLS), (lo, 0), (ROWS, COLS)),
            "e": raydcp.Shard(torch.zeros(hi - lo, 3, dtype=torch.int64), (lo, 0), (ROWS, 3)),
            "b": torch.zeros(COLS),
            "step": -1,
        }
        group = raydcp.Group(name, rank, world, timeout_s=timeout_s)
        raydcp.load(state, ckpt, group=group, storage_options=options)
        return {"w": state["w"].tensor.numpy().copy(), "e": state["e"].tensor.numpy().copy(),
                "b": state["b"].numpy().copy(), "step": state["step"]}

    def async_save(self, name: str, rank: int, world: int, ckpt: str, step: int, timeout_s: float = 60.0):
        state = self._state(rank, world, full_state(step))
        state["step"] = step
        group = raydcp.Group(name, rank, world, timeout_s=timeout_s)
        future = raydcp.async_save(state, ckpt, group=group)
        for t in state.values():  # staged: later in-place updates do not leak into the checkpoint
            if isinstance(t, raydcp.Shard):
                t.tensor.add_(1)
        return sorted(future.result(timeout=timeout_s * 2).files)

    def pipeline_save(self, name: str, rank: int, world: int, tiers: list, ckpt: str, step: int,
                      timeout_s: float = 120.0):
        """Save through a CheckpointPipeline (Ray driver) as rank ``rank``; rank 0 returns the
        pipeline's final status (a dict), the others the committed file names."""
        from raydcp.pipeline import CheckpointPipeline

        state = self._state(rank, world, full_state(step))
        state["step"] = step
        pipe = CheckpointPipeline(tiers, driver="ray", resume=False, async_save=False)
        try:
            handle = pipe.save(state, ckpt, group=raydcp.Group(name, rank, world, timeout_s=timeout_s))
            if rank == 0:
                return handle.wait(timeout=timeout_s * 4).to_dict()
            return sorted(handle.result(timeout=timeout_s).files)
        finally:
            pipe.close(wait=False)
