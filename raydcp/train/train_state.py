"""``TrainState``: the whole training state of one rank, as one Stateful object.

Saved keys (under the TrainState's own key in the state dict, e.g. ``train.``):

- ``model.<fqn>`` and ``optim.state.<fqn>.<name>``, ``optim.param_groups``: the model and the
  optimizer are Module and Optimizer leaves of the state dict :meth:`TrainState.state_dict`
  returns, so raydcp keeps them as it keeps any such leaves (:mod:`raydcp.state_modules`:
  torch.distributed.checkpoint.state_dict's canonical FQNs, DTensor shards under FSDP2, a fresh
  optimizer's state initialised before a load, and set_state_dict applied after it);
- ``scheduler.*``: the LR scheduler's ``state_dict()`` (plain values);
- ``progress.step``, ``progress.samples_seen``, ``progress.seed``: plain ints;
- ``rng.*``: one row per rank of each generator table (:mod:`raydcp.train.rng`); left out while
  :attr:`TrainState.save_rng` is False (an emergency save of survivors: the lost ranks' rows cannot
  be held by the others), and a restore from such a checkpoint re-derives every rank's RNG.

What each part becomes when the world size changes (N saved -> M loading):

- model and optimizer tensors are resharded by raydcp to the M-rank layout;
- the scheduler, ``step`` and ``seed`` are global and load unchanged;
- the data position is a *global* sample count: ``samples_seen`` samples of the
  global sample order have been consumed; :meth:`TrainState.batch_range` gives
  each rank its part of the next global batch, for whatever M;
- RNG: with M == N each rank continues its own streams exactly; otherwise every
  rank re-seeds from ``derive_seed(seed, step, rank)``.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError
from ..metadata import Metadata
from . import rng
from ._context import rank_and_world

__all__ = ["TrainState"]


@dataclass(frozen=True)
class _RestorePlan:
    same_world: bool
    tables: dict[str, tuple[str, tuple[int, ...]]]
    python_version: bool


class TrainState:
    """Model, optimizer, LR scheduler, step, data position and RNG of one rank.

    Put it in the state dict passed to :func:`raydcp.train.save` / ``restore``
    (``{"train": state}``) or pass it directly. ``step`` and ``samples_seen`` are
    yours to advance (or call :meth:`advance` once per optimizer step).

    Args:
        model: the module (plain, DDP or FSDP2 ``fully_shard``-ed).
        optimizer: its optimizer.
        scheduler: an LR scheduler with ``state_dict()``/``load_state_dict()``, or None.
        seed: the run's seed; also the root of re-derived RNG streams after a resize.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any = None,
                 *, seed: int = 0):
        if not isinstance(model, torch.nn.Module):
            raise CheckpointError(f"TrainState: model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise CheckpointError(f"TrainState: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if scheduler is not None and not callable(getattr(scheduler, "state_dict", None)):
            raise CheckpointError(f"TrainState: scheduler {type(scheduler).__name__} has no state_dict()")
        # torch's state-dict helpers take seconds to import the first time: pay that here, at
        # set-up, rather than inside the first checkpoint's stall
        importlib.import_module("torch.distributed.checkpoint.state_dict")

        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.seed = int(seed)
        self.step = 0
        self.samples_seen = 0
        # how the last restore set the RNG: None (not restored), "exact" or "derived"
        self.rng_restored: str | None = None
        self.save_rng = True  # False: a save leaves the per-rank RNG rows out (module doc)
        self._plan: _RestorePlan | None = None

    # -- data position --------------------------------------------------------
    def batch_range(self, global_batch_size: int) -> range:
        """This rank's global sample positions in the next global batch.

        The batch ``[samples_seen, samples_seen + global_batch_size)`` is split in
        rank order, as evenly as possible. Training is independent of the world size
        when every rank gets the same count (``global_batch_size`` divisible by M).
        """
        rank, world = rank_and_world()
        base, rem = divmod(int(global_batch_size), world)
        start = self.samples_seen + rank * base + min(rank, rem)
        return range(start, start + base + (1 if rank < rem else 0))

    def advance(self, global_batch_size: int) -> None:
        """Count one optimizer step that consumed ``global_batch_size`` samples."""
        self.step += 1
        self.samples_seen += int(global_batch_size)

    def reseed(self) -> int:
        """Seed this rank's generators from ``(seed, step, rank)``; returns the derived seed."""
        rank, _ = rank_and_world()
        return rng.reseed(self.seed, self.step, rank)

    # -- restore protocol (called by raydcp.train.restore) ---------------------
    def prepare_restore(self, md: Metadata, prefix: str) -> None:
        """Decide, from the checkpoint's metadata, which RNG rows this rank will read."""
        _, world = rank_and_world()
        tables = {}
        for name in rng.TABLES:
            meta = md.tensors.get(f"{prefix}rng.{name}")
            if meta is not None:
                tables[name] = (meta.dtype, tuple(meta.shape))
        self._plan = _RestorePlan(md.world_size == world, tables, f"{prefix}rng.python_version" in md.values)

    # -- Stateful -------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The state as raydcp flattens it: the model and optimizer themselves (Module and Optimizer
        leaves, expanded and applied by raydcp), the rest as tensors and plain values."""
        rank, world = rank_and_world()
        sd: dict[str, Any] = {
            "model": self.model,
            "optim": self.optimizer,
            "progress": {"step": self.step, "samples_seen": self.samples_seen, "seed": self.seed},
        }
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        plan = self._plan
        if plan is None:  # saving
            if self.save_rng:
                sd["rng"] = rng.capture(rank, world)
        else:
            tables = rng.row_request(rank, world, plan.tables) if plan.same_world else rng.empty_request(plan.tables)
            if plan.python_version:
                tables["python_version"] = 0
            sd["rng"] = tables
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The rest of a restore (raydcp has already loaded the model and optimizer leaves)."""
        plan, self._plan = self._plan, None
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sd["scheduler"])
        progress = sd["progress"]
        self.step, self.samples_seen, self.seed = (int(progress["step"]), int(progress["samples_seen"]),
                                                   int(progress["seed"]))
        if plan is None or (plan.same_world and plan.tables):  # plan None: a plain raydcp.load
            rng.apply(sd["rng"], sd["rng"].get("python_version", 3))
            self.rng_restored = "exact"
        else:
            self.reseed()
            self.rng_restored = "derived"
