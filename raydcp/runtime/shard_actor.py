"""One member of a ShardGroup: holds a flat state dict of pieces and runs collective steps.

A plain class (``raydcp.runtime.actors`` makes it a Ray actor). Every collective
method takes a ``group`` spec ``(name, rank, world_size, timeout_s)`` from the
driver -- a fresh name per operation, so a failed operation never leaves the
next one out of step -- and returns its result, or the ``CheckpointError`` it
raised (as a value: the driver gathers every rank's outcome and raises once).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Iterable

import torch

from ..engine import load as _load
from ..engine import save as _save
from ..engine import transfer as _transfer
from ..errors import CheckpointError
from ..group import Group
from ..state import Shard
from .layouts import Specs, empty_state

__all__ = ["ShardActor"]

GroupSpec = tuple[str, int, int, float]


class ShardActor:
    def __init__(self, rank: int, world_size: int):
        self.rank = rank
        self.world_size = world_size
        # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned, so the first visible one is ours.
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.state: dict[str, Any] = {}

    # -- collective steps (every rank of the group at once) -----------------------------
    def load(self, group: GroupSpec, checkpoint_id: str, fresh: tuple | None, strict: bool,
             storage_options: dict | None):
        """Load into the held state in place, or (``fresh=(specs, value_keys, layout)``) into new pieces."""
        def run():
            state = self._empty(*fresh) if fresh is not None else self.state
            _load(state, checkpoint_id, group=self._group(*group), strict=strict, storage_options=storage_options)
            self.state = state
            return None

        return self._outcome(run)

    def save(self, group: GroupSpec, checkpoint_id: str, storage_options: dict | None):
        """Save the held state; rank 0 returns the Metadata (the others None, to ship it once)."""
        def run():
            md = _save(self.state, checkpoint_id, group=self._group(*group), storage_options=storage_options)
            return md if self.rank == 0 else None

        return self._outcome(run)

    def send(self, group: GroupSpec):
        """Serve the held pieces to a transfer (in-memory reshard) as a source rank."""
        def run():
            _transfer(self.state, None, group=self._group(*group))
            return None

        return self._outcome(run)

    def receive(self, group: GroupSpec, specs: Specs, value_keys: Iterable[str], layout: str):
        """Receive new pieces of ``layout`` from a transfer as a destination rank."""
        def run():
            state = self._empty(specs, value_keys, layout)
            _transfer(None, state, group=self._group(*group))
            self.state = state
            return None

        return self._outcome(run)

    # -- local queries ---------------------------------------------------------------
    def info(self) -> dict:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(self.device),
            "cuda_available": torch.cuda.is_available(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "keys": len(self.state),
        }

    def specs(self) -> tuple[dict, dict]:
        """``({fqn: (global shape, dtype)}, {value key: value})`` of the held state."""
        from ..codec import dtype_name

        specs, values = {}, {}
        for fqn, v in self.state.items():
            if isinstance(v, Shard):
                specs[fqn] = (v.global_shape, dtype_name(v.tensor.dtype))
            elif isinstance(v, torch.Tensor):
                specs[fqn] = (tuple(v.shape), dtype_name(v.dtype))
            else:
                values[fqn] = v
        return specs, values

    def apply(self, fn: Callable, *args) -> Any:
        """Run ``fn(state, *args)`` on this actor's state (inspection, tests, tools)."""
        return fn(self.state, *args)

    # -- helpers -----------------------------------------------------------------------
    def _empty(self, specs: Specs, value_keys: Iterable[str], layout: str) -> dict:
        return empty_state(specs, value_keys, layout, self.rank, self.world_size, self.device)

    def _group(self, name: str, rank: int, world_size: int, timeout_s: float) -> Group:
        """The Group of one operation (subclasses may wrap it, e.g. to inject faults in tests)."""
        return Group(name, rank, world_size, timeout_s=timeout_s)

    @staticmethod
    def _outcome(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CheckpointError as exc:
            return exc
