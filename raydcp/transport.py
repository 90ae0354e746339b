"""The one seam through which the ranks of a collective save or load talk.

The engine (``raydcp.engine``) never imports Ray. It is handed a
:class:`Transport`, and every distributed step goes through two calls:

1. ``reduce_scatter(step, local, reduce_fn)`` -- the control plane. Every rank
   calls it with its local value (plans, records: small metadata, never tensor
   data). In one place (the coordinator) ``reduce_fn(values_by_rank)`` runs and
   returns one value per rank; each rank receives its own. If any rank sent a
   :class:`~raydcp.errors.RankFailure`, ``reduce_fn`` does not run and every
   rank raises one :class:`~raydcp.errors.CheckpointError` naming the failed
   ranks. If ``reduce_fn`` raises a ``CheckpointError``, every rank raises it.
   A rank that does not arrive within the group's timeout makes every waiting
   rank raise a ``CheckpointError`` naming the missing ranks.
2. ``exchange(step, outgoing)`` -- the data plane. ``outgoing`` maps a
   destination rank to a list of ``(tag, buffer)`` pairs, buffers being
   contiguous ``torch.uint8`` tensors. Every rank calls it once per step and
   receives the pairs all ranks addressed to it (``(tag, buffer)`` with a
   bytes-like buffer). Buffers a rank sends stay valid until that rank's next
   ``reduce_scatter`` returns, which is why the engine always ends an operation
   with one.

Every rank makes the same calls in the same order. Implementations:
:class:`LocalTransport` (one participant, ``group=None``), :class:`ThreadTransport`
(N ranks as threads of one process, for tests and tools) and the Ray transport
in ``raydcp.runtime`` (ranks are Ray actors or tasks; a coordinator actor runs
``reduce_fn``; buffers travel through the object store).
"""
from __future__ import annotations

import abc
import gc
import threading
import time
from typing import Any, Callable

import torch

from .errors import CheckpointError, RankFailure, raise_failures

__all__ = ["Transport", "LocalTransport", "ThreadTransport", "run_reduce"]

ReduceFn = Callable[[list[Any]], list[Any]]
Outgoing = dict[int, list[tuple[Any, torch.Tensor]]]


class Transport(abc.ABC):
    rank: int
    world_size: int

    @abc.abstractmethod
    def reduce_scatter(self, step: str, local: Any, reduce_fn: ReduceFn) -> Any:
        """Gather ``local`` from every rank, reduce in one place, scatter: see module doc."""

    @abc.abstractmethod
    def exchange(self, step: str, outgoing: Outgoing) -> list[tuple[Any, Any]]:
        """Send tagged byte buffers to other ranks and receive theirs: see module doc."""

    def close(self) -> None:
        """Release what the transport holds for this operation (called once, at the end)."""


def run_reduce(step: str, values: list[Any], reduce_fn: ReduceFn) -> list[Any]:
    """Apply ``reduce_fn`` the way every transport must: failures first, then one value per rank.

    Returns the per-rank results, or a list holding the same ``CheckpointError``
    for every rank when a rank failed or the reduction raised.
    """
    n = len(values)
    gc_was_on = gc.isenabled()
    gc.disable()  # planning builds many small acyclic objects: collections only cost time here
    try:
        raise_failures(step, [v for v in values if isinstance(v, RankFailure)])
        out = reduce_fn(values)
        if len(out) != n:
            raise CheckpointError(f"{step}: internal error, reduction returned {len(out)} results for {n} ranks")
        return list(out)
    except CheckpointError as exc:
        return [exc] * n
    except Exception as exc:  # a bug in planning must still fail every rank, not hang them
        err = CheckpointError(f"{step} failed in the coordinator: {type(exc).__name__}: {exc}")
        return [err] * n
    finally:
        if gc_was_on:
            gc.enable()


def _unwrap(value: Any) -> Any:
    if isinstance(value, CheckpointError):
        raise CheckpointError(str(value), value.failures)
    return value


class LocalTransport(Transport):
    """One participant: reduce runs inline, exchange returns what it sent to itself."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1

    def reduce_scatter(self, step, local, reduce_fn):
        return _unwrap(run_reduce(step, [local], reduce_fn)[0])

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

    def rendezvous(self, seq: int, step: str, rank: int, value: Any, combine: Callable[[list[Any]], list[Any]]):
        key = (seq, step)
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            arrived = self.rounds.setdefault(key, {})
            arrived[rank] = value
            if len(arrived) == self.world_size:
                self.results[key] = combine([arrived[r] for r in range(self.world_size)])
                self.cond.notify_all()
            while key not in self.results:
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(set(range(self.world_size)) - set(arrived))
                    raise CheckpointError(
                        f"{step}: ranks {missing} did not arrive within {self.timeout_s:g}s "
                        f"(rank {rank} waited); check that every rank calls with the same group, "
                        f"or raise Group(timeout_s=...)"
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
        return _unwrap(self._hub.rendezvous(self._seq, step, self.rank, local, combine))

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

        return _unwrap(self._hub.rendezvous(self._seq, step, self.rank, outgoing, route))
