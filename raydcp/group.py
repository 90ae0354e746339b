"""``raydcp.Group``: who takes part in one collective save or load."""
from __future__ import annotations

from dataclasses import dataclass, field

from .errors import CheckpointError

__all__ = ["Group"]


@dataclass(frozen=True)
class Group:
    """The participants of a collective save/load.

    Every rank (a Ray actor or task) calls ``raydcp.save``/``load`` with a Group of
    the same ``name`` and ``world_size`` and its own ``rank``. Groups with different
    names run independently. ``timeout_s`` bounds every wait for the other ranks:
    past it, each waiting rank raises a :class:`CheckpointError` naming the ranks
    that did not arrive.

    One Group object is meant to be kept by its rank and reused: it counts the
    operations it takes part in, so every operation of a group gets its own
    coordinator (all ranks perform the same operations in the same order).
    """

    name: str
    rank: int
    world_size: int
    timeout_s: float = 600.0
    _ops: list = field(default_factory=lambda: [0], init=False, repr=False, compare=False)
    # The name of a coordinator host shared with other groups (see ``hosted_by``); None: its own.
    _host: str | None = field(default=None, init=False, repr=False, compare=False)

    def __init__(self, name: str, rank: int, world_size: int, *, timeout_s: float = 600.0):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "rank", rank)
        object.__setattr__(self, "world_size", world_size)
        object.__setattr__(self, "timeout_s", timeout_s)
        object.__setattr__(self, "_ops", [0])
        object.__setattr__(self, "_host", None)
        self.__post_init__()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise CheckpointError(f"Group name must be a non-empty string, got {self.name!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise CheckpointError(f"Group {self.name!r}: world_size must be an int >= 1, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise CheckpointError(
                f"Group {self.name!r}: rank must be an int in [0, {self.world_size}), got {self.rank!r}"
            )
        if not self.timeout_s > 0:
            raise CheckpointError(f"Group {self.name!r}: timeout_s must be > 0, got {self.timeout_s!r}")

    def next_operation(self) -> int:
        """Number this rank's next operation (0, 1, ...); the ranks agree because they call in step."""
        op = self._ops[0]
        self._ops[0] += 1
        return op

    def hosted_by(self, host: str) -> "Group":
        """Run this group's operations in the coordinator host of ``host`` (a long-lived group name),
        rather than in one of its own: a ShardGroup runs each operation under a fresh group name and
        all of them in one host, started once. Returns self."""
        object.__setattr__(self, "_host", host)
        return self

    def open_transport(self):
        """The transport for this group's next operation (imports the Ray runtime lazily)."""
        from .runtime.ray_transport import RayTransport

        return RayTransport(self, self.next_operation())

    def prepare(self, *, async_save: bool = False) -> None:
        """Start the group's coordinator in the background (returns at once; optional).

        The first operation of a group otherwise pays for starting it (a Ray
        actor, and the imports its reductions need); a rank that calls this at
        start-up, e.g. before its first training step, moves that cost off the
        first checkpoint. One rank is enough; every rank may call it.
        ``async_save=True`` also starts this rank's persister actor, which the
        first ``async_save`` would otherwise start (its first persist then
        competes with training for as long as the actor takes to start).
        """
        if self.world_size > 1:
            from .runtime.actors import prepare_coordinator

            prepare_coordinator(self.name, self.world_size, self.rank)
        if async_save:
            from .runtime.persister import persister_for_this_process

            persister_for_this_process().prepare()

    def open_async_persister(self):
        """This rank's background persister for async_save (imports the Ray runtime lazily)."""
        from .runtime.persister import persister_for_this_process

        return _BoundPersister(self, persister_for_this_process())


class _BoundPersister:
    def __init__(self, group: Group, persister):
        self.group, self.persister = group, persister

    def submit(self, state_dict, checkpoint_id, storage_options, cap=None):
        return self.persister.submit(self.group, state_dict, checkpoint_id, storage_options, cap)
