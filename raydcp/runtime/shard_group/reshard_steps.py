"""The two steps a ShardActor runs in a ShardGroup reshard: publish (send side) and receive.

The driver plans the whole reshard from the two layouts (``plan_layout_transfer``) and starts,
for every (old rank, new rank) pair that exchanges bytes, one :func:`publish` task on the old
rank's actor, and one :func:`receive` task on every new rank's actor, handing it the ObjectRefs
of the publish tasks addressed to it. There is no coordinator round and no other message:

1. ``publish``: the old rank's views of the boxes for one new rank, returned as the task's result
   (one object per destination). Through the object store, Ray copies them into shared memory
   once as it seals the result; with Ray Direct Transport (``rdt=True``) they stay where they
   are and RDT sends them (gloo, NCCL) when the receive task is submitted.
2. ``receive``: the new rank's pieces (allocated ahead by ``prepare_receive``, or now), filled
   from the old pieces in the same actor (local copies) and from each message as it arrives,
   straight from the object store's buffer into the final tensors; local copies run while
   messages are outstanding. With RDT the messages are the task's arguments (RDT needs them so).
   A failed or dead sender makes the receive fail naming it, within ``timeout_s``.

Each step returns its result (and phase timings, for the bench's breakdown) or the
CheckpointError it raised.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import ray
from ray import exceptions as rex

from ...errors import CheckpointError
from ...planner.transfer import Move
from .piece_moves import copy_in, copy_local, outgoing, plain_values

__all__ = ["publish", "receive", "receive_direct", "Incoming", "Local"]

# local copies done between two polls of the outstanding messages
_LOCAL_BATCH_BYTES = 16 << 20

# (old rank, its moves, [ObjectRef of its publish task]) -- the ref nested in a list so that Ray
# hands it to the receive task as a ref (the task starts before the message exists)
Incoming = tuple[int, Sequence[Move], list]
# (the old pieces in this actor, who holds them (for errors), the moves copied from them)
Local = tuple[dict, str, Sequence[Move]]


def publish(state: dict, who: str, moves: Sequence[Move], value_keys: Sequence[str] | None, *, rdt: bool):
    """``(plain values or None, buffers)``: the message of one old rank to one new rank."""
    values = plain_values(state, value_keys, who) if value_keys else None
    return values, outgoing(state, moves, who, host=not rdt)


class _Clock:
    """Phase timings of one receive (seconds, and wall-clock times for lining up actors)."""

    def __init__(self) -> None:
        self.t = {"start": time.time(), "local_s": 0.0, "wait_s": 0.0, "get_s": 0.0, "copy_in_s": 0.0,
                  "first_message": None, "last_message": None, "local_bytes": 0, "remote_bytes": 0}

    def add(self, key: str, since: float) -> float:
        now = time.perf_counter()
        self.t[key] += now - since
        return now

    def arrived(self) -> None:
        now = time.time()
        if self.t["first_message"] is None:
            self.t["first_message"] = now
        self.t["last_message"] = now


def receive(dest: dict, who: str, local: Local | None, incoming: Sequence[Incoming],
            values: tuple[Any, Sequence[str]], timeout_s: float) -> tuple[dict | None, dict]:
    """Fill ``dest`` (the new rank's pieces) from the old pieces ``local`` = (state, who holds
    it, moves) of the same actor and from the messages ``incoming``; returns (the plain values, timings).

    ``values`` = (where the plain values come from: "local", or the old rank whose message carries
    them; their keys). Messages are copied as they arrive; local boxes are copied while none is
    waiting, so the copies overlap the transfers.
    """
    clock = _Clock()
    src_state, src_who, todo = local if local is not None else ({}, "", ())
    got = _local_values(src_state, values, src_who)
    pending = {inc[2][0]: inc for inc in incoming}
    k = 0
    deadline = time.monotonic() + timeout_s
    while pending:
        t0 = time.perf_counter()
        more_local = k < len(todo)
        ready, _ = ray.wait(list(pending), num_returns=1,
                            timeout=0 if more_local else max(0.0, deadline - time.monotonic()))
        if not ready:
            if more_local:  # nothing arrived yet: copy local boxes meanwhile
                k = _copy_batch(src_state, dest, todo, k, (who, src_who), clock, clock.add("wait_s", t0))
                continue
            missing = sorted(inc[0] for inc in pending.values())
            raise CheckpointError(f"{who}: the pieces from old ranks {missing} did not arrive within {timeout_s:g}s "
                                  f"(their actors may be stuck; raise timeout_s if the cluster is just slow)")
        t0 = clock.add("wait_s", t0)
        rank, moves, _ = pending.pop(ready[0])
        clock.arrived()
        message_values, bufs = _fetch(ready[0], rank, who)
        t0 = clock.add("get_s", t0)
        clock.t["remote_bytes"] += copy_in(dest, moves, bufs, who, f"old rank {rank}")
        del bufs  # the object store's buffer is released once nothing views it
        if values[0] == rank:
            got = message_values
        clock.add("copy_in_s", t0)
    while k < len(todo):
        k = _copy_batch(src_state, dest, todo, k, (who, src_who), clock, time.perf_counter())
    return got, _done(clock)


def receive_direct(dest: dict, who: str, local: Local | None,
                   incoming: Sequence[tuple[int, Sequence[Move]]], messages: Sequence[Any],
                   values: tuple[Any, Sequence[str]]) -> tuple[dict | None, dict]:
    """:func:`receive` for messages that came by Ray Direct Transport: ``messages[k]`` is the
    message of ``incoming[k]``, already received (RDT delivers a task's arguments before it runs)."""
    clock = _Clock()
    src_state, src_who, todo = local if local is not None else ({}, "", ())
    got = _local_values(src_state, values, src_who)
    t0 = time.perf_counter()
    for (rank, moves), message in zip(incoming, messages):
        clock.arrived()
        message_values, bufs = _unwrap(message, rank, who)
        clock.t["remote_bytes"] += copy_in(dest, moves, bufs, who, f"old rank {rank}")
        if values[0] == rank:
            got = message_values
    clock.add("copy_in_s", t0)
    k = 0
    while k < len(todo):
        k = _copy_batch(src_state, dest, todo, k, (who, src_who), clock, time.perf_counter())
    return got, _done(clock)


def _local_values(src_state: dict, values: tuple[Any, Sequence[str]], who: str) -> dict | None:
    where, keys = values
    return plain_values(src_state, keys, who) if where == "local" else None


def _copy_batch(src: dict, dest: dict, moves: Sequence[Move], k: int, who: tuple[str, str], clock: _Clock,
                t0: float) -> int:
    """Copy the local moves from index ``k`` on, about _LOCAL_BATCH_BYTES of them; returns the next index."""
    done = 0
    while k < len(moves) and done < _LOCAL_BATCH_BYTES:
        done += copy_local(src, dest, (moves[k],), *who)
        k += 1
    clock.t["local_bytes"] += done
    clock.add("local_s", t0)
    return k


def _fetch(ref, rank: int, who: str):
    try:
        message = ray.get(ref)
    except rex.RayActorError:
        err = CheckpointError(f"{who}: the actor of old rank {rank} died before it sent its pieces")
        err.dead_sources = (rank,)
        raise err from None
    except rex.RayError as exc:
        raise CheckpointError(f"{who}: the pieces of old rank {rank} could not be fetched "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from None
    return _unwrap(message, rank, who)


def _unwrap(message: Any, rank: int, who: str):
    if isinstance(message, CheckpointError):
        raise message.copy(f"{who}: old rank {rank} could not send its pieces: {message}")
    return message


def _done(clock: _Clock) -> dict:
    clock.t["end"] = time.time()
    return clock.t
