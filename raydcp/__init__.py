"""raydcp: distributed checkpointing of PyTorch training state on Ray.

Public API (DESIGN.md): save, async_save, load, read_metadata, Shard, Group,
CheckpointError, Metadata, ShardGroup, and the Ray Train helpers in raydcp.train.
"""
import fsspec as _fsspec

from .engine import async_save, load, read_metadata, save
from .errors import CheckpointError
from .group import Group
from .metadata import Metadata
from .state import Shard

__all__ = ["save", "async_save", "load", "read_metadata", "Shard", "Group", "CheckpointError",
           "Metadata", "ShardGroup", "__version__"]
__version__ = "0.1.0"

# raymem:// (checkpoints in the Ray cluster's memory) and raynode:// (node-local disk tiers): fsspec
# imports the classes, and with them Ray, only when such a URL is opened.
_fsspec.register_implementation("raymem", "raydcp.runtime.memstore.filesystem.RayMemFileSystem", clobber=True)
_fsspec.register_implementation("raynode", "raydcp.runtime.memstore.nodelocal.RayNodeFileSystem", clobber=True)


def __getattr__(name: str):
    if name == "ShardGroup":  # imports Ray: only when asked for
        from .runtime.shard_group import ShardGroup

        return ShardGroup
    if name == "train":  # raydcp.train.save(...) without importing raydcp.train first
        import importlib

        return importlib.import_module(".train", __name__)
    raise AttributeError(f"module 'raydcp' has no attribute {name!r}")
