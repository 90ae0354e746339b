"""``raydcp.ShardGroup`` and what it is built of: a group of Ray actors holding a sharded state.

- :mod:`.group`: :class:`ShardGroup`, the driver's object (load, save, reshard, full state dict);
- :mod:`.actor`: :class:`ShardActor`, one member: its pieces and the collective steps it runs;
- :mod:`.members`: starting the actors in placement groups, and ending them with their last group;
- :mod:`.piece_tensors`: a group's pieces as tensors (which box each rank holds is ``raydcp.planner.layouts``);
- ``ShardGroup.reshard``, in memory: :mod:`.group_reshard` (the driver's plan and tasks),
  :mod:`.reshard_steps` (each actor's publish and receive), :mod:`.piece_moves` (the byte copies)
  and :mod:`.rdt` (Ray Direct Transport);
- :mod:`.reshard_job`: reshard jobs of a stored checkpoint (``jobs/reshard.py``), the rounds of
  :mod:`raydcp.reshard` run by the actors of a ShardGroup.

What the group shares with the rest of the runtime stays in :mod:`raydcp.runtime`: the coordinator
host, the Ray transport, the outcome gathering.
"""
from __future__ import annotations

from .actor import ShardActor
from .group import ShardGroup

__all__ = ["ShardGroup", "ShardActor"]
