"""Where a ``raymem://`` (or ``raynode://``) file sits in the layout of the checkpoint it belongs to.

A checkpoint directory ``DIR`` holds its metadata (``DIR/raydcp.meta``), its commit log
(``DIR/_raydcp/...``) and its data files, ``DIR/data/<save id>/<file>``, named by raydcp's own
scheme (:func:`raydcp.storage.commits.raydcp_data_file`). A file is a data file because its last
components follow that scheme, never because its path contains ``/data/`` somewhere: the name of a
checkpoint may have a ``data`` component of its own (``raymem://exp/data/step-1``).
"""
from __future__ import annotations

from ...storage.commits import raydcp_data_file

__all__ = ["split_data_file", "is_data_file", "checkpoint_dir"]


def split_data_file(path: str) -> tuple[str, str] | None:
    """``(checkpoint directory, name in it)`` of a data file ``DIR/data/<save id>/<file>``; None
    for any other file. The deepest ``data`` component that starts raydcp's naming wins."""
    parts = path.split("/")
    for i in range(len(parts) - 3, -1, -1):
        if parts[i] == "data":
            name = "/".join(parts[i:])
            if raydcp_data_file(name):
                return "/".join(parts[:i]), name
    return None


def is_data_file(path: str) -> bool:
    """True for a checkpoint's data file (written once under a save's own id, never rewritten)."""
    return split_data_file(path) is not None


def checkpoint_dir(path: str) -> str:
    """The checkpoint directory of a data file; the parent directory of any other file."""
    split = split_data_file(path)
    if split is not None:
        return split[0]
    return path.rsplit("/", 1)[0] if "/" in path else ""
