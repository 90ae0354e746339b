"""``raydcp.Group``: who takes part in one collective save or load (a plain immutable value)."""
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

    A Group is a value: it holds no state. The Ray runtime numbers the operations of
    each group per process (by name and rank), so every operation of a group gets its
    own coordinator as long as all ranks perform the same operations in the same order.
    A name belongs to one live set of processes at a time: ranks restarted in new processes
    (the old ones gone or finished) reuse it from their first operation; a second live caller
    for a rank of a running operation is refused.
    """

    name: str
    rank: int
    world_size: int
    timeout_s: float = field(default=600.0, kw_only=True)

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
