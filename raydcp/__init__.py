"""raydcp: distributed checkpointing of PyTorch training state on Ray.

Public API (DESIGN.md): save, async_save, load, read_metadata, Shard, Group,
CheckpointError, Metadata, ShardGroup, and the Ray Train helpers in raydcp.train.
"""
from .errors import CheckpointError

__all__ = ["save", "async_save", "load", "read_metadata", "Shard", "Group", "CheckpointError",
           "Metadata", "ShardGroup", "__version__"]
__version__ = "0.1.0"

# The public names load their modules (torch, numpy, pyarrow) on first use, so that
# `import raydcp.cli` and `raydcp --help` stay fast; `from raydcp import save` works as before.
_LAZY = {"save": ".engine", "async_save": ".engine", "load": ".engine", "read_metadata": ".engine",
         "Group": ".group", "Metadata": ".metadata", "Shard": ".state", "ShardGroup": ".runtime.shard_group"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    if name == "train":  # raydcp.train.save(...) without importing raydcp.train first
        import importlib

        return importlib.import_module(".train", __name__)
    raise AttributeError(f"module 'raydcp' has no attribute {name!r}")
