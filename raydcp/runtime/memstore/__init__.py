"""``raymem://NAME/...``: checkpoints held in the memory of a Ray cluster's nodes (and ``raynode://``).

- :mod:`.holder`: the detached actor, one per node, that owns the bytes held there;
- :mod:`.placement`: alive nodes, holder handles, the replica ring;
- :mod:`.filesystem`: the fsspec filesystem raydcp's storage layer uses for ``raymem://`` URLs
  (registered with fsspec when :mod:`raydcp` is imported), with :mod:`.writer` (a file open for
  writing) and :mod:`.commit` (the metadata's publication and ``keep_last``);
- :mod:`.nodelocal`: ``raynode://``, the same protocol over each node's local disk (node-local
  pipeline tiers).

See docs/memory.md for the protocol, the options and the failure behaviour.
"""
from __future__ import annotations

__all__ = ["RayMemFileSystem", "FILESYSTEM_CLASS"]

FILESYSTEM_CLASS = "raydcp.runtime.memstore.filesystem.RayMemFileSystem"


def __getattr__(name: str):
    if name == "RayMemFileSystem":
        from .filesystem import RayMemFileSystem

        return RayMemFileSystem
    raise AttributeError(f"module 'raydcp.runtime.memstore' has no attribute {name!r}")
