"""Plans are data: frozen dataclasses of plain types, built by pure functions.

Save, for ``world_size`` ranks:
  1. each rank builds a :class:`LocalSavePlan` (what it holds; no tensor data);
  2. the coordinator calls ``plan_save(local_plans)`` -> a :class:`GlobalSavePlan`
     (validated, replicas written once, bytes balanced, small pieces coalesced
     into few files) and hands each rank its :class:`RankWritePlan`;
  3. each rank writes its slots and returns their checksums;
  4. the coordinator builds the metadata and commits it.

Load, for any N saved -> M loading:
  1. each rank builds a :class:`LocalLoadPlan` (the regions it wants);
  2. the coordinator calls ``plan_load(sources, local_plans)`` -> one
     :class:`RankLoadPlan` per rank: which source chunks it reads (each needed
     source byte read by exactly one rank) and where each part goes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "TensorSpec", "WriteItem", "LocalSavePlan", "FileSlot", "RankWritePlan", "GlobalSavePlan",
    "ReadItem", "LocalLoadPlan", "SourceChunk", "Delivery", "ChunkRead", "RankLoadPlan",
]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class WriteItem:
    """A piece a rank holds: the box [offsets, offsets+sizes) of tensor ``key``."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    nbytes: int
    checksum: int | None = None  # set where comparing replicas is cheap (host tensors)


@dataclass(frozen=True)
class LocalSavePlan:
    rank: int
    tensors: Mapping[str, TensorSpec]
    items: tuple[WriteItem, ...]
    values: Mapping[str, Any]


@dataclass(frozen=True, slots=True)
class FileSlot:
    """Where one rank writes one piece: ``item`` indexes the rank's LocalSavePlan.items."""

    item: int
    file: str
    byte_offset: int


@dataclass(frozen=True)
class RankWritePlan:
    rank: int
    save_id: str
    files: tuple[tuple[str, tuple[FileSlot, ...]], ...]  # file name -> slots in file order


@dataclass(frozen=True)
class GlobalSavePlan:
    save_id: str
    world_size: int
    tensors: Mapping[str, TensorSpec]
    values: Mapping[str, Any]
    ranks: tuple[RankWritePlan, ...]
    bytes_per_rank: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReadItem:
    """A region a rank wants: the box [offsets, offsets+sizes) of tensor ``key``."""

    key: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class LocalLoadPlan:
    rank: int
    tensors: Mapping[str, TensorSpec]  # what the rank expects each key to be
    items: tuple[ReadItem, ...]
    values: tuple[str, ...]            # plain-value keys the rank wants
    strict: bool = True


@dataclass(frozen=True, slots=True)
class SourceChunk:
    """A piece of source data: a stored chunk (``holders`` None: any rank can read it from
    ``file``) or a live piece held in memory by each rank in ``holders``."""

    key: str
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str | None = None
    byte_offset: int = 0
    nbytes: int = 0
    checksum: int | None = None
    block_checksums: tuple[int, ...] = ()
    holders: tuple[int, ...] | None = None


@dataclass(frozen=True, slots=True)
class Delivery:
    """The part ``box`` of a source chunk that rank ``rank`` needs for its item ``item``."""

    rank: int
    item: int
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class ChunkRead:
    source: SourceChunk
    deliveries: tuple[Delivery, ...]


@dataclass(frozen=True)
class RankLoadPlan:
    rank: int
    reads: tuple[ChunkRead, ...]   # chunks this rank reads and delivers from
    incoming: int                  # deliveries from other ranks this rank will receive
    values: Mapping[str, Any]
    bytes_read: int
    bytes_needed: int
