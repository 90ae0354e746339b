"""Storage layer: one checkpoint directory on any fsspec filesystem, and retention of many.

Only fsspec is used here (no Ray, no torch). Data files are written in parallel and durably,
read back by exact byte ranges, and a checkpoint becomes visible only when its metadata file
(METADATA_NAME) is committed, atomically and last.
"""
from ._common import METADATA_NAME, check_name, is_local, is_transient
from ._local import fsync_dir, publish_atomically, write_durably
from .fs import CheckpointStorage
from .retention import CommittedCheckpoint, apply_retention, list_committed, remove_checkpoint

__all__ = [
    "METADATA_NAME",
    "CheckpointStorage",
    "CommittedCheckpoint",
    "apply_retention",
    "list_committed",
    "remove_checkpoint",
    # for the layers built on storage (the pipeline's records and copies, the memory tier's holders)
    "check_name",
    "is_local",
    "is_transient",
    "fsync_dir",
    "publish_atomically",
    "write_durably",
]
