"""The byte moves of a ShardGroup reshard inside one actor: views to send, copies into the new pieces.

A reshard (``raydcp.planner.transfer.plan_layout_transfer``) gives every actor lists of
:class:`~raydcp.planner.transfer.Move` (a box of one tensor). This module turns them into
memory operations with no copy beyond the one each byte needs:

- :func:`outgoing` -- what a sending rank publishes for one destination: for the object store,
  uint8 numpy views of its held pieces' bytes (Ray copies them into the object store once, as
  it seals the message); for Ray Direct Transport, uint8 tensor views (sent from where they
  are). Only a box that is not contiguous in its piece (a split along another dimension) or a
  device tensor bound for the object store is copied first.
- :func:`copy_in` -- one received message into the new pieces: each box copied straight from
  the object store's shared memory (or the RDT receive buffer) into its final place.
- :func:`copy_local` -- boxes that stay in the actor: one copy from the old piece to the new one.

Every box is checked against the piece that holds it (key present, dtype, inside the piece,
byte counts), so a state changed behind the group's back fails with a CheckpointError naming
the key and rank, never with wrong numbers.
"""
from __future__ import annotations

import copy
import ctypes
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from ...codec import dtype_name, tensor_from_bytes
from ...errors import CheckpointError
from ...planner.transfer import Move
from ...state import Shard

__all__ = ["region", "outgoing", "copy_in", "copy_local", "plain_values"]


def region(state: dict, mv: Move, who: str) -> torch.Tensor:
    """The view of the piece ``state`` holds for ``mv``'s key that covers ``mv``'s box (``mv``: a Move
    or a plain tuple of its fields, as moves travel)."""
    key, dtype, offsets, sizes, _ = mv
    held = state.get(key)
    if isinstance(held, Shard):
        t, base = held.tensor, held.offsets
    elif isinstance(held, torch.Tensor):
        t, base = held, (0,) * held.dim()
    else:
        raise CheckpointError(f"{key}: {who} holds no tensor for it (found {type(held).__name__}); the state "
                              f"of a ShardGroup must keep the pieces it loaded or received")
    if dtype_name(t.dtype) != dtype or t.dim() != len(offsets) or any(
            o < b or o + s > b + n for o, s, b, n in zip(offsets, sizes, base, t.shape)):
        box = [(o, o + s) for o, s in zip(offsets, sizes)]
        held_box = [(b, b + n) for b, n in zip(base, t.shape)]
        raise CheckpointError(f"{key}: {who} holds a {dtype_name(t.dtype)} piece over {held_box}, not the "
                              f"{dtype} box {box} its layout gives it; the state of a ShardGroup must keep the "
                              f"pieces it loaded or received (reload it with .load(checkpoint_id, layout=...))")
    for d, (o, s, b) in enumerate(zip(offsets, sizes, base)):
        if o != b or s != t.shape[d]:
            t = t.narrow(d, o - b, s)
    return t


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes (a 0-d tensor too)."""
    return t.reshape(-1).view(torch.uint8)


def outgoing(state: dict, moves: Sequence[Move], who: str, *, host: bool) -> list:
    """What a sending rank publishes for ``moves``: one buffer per move, in order.

    ``host``: uint8 numpy arrays on the host (for the object store; views of the pieces where
    they are contiguous host memory); otherwise uint8 tensors where the pieces are (for RDT).
    """
    out = []
    for mv in moves:
        t = region(state, mv, who)
        if host and t.device.type != "cpu":
            t = t.cpu()  # the object store holds host memory: one device-to-host copy
        elif not t.is_contiguous():
            t = t.contiguous()
        t = _flat_bytes(t.detach())
        out.append(t.numpy() if host else t)
    return out


def copy_in(state: dict, moves: Sequence[Move], bufs: Sequence[Any], who: str, source: str) -> int:
    """Copy message ``bufs`` (one buffer per move, from ``source``) into the pieces of ``state``; returns bytes."""
    if len(bufs) != len(moves):
        raise CheckpointError(f"{who} got {len(bufs)} buffers from {source} for {len(moves)} boxes; the two sides "
                              f"planned different transfers (a bug)")
    total = 0
    for mv, buf in zip(moves, bufs):
        dest = region(state, mv, who)
        nbytes = buf.nbytes if isinstance(buf, (np.ndarray, torch.Tensor)) else memoryview(buf).nbytes
        if nbytes != mv[4]:
            raise CheckpointError(f"{mv[0]}: {who} got {nbytes} bytes from {source} for a box of {mv[4]} bytes")
        if not nbytes:
            continue
        if isinstance(buf, torch.Tensor):  # RDT: a uint8 tensor on the pieces' device
            if dest.is_contiguous():
                _flat_bytes(dest).copy_(buf)
            else:
                dest.copy_(buf.view(dest.dtype).view(dest.shape))
        elif dest.is_cpu and dest.is_contiguous():  # the object store's shared memory -> the piece, one copy
            src = buf if isinstance(buf, np.ndarray) else np.frombuffer(buf, np.uint8)
            ctypes.memmove(dest.data_ptr(), src.ctypes.data, nbytes)
        else:
            dest.copy_(tensor_from_bytes(buf, mv[1], tuple(mv[3])))
        total += nbytes
    return total


def copy_local(src: dict, dest: dict, moves: Iterable[Move], who: str, src_who: str) -> int:
    """Copy ``moves`` from the old pieces ``src`` to the new pieces ``dest`` of the same actor; returns bytes."""
    total = 0
    for mv in moves:
        if mv[4]:
            region(dest, mv, who).copy_(region(src, mv, src_who))
            total += mv[4]
    return total


def plain_values(state: dict, keys: Iterable[str], who: str) -> dict:
    """The plain values ``keys`` of ``state`` (copies: the two groups' states stay independent)."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"{who} holds no value for {', '.join(missing)}; the state of a ShardGroup must keep "
                              f"the values it loaded")
    return {k: copy.deepcopy(state[k]) for k in keys}
