"""raydcp: distributed checkpointing of PyTorch training state on Ray.

Public API (DESIGN.md): save, async_save, load, read_metadata, Shard, Group,
CheckpointError and its typed subclasses (raydcp.errors), Metadata, ShardGroup,
and the Ray Train helpers in raydcp.train.
"""
from .engine import async_save, load, read_metadata, save
from .errors import (CheckpointDamagedError, CheckpointError, CheckpointNotFoundError, CheckpointReplacedError,
                     CoordinatorLostError, RankFailedError, RanksTimedOutError, StateMismatchError, StorageError)
from .group import Group
from .metadata import Metadata
from .state import Shard

__all__ = ["save", "async_save", "load", "read_metadata", "Shard", "Group", "CheckpointError",
           "CheckpointNotFoundError", "CheckpointDamagedError", "CheckpointReplacedError", "StateMismatchError",
           "RanksTimedOutError", "RankFailedError", "CoordinatorLostError", "StorageError",
           "Metadata", "ShardGroup", "__version__"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "ShardGroup":  # imports Ray: only when asked for
        from .runtime.shard_group import ShardGroup

        return ShardGroup
    if name == "train":  # raydcp.train.save(...) without importing raydcp.train first
        import importlib

        return importlib.import_module(".train", __name__)
    raise AttributeError(f"module 'raydcp' has no attribute {name!r}")
