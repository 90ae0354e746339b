"""A rank actor for the survivors-save tests on several nodes (importable by Ray workers)."""
from __future__ import annotations

import threading

import ray
import torch

import raydcp

KEYS = [f"layer{i}" for i in range(8)]


def replicated(step: int) -> dict:
    """DDP-style: every rank holds all of it (several tensors, so the plan spreads their writers)."""
    return {**{k: torch.full((4, 4), float(i + 100 * step)) for i, k in enumerate(KEYS)}, "step": step}


def sharded(rank: int, world: int, step: int) -> dict:
    """FSDP-style: each rank holds only its rows of ``w`` (8 rows), ``rank + 100 * step`` at 4 ranks."""
    n = 8 // world
    return {"w": raydcp.Shard(torch.full((n, 4), float(rank + 100 * step)), (n * rank, 0), (8, 4)), "step": step}


class SurvivorRank:
    def __init__(self, rank: int):
        self.rank = rank
        self.holding = threading.Event()

    def ready(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def save(self, name: str, path: str, step: int, *, world: int = 4, survivors: bool = True,
             shard: bool = False, hold: bool = False):
        state = sharded(self.rank, world, step) if shard else replicated(step)
        if hold:  # stops (until its node is removed) once the save has its plan, before it writes
            import raydcp.engine.survivors as engine

            def stop(*args, **kwargs):
                self.holding.set()
                threading.Event().wait()

            engine.write_rank_files = stop
        try:
            md = raydcp.save(state, path, group=raydcp.Group(name, self.rank, world, timeout_s=120),
                             options=raydcp.SaveOptions(survivors=survivors))
        except raydcp.CheckpointError as exc:
            return exc
        return list(md.extra.get("lost_ranks") or [])

    def wait_holding(self, timeout_s: float) -> bool:
        return self.holding.wait(timeout_s)

    def resume(self, name: str, path: str, rank: int, world: int, shard: bool = False):
        """Load ``path`` as rank ``rank`` of ``world`` (the remaining workers); its state."""
        state = sharded(rank, world, 0) if shard else replicated(0)
        state["step"] = None
        raydcp.load(state, path, group=raydcp.Group(name, rank, world, timeout_s=120))
        return {k: (v.tensor if isinstance(v, raydcp.Shard) else v) for k, v in state.items()}
