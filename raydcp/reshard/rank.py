"""One round of a reshard, as every rank runs it (threads of one process, or Ray actors).

Protocol of a round, for each rank of the round's transport (every rank calls
:func:`run_round` with the same :class:`RoundTask`):

1. allocate this rank's pieces of the round's parts in the destination layout (source dtype);
   ``round: allocate`` tells every rank whether every rank managed to;
2. ``load``: a collective load with ``strict=False`` of exactly those pieces: the coordinator
   assigns each needed source byte range to one reader, pieces move between ranks;
3. cast floating pieces to the destination dtype (the source copy is freed);
4. ``write_round``: a collective round save of the pieces; rank 0 gets the round's records.

Nothing here knows whether the ranks are threads or actors: the caller hands in the transport.
"""
from __future__ import annotations

import ctypes
import gc
from dataclasses import dataclass
from typing import Any

import torch

from ..codec import dtype_from_name
from ..engine.load import load_with
from ..engine.rounds import RoundRecords, write_round
from ..errors import RankFailure
from ..options import LoadOptions, SaveOptions
from ..state import Shard
from ..transport import Transport
from .plan import Round, part_box

__all__ = ["RoundTask", "run_round", "return_freed_memory", "release_round_memory"]


@dataclass(frozen=True)
class RoundTask:
    """What every rank needs for one round (small: shipped to each rank)."""

    src: str
    dst: str
    save_id: str                 # the round's save id (raydcp.engine.rounds.round_save_id)
    layout: str
    world_size: int
    round: Round
    save_options: SaveOptions    # how the round writes (file size cap, IOOptions); its reads use the same IOOptions
    src_storage_options: dict | None = None
    dst_storage_options: dict | None = None


def run_round(transport: Transport, task: RoundTask) -> RoundRecords | None:
    """Steps 1-4 for the calling rank; returns the round's records on rank 0, None elsewhere.

    A rank that fails locally (say, out of memory) still takes part in every step, so every
    rank raises the same CheckpointError at once instead of waiting for it to time out.
    """
    rank = transport.rank
    pieces: dict = {}
    src_state: dict = {}
    failure: Any = None
    try:  # 1. this rank's pieces of the round, in the source dtype, by the tensors' own keys
        for part in task.round.parts:
            box = part_box(part, task.layout, rank, task.world_size)
            if box is not None:
                pieces[part] = box
                src_state[part.tensor] = Shard(torch.empty(box[1], dtype=dtype_from_name(part.src_dtype)),
                                               box[0], part.shape)
    except Exception as exc:
        failure = RankFailure.from_exception(rank, exc)
        src_state = {}
    transport.reduce_scatter("round: allocate", failure, _all_ok)
    # 2. load them
    load_with(transport, src_state, task.src, strict=False, storage_options=task.src_storage_options,
              warn_skipped=False, options=LoadOptions(io=task.save_options.io),  # a round loads a subset on purpose
              fresh=True)  # new pieces, dropped if it fails: no undo copy
    # 3. cast, and 4. save under the round keys, offsets relative to the part
    out = {}
    error = None
    try:
        for part, (off, _) in pieces.items():
            t = src_state.pop(part.tensor).tensor
            if part.dst_dtype != part.src_dtype:
                t = t.to(dtype_from_name(part.dst_dtype))
            p_off, p_size = part.box
            out[part.key] = Shard(t, tuple(o - b for o, b in zip(off, p_off)), p_size)
    except Exception as exc:
        error = exc
    del src_state, pieces  # source copies of cast pieces are freed before the write
    return write_round(transport, out, task.dst, task.save_id, storage_options=task.dst_storage_options,
                       options=task.save_options, failure=error)


def return_freed_memory() -> None:
    """Have glibc serve buffers of 1 MiB and more with mmap, so that freeing them returns them.

    By default glibc raises that threshold each time such a buffer is freed (up to 32 MiB), after
    which a round's buffers come from heaps that keep their pages: a process running round after
    round would grow well past the budget. Setting the threshold fixes it (process-wide, harmless
    elsewhere). A no-op where the C library is not glibc.
    """
    try:
        ctypes.CDLL(None).mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError, TypeError):
        pass


def release_round_memory() -> None:
    """Free what a finished round left in reference cycles (the state flattening's closures hold
    the flattened tensors until the cyclic collector runs, which may be several rounds later)."""
    gc.collect()


def _all_ok(values: list) -> list:
    return [None] * len(values)
