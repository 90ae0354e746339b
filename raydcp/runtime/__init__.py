"""The Ray runtime of raydcp: the Ray transport, the coordinator host and ShardGroup.

With ``raydcp.train``, the only package that imports Ray. Submodules load lazily,
so ``raydcp.runtime.coordinator`` (a plain class) can be used without Ray.

What every group's operations run on (``raydcp.Group``, ShardGroups, Ray Train worker groups):

- :mod:`.coordinator` (one operation's coordinator), :mod:`.coordinator_host` (the cluster's one
  actor running them all) and :mod:`.actors` (where plain classes become Ray actors; finds or
  starts the host);
- :mod:`.ray_transport` (the Transport over Ray), :mod:`.operations` (each group's operations
  numbered per process, and the numbering process's identity), :mod:`.connection` (this
  process's connection to a cluster), :mod:`.outcomes` (every rank's outcome of a task per rank);
- :mod:`.persister` (a rank's background persister actor), :mod:`.train_group` (the Group of a
  Ray Train worker group), :mod:`.pipeline_actor` (the pipeline's driver as an actor).

Packages: :mod:`.shard_group` (``raydcp.ShardGroup``, its actors and in-memory reshard, and the
reshard job run on it) and :mod:`.memstore` (the ``raymem://`` and ``raynode://`` tiers).
"""
from __future__ import annotations

import importlib

__all__ = ["RayTransport", "Coordinator", "ShardGroup", "ShardActor"]

_EXPORTS = {
    "RayTransport": "raydcp.runtime.ray_transport",
    "Coordinator": "raydcp.runtime.coordinator",
    "ShardGroup": "raydcp.runtime.shard_group",
    "ShardActor": "raydcp.runtime.shard_group",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'raydcp.runtime' has no attribute {name!r}")
