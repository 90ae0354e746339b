"""What a plan computed, kept for the next plan of the same layout (every step of a training run).

A save's global plan depends on the ranks' layouts (which pieces of which tensors each rank
holds, their sizes and bytes) and, through the replicas' checksums and the plain values, on
what they hold. A :class:`PlanCache` keeps the part the layouts decide -- the checks of the
tensors' tiling, who writes each replica, the balancing and the packing into files -- under a
digest of every rank's :attr:`~raydcp.planner.ItemColumns.layout` and the options. A later plan
whose digest is the same reuses it and redoes only what the content decides: the replicas'
checksums compared, the plain values, the files named for the new save. A digest that differs
(a rank's shape, a new key, another rank count) plans from the start; the digests are
BLAKE2b of the columns themselves, so a reuse is a comparison, never a guess.

The cache is a plain value the caller keeps (the coordinator, one per group) and passes to
:func:`~raydcp.planner.plan_save`; the planner stays a function of its arguments.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["PlanCache", "SaveReuse"]


@dataclass(frozen=True)
class SaveReuse:
    """What :func:`~raydcp.planner.plan_save`'s array path decided from the layouts: per rank its
    files' pieces (``items``, ``byte_offsets``, ``bounds``: a FileTable but for the names), the
    bytes each rank writes, and the pieces whose checksums a new plan must still compare: groups
    of replicas (``replica_rows`` in groups starting at ``replica_heads``; None: no replicas) and
    the empty pieces that carry one (positions ``empty``, their (tensor, offsets, sizes)
    ``empty_boxes``). Positions count the ranks' items one rank after another."""

    files: tuple[tuple[np.ndarray, np.ndarray, list[int]], ...]
    load: tuple[int, ...]
    replica_rows: np.ndarray | None
    replica_heads: np.ndarray | None
    empty: np.ndarray
    empty_boxes: list[tuple]


class PlanCache:
    """The last save plan's reusable part, under the digest of its layouts (see module doc)."""

    __slots__ = ("_save", "hits", "misses")

    def __init__(self) -> None:
        self._save: tuple[bytes, SaveReuse] | None = None
        self.hits = 0
        self.misses = 0

    @staticmethod
    def save_key(columns: Sequence, max_file_bytes: int) -> bytes | None:
        """The digest a save plan is kept under: every rank's layout, in rank order, and the
        options that shape files; None where a rank's columns carry no layout digest."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{len(columns)}/{max_file_bytes}".encode())
        for c in columns:
            layout = getattr(c, "layout", None)
            if not isinstance(layout, bytes):
                return None
            h.update(layout)
        return h.digest()

    def saved(self, key: bytes) -> SaveReuse | None:
        """What the last plan kept under ``key``, counted as a hit; None (a miss) otherwise."""
        if self._save is not None and self._save[0] == key:
            self.hits += 1
            return self._save[1]
        self.misses += 1
        return None

    def keep_save(self, key: bytes, reuse: SaveReuse) -> None:
        self._save = (key, reuse)

    def clear(self) -> None:
        self._save = None
