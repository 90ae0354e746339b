"""The in-process transports: one participant, or N ranks as threads of one process.

:class:`LocalTransport` serves ``group=None`` (reduce inline, exchange with itself);
:class:`ThreadTransport` runs a group's ranks as threads that meet at one rendezvous
per call (:class:`_ThreadHub`), for tests and tools. Both keep the contract of
:mod:`raydcp.transport.interface`.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable

from ..errors import CheckpointError, RanksTimedOutError
from .interface import Outgoing, Transport, run_reduce, unwrap

__all__ = ["LocalTransport", "ThreadTransport"]


class LocalTransport(Transport):
    """One participant: reduce runs inline, exchange returns what it sent to itself."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def reduce_scatter(self, step, local, reduce_fn):
        return unwrap(run_reduce(step, [local], reduce_fn)[0])

    def exchange(self, step, outgoing):
        bad = [r for r in outgoing if r != 0]
        if bad:
            raise CheckpointError(f"{step}: destination ranks {bad} do not exist in a group of 1")
        return list(outgoing.get(0, []))


class _ThreadHub:
    """Shared state of a ThreadTransport group: one rendezvous per step."""

    def __init__(self, world_size: int, timeout_s: float):
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.cond = threading.Condition()
        self.rounds: dict[tuple[int, str], dict[int, Any]] = {}
        self.results: dict[tuple[int, str], list[Any]] = {}
        self.failed: CheckpointError | None = None  # set once: every later call of the group fails

    def rendezvous(self, seq: int, step: str, rank: int, value: Any, combine: Callable[[list[Any]], list[Any]]):
        key = (seq, step)
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            if self.failed is not None:
                return self.failed
            arrived = self.rounds.setdefault(key, {})
            if rank in arrived:  # a second caller for this rank: the group's operation fails on every rank
                self.failed = CheckpointError(
                    f"{step}: rank {rank} arrived twice at call {seq}; two callers use the same rank of one "
                    "group (two unrelated operations sharing it?), so the operation fails on every rank")
                for k, got in self.rounds.items():
                    if k not in self.results:
                        self.results[k] = [self.failed] * self.world_size
                self.cond.notify_all()
                return self.failed
            arrived[rank] = value
            if len(arrived) == self.world_size:
                self.results[key] = combine([arrived[r] for r in range(self.world_size)])
                self.cond.notify_all()
            while key not in self.results:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - set(arrived))
                    raise RanksTimedOutError(
                        f"{step}: ranks {missing} did not arrive within {self.timeout_s:g}s "
                        f"(rank {rank} waited); check that every rank calls with the same group, "
                        f"or raise Group(timeout_s=...)", missing_ranks=missing, timeout_s=self.timeout_s
                    )
                self.cond.wait(left)
            return self.results[key][rank]


class ThreadTransport(Transport):
    """N ranks as threads of one process. Build them together with :meth:`group`."""

    def __init__(self, hub: _ThreadHub, rank: int):
        self._hub = hub
        self._seq = 0
        self.rank = rank
        self.world_size = hub.world_size

    @classmethod
    def group(cls, world_size: int, timeout_s: float = 60.0) -> list["ThreadTransport"]:
        hub = _ThreadHub(world_size, timeout_s)
        return [cls(hub, r) for r in range(world_size)]

    def reduce_scatter(self, step, local, reduce_fn):
        self._seq += 1
        combine = lambda values: run_reduce(step, values, reduce_fn)  # noqa: E731
        return unwrap(self._hub.rendezvous(self._seq, step, self.rank, local, combine))

    def exchange(self, step, outgoing):
        self._seq += 1
        n = self.world_size

        def route(values: list[Outgoing]) -> list[Any]:
            inbox: list[list[tuple[Any, Any]]] = [[] for _ in range(n)]
            for src, out in enumerate(values):
                for dest, items in out.items():
                    if not 0 <= dest < n:  # fail every rank, not just the one that routes
                        return [CheckpointError(f"{step}: rank {src} addressed rank {dest}, outside a group of {n}")] * n
                    inbox[dest].extend(items)
            return inbox

        return unwrap(self._hub.rendezvous(self._seq, step, self.rank, outgoing, route))
