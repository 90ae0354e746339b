"""The Ray runtime of raydcp: the Ray transport, the coordinator actor and ShardGroup.

With ``raydcp.train``, the only package that imports Ray. Submodules load lazily,
so ``raydcp.runtime.coordinator`` (a plain class) can be used without Ray.
"""
from __future__ import annotations

import importlib

__all__ = ["RayTransport", "Coordinator", "ShardGroup", "ShardActor"]

_EXPORTS = {
    "RayTransport": "raydcp.runtime.ray_transport",
    "Coordinator": "raydcp.runtime.coordinator",
    "ShardGroup": "raydcp.runtime.shard_group",
    "ShardActor": "raydcp.runtime.shard_actor",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'raydcp.runtime' has no attribute {name!r}")
