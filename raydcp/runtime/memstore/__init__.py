"""``raymem://NAME/...``: checkpoints held in the memory of a Ray cluster's nodes (and ``raynode://``).

- :mod:`.holder`: the detached actor, one per node, that owns the bytes held there;
- :mod:`.placement`: alive nodes, holder handles, the replica ring;
- :mod:`.capacity`: the room of a whole save under the per-node byte caps, reserved at its plan
  step (:class:`NodeCapacityError` when it does not fit);
- :mod:`.filesystem`: the fsspec filesystem raydcp's storage layer uses for ``raymem://`` URLs
  (registered with fsspec when :mod:`raydcp` is imported), with :mod:`.writer` (a file open for
  writing) and :mod:`.commit` (the metadata's publication and ``keep_last``);
- :mod:`.nodelocal`: ``raynode://``, the same protocol over each node's local disk (node-local
  pipeline tiers); a restarted disk holder finds its node's files again.

See docs/memory.md for the protocol, the options and the failure behaviour.
"""
from __future__ import annotations

__all__ = ["RayMemFileSystem", "NodeCapacityError", "FILESYSTEM_CLASS"]

FILESYSTEM_CLASS = "raydcp.runtime.memstore.filesystem.RayMemFileSystem"


def __getattr__(name: str):
    if name == "RayMemFileSystem":
        from .filesystem import RayMemFileSystem

        return RayMemFileSystem
    if name == "NodeCapacityError":
        from .capacity import NodeCapacityError

        return NodeCapacityError
    raise AttributeError(f"module 'raydcp.runtime.memstore' has no attribute {name!r}")
