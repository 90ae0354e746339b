"""Where a Ray Train run keeps its checkpoints, in raydcp's terms (fsspec URLs), and who we are.

Ray Train describes storage with a pyarrow filesystem and a path; raydcp's storage
layer speaks fsspec. :func:`fsspec_location` maps one to the other without copying
anything: checkpoints are written straight into the run's directory.
"""
from __future__ import annotations

import os
import re
from typing import Any

from ..errors import CheckpointError
from ..runtime.train_group import new_nonce, train_context

__all__ = ["train_context", "rank_and_world", "fsspec_location", "checkpoint_dir_name", "is_raydcp_dir_name",
           "new_nonce"]

# Names of the checkpoint directories raydcp.train.save creates under the run directory.
_DIR_RE = re.compile(r"^raydcp-(step\d{8}|t\d{14})-[0-9a-f]{8}$")


def rank_and_world() -> tuple[int, int]:
    """(world rank, world size): from Ray Train, else torch.distributed, else (0, 1)."""
    ctx = train_context()
    if ctx is not None:
        return ctx.get_world_rank(), ctx.get_world_size()
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def fsspec_location(filesystem: Any, path: str, storage_options: dict | None = None) -> tuple[str, dict | None]:
    """The fsspec URL (or local path) and storage options for ``path`` on a pyarrow ``filesystem``.

    Local and fsspec-backed (``PyFileSystem(FSSpecHandler(fs))``) filesystems map
    exactly; S3 and GCS map to ``s3://`` / ``gs://`` URLs, whose credentials and
    endpoint come from ``storage_options`` (pyarrow does not expose them).
    """
    import pyarrow.fs as pafs

    if isinstance(filesystem, pafs.LocalFileSystem):
        return os.path.normpath(path), storage_options
    if isinstance(filesystem, pafs.PyFileSystem) and isinstance(filesystem.handler, pafs.FSSpecHandler):
        fs = filesystem.handler.fs
        options = {**(getattr(fs, "storage_options", None) or {}), **(storage_options or {})}
        return fs.unstrip_protocol(path), options or None
    schemes = {"s3": "s3", "gcs": "gs", "abfs": "abfs", "hdfs": "hdfs"}
    scheme = schemes.get(getattr(filesystem, "type_name", ""))
    if scheme is not None:
        return f"{scheme}://{path.lstrip('/')}", storage_options
    raise CheckpointError(
        f"raydcp.train cannot write to Ray Train storage on a {type(filesystem).__name__}; use a local or "
        "shared path, s3://, gs://, or RunConfig(storage_filesystem=pyarrow.fs.PyFileSystem("
        "pyarrow.fs.FSSpecHandler(fsspec_filesystem)))"
    )


def checkpoint_dir_name(step: int | None, nonce: str) -> str:
    """``raydcp-step00000042-<nonce>`` (or ``raydcp-t<UTC time>-<nonce>`` without a step)."""
    if step is not None:
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**8:
            raise CheckpointError(f"step must be an int in [0, 1e8), got {step!r}")
        return f"raydcp-step{step:08d}-{nonce}"
    import time

    return f"raydcp-t{time.strftime('%Y%m%d%H%M%S', time.gmtime())}-{nonce}"


def is_raydcp_dir_name(name: str) -> bool:
    return bool(_DIR_RE.match(name))
