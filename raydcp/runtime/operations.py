"""The runtime's per-process state of each :class:`raydcp.Group`: the numbering of its operations,
and the identity of the process that numbers them.

A Group is a plain value; what a rank must remember between operations lives here, keyed by
the group's name and the rank (a process may hold several ranks of one group, e.g. threads).
Every rank numbers the operations of a group 0, 1, 2, ... in the order it takes part in them;
the ranks agree because they perform the same operations in the same order, and the number
picks the operation's coordinator in the group's coordinator host (:mod:`raydcp.runtime.actors`).

The numbers mean something only within the process that made them: a rank restarted in a new
process (a worker group restarted after a failure) numbers from 0 again. So every operation
carries its :class:`Caller`, the numbering process's identity, and the coordinator host tells
the group's incarnations apart by it (:mod:`raydcp.runtime.coordinator_host`, step 2).
"""
from __future__ import annotations

import threading
import uuid
from typing import Any, NamedTuple

import ray

from ..group import Group
from .connection import session

__all__ = ["Caller", "Operation", "next_operation", "this_caller"]


class Caller(NamedTuple):
    """The process that numbers a rank's operations, as the coordinator host sees it.

    ``id``: made once per process (the scope of its operation numbers). ``alive``: an ObjectRef
    that process owns, or None; Ray fails every wait on it once the process is gone, which is
    how the host tells a rank's dead process from a live one.
    """

    id: str
    alive: Any = None

    def named(self) -> "Caller":
        """The identity alone (what calls after an operation's first one carry)."""
        return self if self.alive is None else Caller(self.id)


class Operation(NamedTuple):
    """One operation of a group on one rank: its number, and the process that numbered it (which
    may hand the operation to another process, as a rank hands an async save to its persister)."""

    number: int
    caller: Caller


_lock = threading.Lock()
_NEXT: dict[tuple[str, int], int] = {}  # (group name, rank) -> the number of its next operation
_ID = uuid.uuid4().hex
_ALIVE: tuple[Any, Any] | None = None  # (the Ray session it was put in, the ObjectRef)


def this_caller(*, ray_group: bool = True) -> Caller:
    """This process's :class:`Caller`. Its ``alive`` object is made where Ray is connected and
    ``ray_group`` (a group of one rank calls no host: it makes none)."""
    if not ray_group or not ray.is_initialized():
        return Caller(_ID)
    global _ALIVE
    now = session()  # an object belongs to the session it was put in: a new connection puts another
    with _lock:
        if _ALIVE is None or _ALIVE[0] != now:
            _ALIVE = (now, ray.put(_ID))
        return Caller(_ID, _ALIVE[1])


def next_operation(group: Group) -> Operation:
    """Number this rank's next operation of ``group`` in this process (0, 1, ...)."""
    key = (group.name, group.rank)
    with _lock:
        op = _NEXT.get(key, 0)
        _NEXT[key] = op + 1
    return Operation(op, this_caller(ray_group=group.world_size > 1))
