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

Every rank makes the same calls in the same order. Every implementation reduces
with :func:`run_reduce` (failures first, then one value per rank) and hands each
rank its value through :func:`unwrap` (an error raises on every rank). A
transport that keeps something for a group between its operations (the Ray
coordinator keeps a :class:`~raydcp.planner.PlanCache` per group) passes it to
:func:`run_reduce`; a reduce function made with :class:`Reusing` receives it.
Implementations: :class:`~raydcp.transport.local.LocalTransport` (one participant,
``group=None``), :class:`~raydcp.transport.local.ThreadTransport` (N ranks as
threads of one process, for tests and tools) and the Ray transport in
``raydcp.runtime`` (ranks are Ray actors or tasks; a coordinator actor runs
``reduce_fn``; buffers travel through the object store, control-plane values as
:class:`~raydcp.transport.wire.Wire`).
"""
from __future__ import annotations

import abc
import gc
from contextvars import ContextVar
from typing import Any, Callable

import torch

from ..errors import CheckpointError, RankFailure, coordinator_error, raise_failures

__all__ = ["Transport", "ReduceFn", "Outgoing", "Reusing", "run_reduce", "unwrap"]

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


_CACHE: ContextVar[Any] = ContextVar("raydcp_reduce_cache", default=None)


class Reusing:
    """A reduce function that may reuse what the group's earlier reductions computed: called with
    the rank values, it calls ``fn(*args, values, cache=cache, **kwargs)``, ``cache`` being what the
    transport passed to :func:`run_reduce` for this reduction (None where it keeps nothing). It
    reaches the function through whatever wraps it on the way (a host's decoding of the values)."""

    __slots__ = ("fn", "args", "kwargs")

    def __init__(self, fn: Callable, *args: Any, **kwargs: Any):
        self.fn, self.args, self.kwargs = fn, args, kwargs

    def __call__(self, values: list[Any]) -> list[Any]:
        return self.fn(*self.args, values, cache=_CACHE.get(), **self.kwargs)

    def __reduce__(self):
        return (_reusing, (self.fn, self.args, self.kwargs))


def _reusing(fn: Callable, args: tuple, kwargs: dict) -> Reusing:
    return Reusing(fn, *args, **kwargs)


def run_reduce(step: str, values: list[Any], reduce_fn: ReduceFn, cache: Any = None) -> list[Any]:
    """Apply ``reduce_fn`` the way every transport must: failures first, then one value per rank.

    Returns the per-rank results, or a list holding the same ``CheckpointError``
    for every rank when a rank failed or the reduction raised. ``cache``: what the transport
    keeps for the group, handed to a :class:`Reusing` reduce function.
    """
    n = len(values)
    gc_was_on = gc.isenabled()
    gc.disable()  # planning builds many small acyclic objects: collections only cost time here
    token = _CACHE.set(cache)
    try:
        raise_failures(step, [v for v in values if isinstance(v, RankFailure)])
        out = reduce_fn(values)
        if len(out) != n:
            raise CheckpointError(f"{step}: internal error, reduction returned {len(out)} results for {n} ranks")
        return list(out)
    except CheckpointError as exc:
        return [exc] * n
    except Exception as exc:  # a bug in planning must still fail every rank, not hang them
        err = coordinator_error(step, exc)
        return [err] * n
    finally:
        _CACHE.reset(token)
        if gc_was_on:
            gc.enable()


def unwrap(value: Any) -> Any:
    """A rank's value from a reduction or exchange: raised where :func:`run_reduce` made it an error."""
    if isinstance(value, CheckpointError):
        raise value.copy()  # a copy per rank: ranks in threads of one process raise it at once
    return value
