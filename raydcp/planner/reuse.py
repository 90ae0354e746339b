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
    """The last save plan's and the last load plan's reusable parts (see module doc).

    A load plan over a checkpoint's stored chunks is kept under the digest of the loading ranks'
    layouts and the chunks' places (their tensors' names, dtypes and shapes, and every chunk's
    box and bytes, compared array by array with the last ones): a load of the same layout from a
    checkpoint whose chunks lie in the same places -- the next checkpoint of the same run --
    reuses what the reads are (:class:`~raydcp.planner.read_tables.ReadLayout`) and takes only
    the files, byte offsets and checksums from its own metadata."""

    __slots__ = ("_save", "_load", "hits", "misses", "load_hits", "load_misses")

    def __init__(self) -> None:
        self._save: tuple[bytes, SaveReuse] | None = None
        self._load: tuple | None = None
        self.hits = self.misses = 0
        self.load_hits = self.load_misses = 0

    @staticmethod
    def load_key(local_plans: Sequence, joint_reads: bool) -> bytes | None:
        """The digest a load plan is kept under (with the chunks' places): every loading rank's
        layout and strictness, in rank order; None where a rank's columns carry no layout."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"{len(local_plans)}/{joint_reads}".encode())
        for lp in local_plans:
            layout = getattr(getattr(lp, "columns", None), "layout", None)
            if not isinstance(layout, bytes):
                return None
            h.update(layout)
            h.update(b"s" if lp.strict else b"n")
        return h.digest()

    def loaded(self, key: bytes, tensors):
        """The ReadLayout kept under ``key`` for chunks in the places of ``tensors`` (a decoded
        checkpoint's TensorMetas), counted as a hit; None (a miss) otherwise."""
        kept = self._load
        if kept is not None and kept[0] == key and _same_places(kept[1], _places(tensors)):
            self.load_hits += 1
            return kept[2]
        self.load_misses += 1
        return None

    def keep_load(self, key: bytes, tensors, layout) -> None:
        self._load = (key, _places(tensors), layout)

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
        self._save = self._load = None


def _places(tensors) -> tuple:
    c = tensors.columns
    return (list(tensors.names), list(tensors.dtypes), [tuple(s) for s in tensors.shapes], c.rows, c.ndim,
            c.offsets, c.sizes, c.nbytes, np.diff(c.block_bounds))


def _same_places(a: tuple, b: tuple) -> bool:
    return a[:3] == b[:3] and all(x.shape == y.shape and np.array_equal(x, y) for x, y in zip(a[3:], b[3:]))
