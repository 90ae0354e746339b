"""raydcp: distributed checkpointing of PyTorch training state on Ray.

Public API (docs/architecture.md): save, async_save, load, read_metadata, Shard, Group,
CheckpointError and its typed subclasses (raydcp.errors), Metadata, ShardGroup, the options
of a call (SaveOptions, LoadOptions, IOOptions: raydcp.options) and the Ray Train helpers in
raydcp.train.
"""
import fsspec as _fsspec

from .errors import (CheckpointDamagedError, CheckpointError, CheckpointNotFoundError, CheckpointReplacedError,
                     ConcurrentSaveError, CoordinatorLostError, RankFailedError, RanksLostError, RanksTimedOutError,
                     StateMismatchError, StateNotCoveredError, StorageError)
from .group import Group
from .lazy import lazy_attribute

__all__ = ["save", "async_save", "load", "read_metadata", "prepare_group", "Shard", "Group", "CheckpointError",
           "CheckpointNotFoundError", "CheckpointDamagedError", "CheckpointReplacedError", "ConcurrentSaveError",
           "StateMismatchError",
           "RanksTimedOutError", "RankFailedError", "CoordinatorLostError", "StorageError",
           "RanksLostError", "StateNotCoveredError",
           "Metadata", "ShardGroup", "SaveOptions", "LoadOptions", "IOOptions", "__version__"]
__version__ = "0.1.0"

# The public names load their modules (torch, numpy, pyarrow) on first use, so that
# `import raydcp.cli` and `raydcp --help` stay fast; `from raydcp import save` works as before.
_LAZY = {"save": ".api", "async_save": ".api", "load": ".api", "read_metadata": ".api", "prepare_group": ".api",
         "Metadata": ".metadata", "Shard": ".state", "ShardGroup": ".runtime.shard_group",
         "SaveOptions": ".options", "LoadOptions": ".options", "IOOptions": ".options"}

_SUBMODULES = frozenset({"api", "options", "train", "data", "engine", "storage", "planner", "codec", "metadata", "metadata_format", "runtime",
                         "transport", "state", "verify", "pipeline", "convert", "reshard", "cli", "lazy", "memory"})

# raymem:// (checkpoints in the Ray cluster's memory) and raynode:// (node-local disk tiers): fsspec
# imports the classes, and with them Ray, only when such a URL is opened.
_fsspec.register_implementation("raymem", "raydcp.runtime.memstore.filesystem.RayMemFileSystem", clobber=True)
_fsspec.register_implementation("raynode", "raydcp.runtime.memstore.nodelocal.RayNodeFileSystem", clobber=True)


def __getattr__(name: str):
    if name in _LAZY:
        return lazy_attribute(__name__, _LAZY, name)
    if name in _SUBMODULES:  # raydcp.train.save(...), raydcp.engine.save_with(...) without importing them first
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'raydcp' has no attribute {name!r}")
