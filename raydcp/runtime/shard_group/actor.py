"""One member of a ShardGroup: holds a flat state dict of pieces and runs collective steps.

A plain class (``raydcp.runtime.actors`` makes it a Ray actor). Every collective
method takes the name of the ShardGroup whose state it works on (its *slot*) and a
``group`` spec ``(name, rank, world_size, timeout_s, host)`` from the driver -- a
fresh name per operation, so a failed operation never leaves the next one out of
step, run in the ShardGroup's one coordinator host -- and returns its result, or
the ``CheckpointError`` it raised (as a value: the driver gathers every rank's
outcome and raises once). The steps of a reshard (``publish``, ``take``) need no
group spec: the driver plans them alone (``raydcp.runtime.shard_group.group_reshard``).
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Iterable, Sequence

import torch

from ...engine import load_with, save_with, transfer_with
from ...errors import CheckpointError
from ...group import Group
from ...state import Shard
from ...planner.layouts import Specs
from ...transport import Transport
from ..ray_transport import RayTransport
from .piece_tensors import empty_state
from .reshard_steps import Incoming, publish, receive, receive_direct

__all__ = ["ShardActor"]

# (operation's group name, rank, world size, timeout_s[, the coordinator host's group name])
GroupSpec = tuple


class ShardActor:
    """Holds the pieces of every ShardGroup this actor is a member of, by group name.

    An actor can belong to several groups at once: ``ShardGroup.reshard`` keeps the
    source group's actors as members of the new group where they hold the most of
    their new pieces already, so a reshard starts actors only for the ranks it adds.
    """

    def __init__(self, rank: int, world_size: int):
        self.rank = rank  # the rank it was started for (its first group's)
        self.world_size = world_size
        # Ray sets CUDA_VISIBLE_DEVICES to the GPUs it assigned, so the first visible one is ours.
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        self.states: dict[str, dict[str, Any]] = {}  # group name -> its flat state on this actor
        self._dropped: set[str] = set()
        self._prepared: dict[str, tuple] = {}  # by the group that prepared them: (what for, pieces)
        self.transfer_log: list[tuple] = []  # (step, wall-clock start, end, bytes) of recent reshard steps

    # -- collective steps (every rank of the group at once) -----------------------------
    def load(self, slot: str, group: GroupSpec, checkpoint_id: str, fresh: tuple | None, strict: bool,
             storage_options: dict | None):
        """Load into group ``slot``'s state in place, or (``fresh=(specs, value_keys, layout)``) into new pieces."""
        def run():
            rank, world_size = group[1], group[2]
            state = self._empty(*fresh, rank, world_size) if fresh is not None else self._state(slot)
            # fresh pieces are dropped when the load fails: no undo copy of them (the held ones get one)
            self._run(group, lambda t: load_with(t, state, checkpoint_id, strict=strict,
                                                 storage_options=storage_options, fresh=fresh is not None))
            self._keep(slot, state)
            return None

        return self._outcome(run)

    def save(self, slot: str, group: GroupSpec, checkpoint_id: str, storage_options: dict | None, options=None):
        """Save group ``slot``'s state (with ``options``, a SaveOptions or None); rank 0 returns the
        Metadata (the others None, to ship it once)."""
        def run():
            # the ShardGroup (not its operation's Group) is who saves, for a delta's base="previous"
            md = self._run(group, lambda t: save_with(t, self._state(slot), checkpoint_id, storage_options, options,
                                                      writer=f"shardgroup-{slot}"))
            return md if group[1] == 0 else None

        return self._outcome(run)

    def send(self, slot: str, group: GroupSpec):
        """Serve group ``slot``'s pieces to a transfer (in-memory reshard) as a source rank."""
        def run():
            self._run(group, lambda t: transfer_with(t, self._state(slot), None))
            return None

        return self._outcome(run)

    # -- a ShardGroup reshard (raydcp.runtime.shard_group.reshard_steps): no coordinator, one message per pair
    def publish(self, slot: str, rank: int, moves: Sequence, value_keys: Sequence[str] | None, rdt: bool = False):
        """The message of rank ``rank`` of group ``slot`` to one new rank: (plain values or None, one
        buffer per move), views of the held pieces; or the CheckpointError."""
        t0 = time.time()
        self._at("reshard: publish", None)
        out = self._outcome(lambda: publish(self._state(slot), f"rank {rank} of ShardGroup '{slot}'", moves,
                                            value_keys, rdt=rdt))
        self._log("publish", t0, sum(m[4] for m in moves))
        return out

    def take(self, slot: str, rank: int, world_size: int, specs: Specs, value_keys: Sequence[str], layout: str,
             prepared_by: str | None, local: tuple[str, int, Sequence] | None, incoming: Sequence[Incoming],
             values_from: Any, timeout_s: float):
        """Receive new rank ``rank`` of group ``slot`` (of ``world_size``, in ``layout``): ``local`` =
        (the old group, its rank on this actor, the moves copied from its pieces here), ``incoming``: the messages of the old
        ranks, as they arrive. Returns the phase timings, or the CheckpointError."""
        def run(state, who, src):
            return receive(state, who, src, incoming, (values_from, value_keys), timeout_s)

        return self._take(slot, rank, world_size, specs, value_keys, layout, prepared_by, local, run)

    def take_direct(self, slot: str, rank: int, world_size: int, specs: Specs, value_keys: Sequence[str],
                    layout: str, prepared_by: str | None, local: tuple[str, int, Sequence] | None,
                    incoming: Sequence[tuple[int, Sequence]], values_from: Any, *messages):
        """:meth:`take` with the messages sent by Ray Direct Transport (the task's arguments ``messages``)."""
        def run(state, who, src):
            return receive_direct(state, who, src, incoming, messages, (values_from, value_keys))

        return self._take(slot, rank, world_size, specs, value_keys, layout, prepared_by, local, run)

    def _take(self, slot, rank, world_size, specs, value_keys, layout, prepared_by, local, run):
        t0 = time.time()
        self._at("reshard: receive", None)

        def step():
            state = self._pieces(prepared_by, specs, value_keys, layout, rank, world_size)
            who = f"rank {rank} of ShardGroup '{slot}'"
            src = None
            if local is not None:  # (old group, its rank here, moves)
                src = (self._state(local[0]), f"rank {local[1]} of ShardGroup '{local[0]}'", local[2])
            values, timings = run(state, who, src)
            if value_keys:
                if values is None:
                    raise CheckpointError(f"{who} received no plain values ({', '.join(value_keys)}); "
                                          f"the reshard's plan names no sender for them (a bug)")
                state.update(values)
            self._keep(slot, state)
            return timings

        out = self._outcome(step)
        self._log("take", t0, 0)
        return out

    def transfer_steps(self, clear: bool = True) -> list[tuple]:
        """The reshard steps this actor ran lately: (step, wall-clock start, end, bytes published)."""
        out = list(self.transfer_log)
        if clear:
            self.transfer_log.clear()
        return out

    def prepare_receive(self, prepared_by: str, rank: int, world_size: int, specs: Specs,
                        value_keys: Iterable[str], layout: str) -> None:
        """Allocate (and touch) the pieces a later ``receive`` of ``rank`` of ``world_size`` fills,
        ahead of it (``ShardGroup.prepare_reshard``): the reshard then only moves bytes."""
        state = self._empty(specs, value_keys, layout, rank, world_size)
        for v in state.values():
            t = v.tensor if isinstance(v, Shard) else v
            if isinstance(t, torch.Tensor) and t.numel():
                t.view(-1).view(torch.uint8).zero_()  # the page faults happen here, not in the reshard
        self._prepared[prepared_by] = ((rank, world_size, layout, _spec_key(specs, value_keys)), state)

    def drop(self, slot: str) -> None:
        """Forget group ``slot``'s state (that group shut down or gave this actor up), and what it prepared."""
        self._dropped.add(slot)
        self.states.pop(slot, None)
        self._prepared.pop(slot, None)

    # -- local queries ---------------------------------------------------------------
    def info(self) -> dict:
        return {
            "rank": self.rank,
            "pid": os.getpid(),
            "device": str(self.device),
            "cuda_available": torch.cuda.is_available(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "keys": {slot: len(state) for slot, state in self.states.items()},
        }

    def apply(self, fn: Callable, *args) -> Any:
        """Run ``fn(state, *args)`` on the state of this actor's only group (inspection, tests, tools)."""
        return fn(self._state(None), *args)

    def apply_to(self, slot: str, fn: Callable, *args) -> Any:
        """Run ``fn(state, *args)`` on group ``slot``'s state."""
        return fn(self._state(slot), *args)

    # -- helpers -----------------------------------------------------------------------
    def _state(self, slot: str | None) -> dict:
        if slot is None:  # the only group's state
            if len(self.states) > 1:
                raise CheckpointError(
                    f"this actor holds the state of several ShardGroups ({', '.join(sorted(self.states))}); "
                    f"name one: ShardGroup.apply(fn) or actor.apply_to(group_name, fn)")
            return next(iter(self.states.values()), {})
        return self.states.get(slot, {})

    def _keep(self, slot: str, state: dict) -> None:
        if slot not in self._dropped:  # a group that shut down while this step ran keeps nothing here
            self.states[slot] = state

    def _pieces(self, prepared_by: str | None, specs: Specs, value_keys: Iterable[str], layout: str, rank: int,
                world_size: int) -> dict:
        """The pieces ``prepare_receive`` allocated for ``prepared_by`` if they fit, new ones otherwise."""
        ready = self._prepared.pop(prepared_by, None)
        if ready is not None and ready[0] == (rank, world_size, layout, _spec_key(specs, value_keys)):
            return ready[1]
        return self._empty(specs, value_keys, layout, rank, world_size)

    def _at(self, step: str, transport: Transport | None = None) -> None:
        """Called as this actor enters ``step`` of an operation (a hook: tests inject faults here)."""

    def _log(self, step: str, t0: float, nbytes: int) -> None:
        self.transfer_log.append((step, t0, time.time(), nbytes))
        del self.transfer_log[:-64]

    def _empty(self, specs: Specs, value_keys: Iterable[str], layout: str, rank: int, world_size: int) -> dict:
        return empty_state(specs, value_keys, layout, rank, world_size, self.device)

    def _run(self, group: GroupSpec, step: Callable[[Transport], Any]) -> Any:
        """Run ``step`` over the transport of the operation ``group`` describes (closed after it)."""
        transport = self._open(group)
        try:
            return step(transport)
        finally:
            transport.close()

    def _open(self, group: GroupSpec) -> Transport:
        """The transport of the operation ``group`` describes: its only operation (a fresh group name
        per operation), in the ShardGroup's coordinator host if it names one (subclasses may wrap it,
        e.g. to inject faults in tests)."""
        g = Group(*group[:3], timeout_s=group[3])
        return RayTransport(g, 0, host=group[4] if len(group) > 4 and group[4] else None)

    @staticmethod
    def _outcome(fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except CheckpointError as exc:
            return exc


def _spec_key(specs: Specs, value_keys: Iterable[str]) -> tuple:
    return tuple((k, tuple(shape), dtype) for k, (shape, dtype) in specs.items()), tuple(value_keys)
