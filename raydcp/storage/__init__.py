"""Storage layer: one checkpoint directory on any fsspec filesystem, and retention of many.

Only fsspec is used here (no Ray, no torch). Data files are written in parallel and durably,
read back by exact byte ranges, and a checkpoint becomes visible only when its metadata file
(METADATA_NAME) is committed, atomically and last.
"""
from ._common import METADATA_NAME
from .fs import CheckpointStorage
from .retention import CommittedCheckpoint, apply_retention, list_committed, remove_checkpoint

__all__ = [
    "METADATA_NAME",
    "CheckpointStorage",
    "CommittedCheckpoint",
    "apply_retention",
    "list_committed",
    "remove_checkpoint",
]
