"""The runtime's per-process state of each :class:`raydcp.Group`: the numbering of its operations.

A Group is a plain value; what a rank must remember between operations lives here, keyed by
the group's name and the rank (a process may hold several ranks of one group, e.g. threads).
Every rank numbers the operations of a group 0, 1, 2, ... in the order it takes part in them;
the ranks agree because they perform the same operations in the same order, and the number
picks the operation's coordinator in the group's coordinator host (:mod:`raydcp.runtime.actors`).
"""
from __future__ import annotations

import threading

from ..group import Group

__all__ = ["next_operation"]

_lock = threading.Lock()
_NEXT: dict[tuple[str, int], int] = {}  # (group name, rank) -> the number of its next operation


def next_operation(group: Group) -> int:
    """Number this rank's next operation of ``group`` in this process (0, 1, ...)."""
    key = (group.name, group.rank)
    with _lock:
        op = _NEXT.get(key, 0)
        _NEXT[key] = op + 1
    return op

